"""Built-in metric trackers."""

from roll_core.hookspecs import hookimpl

_T = "roll_core.trackers"


@hookimpl
def roll_register_trackers(register):
    register("stdout", f"{_T}:StdoutTracker", description="one line per step")
    register("jsonl", f"{_T}:JsonlTracker", description="<output_dir>/metrics.jsonl")
    register("tensorboard", f"{_T}:TensorboardTracker", description="<output_dir>/tensorboard event files")
