"""The RLVR pipeline on the tiny model: metrics, trackers, checkpoints, resume, executors."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import metrics_of, write_jsonl

from roll_core.pipelines.rlvr import RLVRPipeline
from roll_core.runtime import LocalExecutor
from roll_core.strategies import cpu_matmul


def test_local_run_writes_metrics_checkpoints_and_tensorboard(tiny_config, monkeypatch):
    from roll_core.pipelines import rlvr
    from roll_core.strategies.hf import HFTrainStrategy

    cfg = tiny_config("trackers=[jsonl,tensorboard,stdout]", "trainer.save_every=2", "algorithm.kl_metric=true")
    pipeline = RLVRPipeline(cfg, LocalExecutor())
    passes, log_probs = [], rlvr.log_probs
    monkeypatch.setattr(rlvr, "log_probs", lambda executor, group, *args, **kwargs: (
        passes.append(group.role), log_probs(executor, group, *args, **kwargs))[1])
    saved, save = [], HFTrainStrategy.save_checkpoint
    monkeypatch.setattr(HFTrainStrategy, "save_checkpoint",
                        lambda self, path: (saved.append(path), save(self, path))[1])
    summary = pipeline.run()
    # one update per step: its own first pass gives the old log-probs, so no separate pass of the actor
    assert passes == ["reference"] * 3
    assert "reference" in pipeline.roles.groups  # kl_metric: train/kl needs its log-probs
    run = __import__("pathlib").Path(cfg.output_dir)
    # the warm-up's model is exported alone: no checkpoint (the optimizer's moments) is written to make it
    assert saved and all("checkpoints" in __import__("pathlib").Path(path).parts for path in saved)
    assert (run / "warm-model" / "model.safetensors").is_file()
    rows = metrics_of(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "eval/accuracy" in rows[0] and "warmup/loss" in rows[0]
    for r in rows[1:]:
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["train/kl"] >= 0.0
    assert summary["steps"] == 3 and "accuracy_gain_pp" in summary
    assert not [k for r in rows for k in r if k.startswith(("reward/default/", "samples/"))]  # one domain: no split
    placed = json.loads((run / "placement.json").read_text())
    assert set(placed["roles"]) == {"actor_train", "actor_infer", "reference", "reward"}
    assert placed["driver_pid"] == os.getpid() and placed["nodes"] == []  # the local executor: all in this process
    steps = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert steps == ["step_000002", "step_000003"]  # keep_checkpoints=2
    ckpt = run / "checkpoints" / "step_000003"
    assert (ckpt / "actor_train" / "model" / "model.safetensors").exists()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(ckpt / "actor_train" / "model")  # Hugging Face format
    tokenizer = AutoTokenizer.from_pretrained(ckpt / "actor_train" / "model")  # whole: a server can load it alone
    assert tokenizer("47+38=")["input_ids"] == pipeline.tokenizer("47+38=")["input_ids"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    reward = acc.Scalars("reward/mean")
    assert [e.step for e in reward] == [1, 2, 3]
    assert [round(e.value, 5) for e in reward] == [round(r["reward/mean"], 5) for r in rows[1:]]


@pytest.mark.parametrize("reader", [None, "algorithm.kl_loss_coef=0.01"])
def test_the_reference_starts_only_when_something_reads_it(tiny_config, reader):
    """The quickstart configures roles.reference with no KL term: its log-probs would feed only a
    metric, so no reference worker starts and no step computes them."""
    cfg = tiny_config("trainer.max_steps=1", "warmup.steps=0", "trackers=[jsonl]", *([reader] if reader else []))
    pipeline = RLVRPipeline(cfg, LocalExecutor())
    pipeline.run()
    step = metrics_of(__import__("pathlib").Path(cfg.output_dir))[1]
    assert ("reference" in pipeline.roles.groups) == ("train/kl" in step) == bool(reader)


def test_held_out_rows_without_ground_truth_are_refused_before_any_worker(tmp_path):
    from roll_core.config import load_config
    from roll_core.errors import ConfigError

    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1=", "ground_truth": "2"}])
    write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "2+2=", "ground_truth": "4"}, {"prompt": "3+3="}])
    cfg = load_config(None, [f"output_dir={tmp_path / 'run'}", "executor=local", "warmup.steps=0",
                             f"data.train_file={tmp_path / 'train.jsonl'}", f"data.eval_file={tmp_path / 'eval.jsonl'}"])
    pipeline = RLVRPipeline(cfg, LocalExecutor())
    with pytest.raises(ConfigError, match="^1 held-out rows have no 'ground_truth' \\(the first: row 1\\)"):
        pipeline.run()
    assert pipeline.roles.groups == {}


def test_failing_reward_stops_with_a_clear_message(tiny_config, roll_plugins):
    from roll_core.errors import RollError
    from roll_core.rewards import Reward
    from roll_core.testing import hooks

    class Crashing(Reward):
        def score(self, sample):
            raise ZeroDivisionError("my bug")

    roll_plugins(("mine", hooks(
        roll_register_rewards=lambda register: register("crashing", Crashing))))
    cfg = tiny_config("roles.reward.name=crashing", "warmup.steps=0")
    with pytest.raises(RollError, match=r"reward 'crashing' \(plugin 'mine'\) raised ZeroDivisionError: my bug"):
        RLVRPipeline(cfg, LocalExecutor()).run()


@pytest.mark.parametrize("judge, accuracy, counted", [
    ("quarter", 0.25, {}),
    ("{name: broken, on_nonfinite: zero}", 0.0, {"eval/eval_reward/nonfinite": 32.0}),  # 16 held-out rows a domain
])
def test_an_eval_reward_scores_the_held_out_rows_while_training_uses_its_own(tiny_config, roll_plugins, judge,
                                                                              accuracy, counted):
    from roll_core.rewards import Reward
    from roll_core.testing import hooks
    from roll_core.trackers import read_metrics

    class Length(Reward):
        """The response's length: what a learned reward might stand for; never an accuracy."""

        lightweight = True

        def score(self, sample):
            return float(len(sample.response))

    class Quarter(Reward):
        def score(self, sample):
            return 0.25

    class Broken(Reward):
        def score(self, sample):
            return float("nan")

    def register(register):
        register("length", Length)
        register("quarter", Quarter)
        register("broken", Broken)

    roll_plugins(("mine", hooks(roll_register_rewards=register)))
    judge = judge if judge.startswith("{") else f"{{name: {judge}}}"
    cfg = tiny_config("roles.reward.name=length", f"roles.eval_reward={judge}", "trainer.max_steps=1",
                      "data.domains={a: {dataset: carry_addition}, b: {dataset: carry_addition}}")
    summary = RLVRPipeline(cfg, LocalExecutor()).run()
    trained = next(r for r in read_metrics(f"{cfg.output_dir}/metrics.jsonl") if "reward/mean" in r)
    assert trained["reward/mean"] > 1  # lengths: the training reward scored the step
    for evaluation in (summary["before_rl"], summary["after_rl"]):
        # the eval reward's scores, per domain too; the training reward's mean length of the same answers
        assert [evaluation[k] for k in ("eval/accuracy", "eval/accuracy/a", "eval/accuracy/b")] == [accuracy] * 3
        assert evaluation["eval/train_reward"] > 0.25
        assert {k: v for k, v in evaluation.items() if k.startswith("eval/eval_")} == counted


