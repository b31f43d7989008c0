"""Built-in metric trackers."""

from roll_core.hookspecs import hookimpl

_T = "roll_core.trackers"
_EXTRA = "pip install 'roll-core[trackers]'"


@hookimpl
def roll_register_trackers(register):
    register("stdout", f"{_T}:StdoutTracker",
             description="a live progress line in a terminal; piped, a line every max_steps/20 steps")
    register("jsonl", f"{_T}:JsonlTracker", description="<output_dir>/metrics.jsonl")
    register("tensorboard", f"{_T}:TensorboardTracker", description="<output_dir>/tensorboard event files")
    register("swanlab", f"{_T}:SwanLabTracker", description="SwanLab, offline: <output_dir>/swanlab "
             "(SWANLAB_MODE=online|local to change)", requires={"swanlab": _EXTRA})
    register("wandb", f"{_T}:WandbTracker", description="Weights & Biases, offline: <output_dir>/wandb "
             "(WANDB_MODE=online to change)", requires={"wandb": _EXTRA})
