"""Trackers: several at once, each one's files read back with its own format, and steps replayed
after a resume written once; the services' run names, config and mode; the display's lines and
the time left it prints."""

import json
import struct
from pathlib import Path

import pytest

from conftest import metrics_of

from roll_core.trackers import JsonlTracker, TensorboardTracker, _ForwardOnly


def _log_records(path: Path):
    """The records of a LevelDB-log file, the format SwanLab's ``.swanlab`` and W&B's ``.wandb``
    files share: a 7-byte file header, then 32 KiB blocks of records, each with a 7-byte header
    (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    data, block = path.read_bytes(), 32768
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in the block for a header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        else:
            pending += chunk
            if kind == 4:
                yield pending


def _swanlab_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record

    (path,) = run_dir.glob("swanlab/run-*/run-*.swanlab")
    out: dict[str, dict[int, float]] = {}
    for raw in _log_records(path):
        record = Record()
        record.ParseFromString(raw)
        if record.HasField("scalar"):
            out.setdefault(record.scalar.key, {})[record.scalar.step] = record.scalar.value.number
    return out


def _wandb_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from wandb.proto.wandb_internal_pb2 import Record

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    out: dict[str, dict[int, float]] = {}
    for raw in _log_records(path):
        record = Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            step = items.pop("_step")
            for key, value in items.items():
                if not key.startswith("_"):
                    out.setdefault(key, {})[int(step)] = value
    return out


def _tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_the_quickstart_writes_the_same_metrics_to_every_tracker_at_once(tiny_config, monkeypatch):
    for package in ("swanlab", "wandb"):
        pytest.importorskip(package, reason="pip install 'roll-core[trackers]' (the README's setup does)")
    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.runtime.executor import LocalExecutor

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("SWANLAB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny_config("trackers=[jsonl, tensorboard, swanlab, wandb]", "trainer.max_steps=3")
    RLVRPipeline(cfg, LocalExecutor()).run()
    run_dir = Path(cfg.output_dir)
    rows = metrics_of(run_dir)
    expected = {key: {r["step"]: r[key] for r in rows if key in r}
                for key in ("reward/mean", "train/pg_loss", "eval/accuracy", "warmup/loss")}
    assert sorted(expected["reward/mean"]) == [1, 2, 3] and expected["eval/accuracy"]  # step 0 and the end
    for name, read in (("tensorboard", _tensorboard_scalars), ("swanlab", _swanlab_scalars),
                       ("wandb", _wandb_scalars)):
        got = read(run_dir)
        for key, by_step in expected.items():
            assert got[key] == pytest.approx(by_step, rel=1e-6), (name, key)


def test_a_resumed_run_writes_each_replayed_step_once(tmp_path):
    """Steps 0-5 logged, the run resumes from a checkpoint at step 3 and logs 4-5 again (new values)."""
    jsonl, board = JsonlTracker(tmp_path), TensorboardTracker(tmp_path)
    sent = []

    class Service(_ForwardOnly):
        def send(self, metrics, step):
            sent.append((step, metrics["x"]))

    service = Service(tmp_path)
    for tracker in (jsonl, board, service):
        tracker.rewind(-1)
        for step in range(6):
            tracker.log({"x": float(step)}, step)
        tracker.rewind(3)
        for step in (4, 5):
            tracker.log({"x": 10.0 * step}, step)
        tracker.close()
    rows = metrics_of(tmp_path)
    assert [(r["step"], r["x"]) for r in rows] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 40), (5, 50)]
    assert _tensorboard_scalars(tmp_path)["x"] == {0: 0, 1: 1, 2: 2, 3: 3, 4: 40, 5: 50}
    assert sent == [(s, float(s)) for s in range(6)]  # a service that cannot take points back: the first values

    again = JsonlTracker(tmp_path)  # a fresh start in the same directory forgets the old run
    again.rewind(-1)
    again.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_line_cut_short_by_a_stopped_run_is_dropped_on_resume_and_a_bad_line_is_named(tmp_path):
    """A run stopped while writing its metrics leaves a last line without its newline. Reading
    leaves that line out, and a resume rewinds over it: the next step's line starts a line of its
    own. A complete line that is not JSON is an error that names it."""
    from roll_core.errors import RollError
    from roll_core.report import load_run
    from roll_core.trackers import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "x": 1.5}\n{"step": 1, "x": 2.5}\n{"step": 2, "x"')
    assert read_metrics(path) == [{"step": 0, "x": 1.5}, {"step": 1, "x": 2.5}]
    assert load_run(tmp_path).series["x"] == ([0, 1], [1.5, 2.5])  # roll report reads it the same way
    tracker = JsonlTracker(tmp_path)
    tracker.rewind(1)
    tracker.log({"x": 3.5}, 2)
    tracker.close()
    assert path.read_text() == '{"step": 0, "x": 1.5}\n{"step": 1, "x": 2.5}\n{"step": 2, "x": 3.5}\n'
    path.write_text('{"step": 0}\n{"step": 1, "x"\n{"step": 2}\n')
    with pytest.raises(RollError, match=r"metrics.jsonl, line 2: not a metrics row \(.*\): '\{\"step\": 1, \"x\"'"):
        read_metrics(path)
    path.write_text('{"step": 0}\nnot json\n')  # a last line that is whole (it has its newline) is no torn one
    with pytest.raises(RollError, match="line 2: not a metrics row"):
        read_metrics(path)
    path.write_text('{"step": 0}\nnot json\n{"step": 2')  # only the last line can be a torn one
    with pytest.raises(RollError, match="line 2: not a metrics row"):
        read_metrics(path)
    path.write_text('{"step": 0}\n\n{"step": 1}\n')  # blank lines carry nothing
    assert read_metrics(path) == [{"step": 0}, {"step": 1}]


def test_the_live_line_prints_evaluations_above_it_and_finishes_before_the_run_ends(tmp_path, monkeypatch):
    """In a terminal the stdout tracker keeps one rich progress line; an evaluation is printed above
    it with its step (rich must not read "[step 2]" as markup), and the bar stops at the last step."""
    import io

    from rich.console import Console
    from rich.progress import Progress, TextColumn

    import roll_core.trackers as trackers

    screen = io.StringIO()

    def bar(total, description):
        progress = Progress(TextColumn("{task.completed}/{task.total} {task.fields[info]}"),
                            console=Console(file=screen, force_terminal=True, width=200))
        return progress, progress.add_task(description, total=total, info="")

    monkeypatch.setattr(trackers, "progress_bar", bar)
    tracker = trackers.StdoutTracker(tmp_path, _config(**{"trainer.max_steps": 3}))
    tracker.live = True
    tracker.log({"reward/mean": 0.5}, 1)
    tracker.log({"reward/mean": 0.6, "eval/accuracy": 0.7}, 2)
    tracker.log({"reward/mean": 0.8}, 3)
    assert tracker.progress is None  # stopped at the last step
    text = screen.getvalue()
    assert "[step 2] reward/mean=0.6 eval/accuracy=0.7" in text and "3/3 reward/mean=0.8" in text
    assert "[step 1]" not in text and "[step 3]" not in text  # only evaluations go above the line
    tracker.close()

    early = trackers.StdoutTracker(tmp_path, _config(**{"trainer.max_steps": 3}))
    early.live = True
    early.log({"reward/mean": 0.5}, 1)
    assert early.progress.live.is_started
    early.close()  # a run that ends before its last step (an error, Ctrl-C) stops its bar too
    assert not early.progress.live.is_started


# -- each tracker's own rules -------------------------------------------------------------------------------

def _config(**fields):
    from roll_core.config import load_config

    return load_config(None, [f"{k}={v}" for k, v in fields.items()])


def test_swanlab_and_wandb_runs_are_named_after_the_experiment_and_the_run_and_carry_the_config(
        tmp_path, monkeypatch):
    for package in ("swanlab", "wandb"):
        pytest.importorskip(package, reason="pip install 'roll-core[trackers]' (the README's setup does)")
    import yaml
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record as SwanLabRecord
    from wandb.proto.wandb_internal_pb2 import Record as WandbRecord

    from roll_core.trackers import SwanLabTracker, WandbTracker

    for name in ("SWANLAB_MODE", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir, config = tmp_path / "run7", _config(exp_name="myexp", seed=11)
    run_dir.mkdir()
    for cls in (SwanLabTracker, WandbTracker):
        tracker = cls(run_dir, config)
        tracker.log({"a/b": 1.5}, 1)
        tracker.close()
    (swanlab_log,) = run_dir.glob("swanlab/run-*/run-*.swanlab")
    records = [SwanLabRecord.FromString(raw) for raw in _log_records(swanlab_log)]
    (start,) = [r.start for r in records if r.HasField("start")]
    assert (start.project, start.name) == ("myexp", "run7") and any(r.HasField("finish") for r in records)
    (swanlab_config,) = run_dir.glob("swanlab/run-*/files/config.yaml")
    saved = yaml.safe_load(swanlab_config.read_text())
    assert saved["seed"]["value"] == 11 and saved["trainer"]["value"]["max_steps"] == config.trainer.max_steps
    (wandb_log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    wandb_records = map(WandbRecord.FromString, _log_records(wandb_log))
    (run,) = [r.run for r in wandb_records if r.WhichOneof("record_type") == "run"]
    items = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert (run.project, run.display_name, items["seed"], items["exp_name"]) == ("myexp", "run7", 11, "myexp")


def test_the_services_mode_is_the_users_when_set(tmp_path, monkeypatch):
    for package in ("swanlab", "wandb"):
        pytest.importorskip(package, reason="pip install 'roll-core[trackers]' (the README's setup does)")
    from roll_core.trackers import SwanLabTracker, WandbTracker

    monkeypatch.setenv("SWANLAB_MODE", "disabled")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for cls in (SwanLabTracker, WandbTracker):
        tracker = cls(tmp_path, None)
        tracker.log({"a/b": 1.5}, 1)
        tracker.close()
    assert list(tmp_path.iterdir()) == []  # disabled: nothing written, where offline writes a run


def test_piped_lines_give_the_time_left_from_the_first_step_logged(monkeypatch, capsys, tmp_path):
    """Steps 1-45 of 45 (a line every 2nd step, and the last), 2 s a step from step 1 on; step 1 is
    logged twice (its metrics, then an evaluation's, 4 s later), which must not restart the clock."""
    from types import SimpleNamespace

    import roll_core.trackers as trackers

    clock = iter([0.0, 4.0, *(2.0 * (step - 1) for step in range(2, 46))])
    # the module's own name for `time` only: threads of earlier tests keep the real clock
    monkeypatch.setattr(trackers, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    tracker = trackers.StdoutTracker(tmp_path, _config(**{"trainer.max_steps": 45}))
    tracker.log({"reward/mean": 0.5}, 1)
    tracker.log({"eval/accuracy": 0.25}, 1)  # the same step again, 4 s later
    for step in range(2, 46):
        tracker.log({"reward/mean": 0.5, "train/other": 1.0}, step)
        tracker.log({"train/other": 1.0}, step)  # nothing the display shows: no line
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[step 1/45] eval/accuracy=0.25"  # an evaluation: printed, with no time left yet
    assert lines[1] == "[step 2/45] reward/mean=0.5 eta 1:26"  # (2 - 0) s / (2 - 1) steps x 43 steps left
    assert lines[2] == "[step 4/45] reward/mean=0.5 eta 1:22"  # 6 s / 3 steps x 41
    assert lines[-3:] == ["[step 42/45] reward/mean=0.5 eta 0:06", "[step 44/45] reward/mean=0.5 eta 0:02",
                          "[step 45/45] reward/mean=0.5 eta 0:00"]
    assert [int(line.split()[1].split("/")[0]) for line in lines[1:]] == [*range(2, 45, 2), 45]  # and the last


def test_without_a_run_length_every_step_prints_a_plain_line(capsys, tmp_path):
    from roll_core.trackers import StdoutTracker

    tracker = StdoutTracker(tmp_path)  # built by hand: no config
    for step in (0, 1, 2, 3):
        tracker.log({"reward/mean": step / 4}, step)
    tracker.log({"train/other": 1.0}, 4)
    assert capsys.readouterr().out.splitlines() == [f"[step {s}] reward/mean={s / 4:.4g}" for s in range(4)]


@pytest.mark.parametrize("pipeline, metrics, shown", [
    ("sft", {"warmup/loss": 0.5, "warmup/grad_norm": 1.0}, "warmup/loss=0.5"),
    ("dpo", {"dpo/loss": 0.5, "dpo/rewards/margin": 0.1, "eval/rewards/accuracy": 0.75},
     "dpo/loss=0.5 eval/rewards/accuracy=0.75"),
    ("reward_model", {"reward_model/loss": 0.5, "reward_model/rewards/accuracy": 0.6}, "reward_model/loss=0.5"),
    ("distill", {"distill/loss": 0.5, "eval/kl_to_teacher": 0.25}, "distill/loss=0.5 eval/kl_to_teacher=0.25"),
    ("agentic", {"episode/success_rate": 0.5, "train/pg_loss": 0.1}, "episode/success_rate=0.5 train/pg_loss=0.1"),
])
def test_every_built_in_pipeline_s_steps_show_on_stdout(pipeline, metrics, shown, capsys, tmp_path):
    """A dpo run printed nothing while it trained: none of its metrics was among the ones shown."""
    from roll_core.trackers import StdoutTracker

    StdoutTracker(tmp_path).log({**metrics, "time/iteration_s": 0.1}, 1)
    assert capsys.readouterr().out.strip() == f"[step 1] {shown}"


def test_json_lines_are_written_whole_and_keep_values_json_cannot_hold_as_text(tmp_path):
    import json
    from pathlib import Path

    from roll_core.files import write_json_lines

    target = tmp_path / "rows.jsonl"
    target.write_text('{"old": 1}\n')
    write_json_lines(target, [{"path": Path("/x/y"), "n": 1}, {"n": 2}])
    assert [json.loads(line) for line in target.read_text().splitlines()] == [{"path": "/x/y", "n": 1}, {"n": 2}]
    assert [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]  # no temporary file left beside it


def test_an_sft_run_counts_its_warm_up_steps_as_the_run_length(capsys, tmp_path):
    """``pipeline=sft`` makes ``warmup.steps`` steps: the display counted ``trainer.max_steps``
    (``[step 60/50] ... eta -1:39``), as did the ``roll run`` and ``roll validate`` lines."""
    from roll_core.config import load_config
    from roll_core.launch import describe_run
    from roll_core.trackers import StdoutTracker

    cfg = load_config(None, ["pipeline=sft", "warmup.steps=60", "trainer.max_steps=50"])
    StdoutTracker(tmp_path, cfg).log({"warmup/loss": 0.5}, 60)
    assert capsys.readouterr().out.startswith("[step 60/60] warmup/loss=0.5")
    assert ", 60 steps -> " in describe_run(cfg)
    assert ", 50 steps -> " in describe_run(load_config(None, ["warmup.steps=60", "trainer.max_steps=50"]))