def _run_cli(run_dir, *overrides, executor="local"):
    return [sys.executable, "-m", "roll_core.cli", "run", f"output_dir={run_dir}", f"executor={executor}",
            "warmup.steps=5", "rollout.prompts_per_step=4", "rollout.num_return_sequences=4",
            "trainer.eval_every=0", "data.eval_size=8", "trackers=[jsonl]", "torch_threads=1",
            "algorithm.kl_metric=true", *overrides]  # train/kl checks that the reference resumes too


@pytest.mark.parametrize("ordered", [True, False])
def test_a_synchronous_step_awaits_the_queued_weight_update_where_its_samples_depend_on_it(ordered, monkeypatch):
    """After an RL update a synchronous run leaves the weight update queued. An inference worker that
    takes one call at a time runs it before the next generate calls, so the driver awaits it once
    those samples are in; a concurrent engine gives no such order, so the driver awaits it first.
    Either way a failed update stops the run before its samples are used."""
    import types

    import roll_core.pipelines.rlvr as rlvr

    monkeypatch.setattr(rlvr, "batch_metrics", lambda batch, multi_domain: {})
    events = []

    class Weights:
        def finish(self):
            events.append("settle")
            raise RuntimeError("the broadcast failed")

    class Scheduler:
        def next_batch(self):
            events.append("generate")
            return {}, {}

    pipeline = types.SimpleNamespace(roles=types.SimpleNamespace(use=lambda *roles: None), overlapping=False,
                                     ordered_infer=ordered, weights=Weights(), scheduler=Scheduler())
    pipeline.settle_weights = types.MethodType(RLVRPipeline.settle_weights, pipeline)
    with pytest.raises(RuntimeError, match="the broadcast failed"):
        RLVRPipeline.collect(pipeline)
    assert events == (["generate", "settle"] if ordered else ["settle"])
    pipeline.overlapping, pipeline.multi_domain, events[:] = True, False, []
    assert RLVRPipeline.collect(pipeline) == ({}, {})  # an overlapping scheduler's update: awaited at the next push
    assert events == ["generate"]


def test_kill_after_checkpoint_then_resume_continues(tmp_path):
    """SIGKILL a run once a checkpoint exists; resuming continues from its step and data position,
    and the resumed steps reproduce the uninterrupted run's metrics."""
    killed = tmp_path / "killed"
    # a warm-up after which RL steps have rewards to learn from (after 5 steps every reward is 0, and
    # so is every update): the resumed run must carry trained weights and optimizer state
    learns = ("warmup.steps=100", "warmup.lr=3e-3")
    # every checkpoint is kept: with the default two, step 2's was gone within the 0.2 s between
    # two looks once steps got fast, and the run finished before it was seen
    proc = subprocess.Popen(_run_cli(killed, *learns, "trainer.max_steps=200", "trainer.save_every=2",
                                     "trainer.keep_checkpoints=1000"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    ckpt = killed / "checkpoints" / "step_000002" / "state.json"
    while not ckpt.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert ckpt.exists(), "no checkpoint was written before the deadline"
    for later in [d for d in (killed / "checkpoints").iterdir() if d.name > "step_000002"]:
        shutil.rmtree(later)  # as if killed right after step 2's checkpoint
    saved = json.loads(ckpt.read_text())
    assert saved["step"] == 2 and saved["data"] == {"epoch": 0, "index": 8}  # 2 steps x 4 prompts

    resumed = subprocess.run(_run_cli(killed, *learns, "trainer.max_steps=4", "trainer.save_every=2"),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    final = json.loads((killed / "checkpoints" / "step_000004" / "state.json").read_text())
    assert final["step"] == 4 and final["data"] == {"epoch": 0, "index": 16}

    straight = tmp_path / "straight"
    done = subprocess.run(_run_cli(straight, *learns, "trainer.max_steps=4", "trainer.save_every=2"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    def by_step(run):
        return {r["step"]: r for r in metrics_of(run)}

    a, b = by_step(killed), by_step(straight)
    assert b[3]["train/kl"] > 0, "the policy had not moved by step 3: a resume without its weights would pass"
    for step in (3, 4):  # every metric but the timings
        assert {k for k in a[step] if not k.startswith("time/")} == {k for k in b[step] if not k.startswith("time/")}
        for key in [k for k in b[step] if not k.startswith("time/")]:
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-5, abs=1e-7), (step, key)


@pytest.mark.ray
@pytest.mark.parametrize("layout", ["streaming", "hybrid"])
def test_same_seed_same_metrics_local_and_ray(tmp_path, layout):
    """``streaming``: two inference workers, each running two requests whose rewards are scored
    while the next request generates on two reward workers: completion order differs between the
    executors, the numbers must not. Weights reach the engines through shared memory.
    ``hybrid``: the default layout, where Ray builds actor_infer's worker inside actor_train's
    process (``ray.hybrid_engine``), the reward scores in the driver (``placement: auto``) and the
    engine computes with the trainer's own parameter tensors; the next step's
    requests are queued behind the update (``prefetch``). It evaluates after every step, with those
    requests in flight, and checkpoints after step 2, before which none may be drawn early (so it
    covers the plain default layout too)."""
    results = {}
    overrides = {"streaming": ["rollout.request_size=4", "roles.actor_infer.num_workers=2",
                               "roles.reward.num_workers=2"],
                 "hybrid": ["trainer.max_steps=4", "trainer.eval_every=1", "trainer.save_every=2"]}[layout]
    for executor in ("local", "ray"):
        run_dir = tmp_path / executor
        out = subprocess.run(_run_cli(run_dir, "trainer.max_steps=3", *overrides, executor=executor),
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        results[executor] = metrics_of(run_dir)
    placement = json.loads((tmp_path / "ray" / "placement.json").read_text())
    roles = placement["roles"]
    # a worker that runs a model records the linear-layer kernel it computes with, as this machine
    # resolves the default, and whether its attention may use cuDNN's kernel (runtime.cudnn_attention: off)
    model_workers = roles["actor_train"] + roles["actor_infer"]
    assert {w["cpu_matmul"] for w in model_workers} == {
        "onednn" if cpu_matmul.onednn_preferred() and cpu_matmul.onednn_available() else "torch"}
    assert {w["cudnn_attention"] for w in model_workers} == {False}
    assert all("cpu_matmul" not in w and "cudnn_attention" not in w for w in roles["reward"])  # no model to steer
    train_pids = {w["pid"] for w in roles["actor_train"]}
    assert ({w["pid"] for w in roles["actor_infer"]} == train_pids) == layout.startswith("hybrid")
    # exact_match is lightweight: one reward worker scores in the driver, two are processes of their own
    reward_pids = [w["pid"] for w in roles["reward"]]
    assert (reward_pids == [placement["driver_pid"]]) == layout.startswith("hybrid")
    assert len(set(reward_pids) | train_pids | {placement["driver_pid"]}) == (2 if layout.startswith("hybrid") else 4)
    local, ray = results["local"], results["ray"]
    steps = [0, 1, 2, 3, 4] if layout == "hybrid" else [0, 1, 2, 3]
    assert [r["step"] for r in local] == [r["step"] for r in ray] == steps
    if layout == "hybrid":
        assert all("eval/accuracy" in r for r in ray)
        state = json.loads((tmp_path / "ray" / "checkpoints" / "step_000002" / "state.json").read_text())
        assert state["data"] == {"epoch": 0, "index": 8}  # 2 steps x 4 prompts: step 3's not drawn yet
    # the hybrid engine's worker, like the local executor's, computes with the trainer's own tensors
    # (weight_sync: in_process), so no byte moves; Ray's separate processes copy them: the same
    # weights, and the same numbers everywhere else
    sent = [r["weight_sync/bytes"] for r in ray if "weight_sync/bytes" in r]
    assert sent and all((b == 0) == layout.startswith("hybrid") for b in sent)
    assert {r["weight_sync/bytes"] for r in local if "weight_sync/bytes" in r} == {0.0}
    for a, b in zip(local, ray):
        assert set(a) == set(b)
        for key in a:
            if not key.startswith("time/") and key != "weight_sync/bytes":
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-8), (a["step"], key)
