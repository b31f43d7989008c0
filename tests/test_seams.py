"""The core's seams, used by name from a plugin outside the core, and the ``sft`` pipeline on its own.

One in-process plugin registers a policy loss with its own options model, a scheduler that
overlaps training (registration metadata, no name check anywhere) and an inference strategy that
implements the weight-update protocol; one ``rlvr`` run uses all three, the loss sees its validated
options, and the strategy's record shows begin, load... and end, in order, once per update.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from conftest import metrics_of, write_jsonl

from roll_core.algorithms.losses import ppo_clip
from roll_core.pipelines.rlvr import RLVRPipeline
from roll_core.rollout.sync import SyncRolloutScheduler
from roll_core.runtime import LocalExecutor
from roll_core.strategies.hf import HFInferStrategy
from roll_core.testing import hooks

EVENTS: list[tuple] = []


class RecordingEngine(HFInferStrategy):
    """The ``hf`` engine, recording the weight-update protocol as it is called."""

    def begin_update(self, version):
        EVENTS.append(("begin", version))

    def load(self, bucket):
        EVENTS.append(("load", len(bucket)))
        super().load(bucket)

    def end_update(self):
        EVENTS.append(("end",))


class AheadScheduler(SyncRolloutScheduler):
    """Registered with ``overlaps_training=True``; records the interface calls it receives."""

    def start(self, stream, reference=None):
        EVENTS.append(("start",))
        super().start(stream, reference)

    def next_batch(self):
        EVENTS.append(("next_batch",))
        return super().next_batch()

    def wait(self, future):
        EVENTS.append(("wait",))
        return super().wait(future)

    def weights_pushed(self):
        EVENTS.append(("weights_pushed",))

    def stop(self):
        EVENTS.append(("stop",))


class ScaledClipOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scale: float = Field(1.0, gt=0, description="multiplies the PPO clipped surrogate")


def scaled_clip(inputs, config, options: ScaledClipOptions):
    """PPO's clipped surrogate times ``options.scale``: a loss with a setting the core does not know."""
    EVENTS.append(("loss", options.scale))
    loss, metrics = ppo_clip(inputs, config)
    return options.scale * loss, metrics


def _plugin():
    def roll_register_policy_losses(register):
        register("scaled_clip", scaled_clip, options=ScaledClipOptions)

    def roll_register_strategies(register):
        register("recording", RecordingEngine, kind="infer")

    def roll_register_schedulers(register):
        register("ahead", AheadScheduler, overlaps_training=True)

    return hooks(roll_register_policy_losses=roll_register_policy_losses,
                                 roll_register_strategies=roll_register_strategies,
                                 roll_register_schedulers=roll_register_schedulers)


def _updates(events: list[tuple]) -> list[list[tuple]]:
    """The protocol events cut into updates (begin ... end)."""
    updates, current = [], None
    for e in events:
        if e[0] == "begin":
            assert current is None, f"begin inside an update: {events}"
            current = [e]
        elif e[0] in ("load", "end"):
            assert current is not None, f"{e[0]} outside an update: {events}"
            current.append(e)
            if e[0] == "end":
                updates.append(current)
                current = None
    assert current is None
    return updates


def test_a_plugin_uses_the_scheduler_and_weight_update_seams_by_name(tiny_config, roll_plugins):
    roll_plugins(("seams", _plugin()))
    EVENTS.clear()
    cfg = tiny_config("rollout.scheduler=ahead", "roles.actor_infer.strategy=recording", "warmup.steps=2",
                      "trainer.max_steps=3", "algorithm.policy_loss=scaled_clip",
                      "algorithm.policy_loss_options.scale=0.5")
    RLVRPipeline(cfg, LocalExecutor()).run()
    losses = [e for e in EVENTS if e[0] == "loss"]
    assert losses and set(losses) == {("loss", 0.5)}  # validated options reach the loss in every micro-batch
    EVENTS[:] = [e for e in EVENTS if e[0] != "loss"]

    updates = _updates(EVENTS)
    # one after the warm-up (version 0), one after every RL step (versions 1..3)
    assert [u[0] for u in updates] == [("begin", 0), ("begin", 1), ("begin", 2), ("begin", 3)]
    for u in updates:
        assert u[-1] == ("end",) and all(e[0] == "load" for e in u[1:-1]) and len(u) > 2
    assert len({sum(e[1] for e in u[1:-1]) for u in updates}) == 1  # every update carries every tensor

    calls = [e[0] for e in EVENTS if e[0] not in ("begin", "load", "end")]
    assert calls[0] == "start" and calls[-1] == "stop"
    assert calls[1:-1] == ["next_batch", "wait", "weights_pushed"] * 3
    metrics = metrics_of(cfg.output_dir)
    # a scheduler that overlaps training reports no inference idle time computed from the rollout alone
    assert all("time/idle/actor_infer_s" not in m for m in metrics[1:])


def test_sft_pipeline_runs_alone_and_lowers_its_heldout_loss(tiny_config):
    from roll_core.pipelines.sft import SFTPipeline

    cfg = tiny_config("pipeline=sft", "warmup.steps=40", "trainer.eval_every=20", "trainer.save_every=20")
    summary = SFTPipeline(cfg, LocalExecutor()).run()
    before, after = summary["before"]["eval/loss"], summary["after"]["eval/loss"]
    assert after < 0.8 * before, (before, after)
    rows = metrics_of(cfg.output_dir)
    assert [r["step"] for r in rows if "eval/loss" in r] == [0, 20, 40]
    assert all("warmup/loss" in r for r in rows if r["step"] > 0)
    # a checkpoint holds a model transformers loads, with its tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(cfg.output_dir) / "checkpoints" / "step_000040" / "actor_train" / "model"
    AutoModelForCausalLM.from_pretrained(model_dir)
    AutoTokenizer.from_pretrained(model_dir)


def test_sft_pipeline_resumes_from_its_checkpoint(tiny_config):
    from roll_core.pipelines.sft import SFTPipeline

    first = tiny_config("pipeline=sft", "warmup.steps=10", "trainer.save_every=5")
    straight = SFTPipeline(first, LocalExecutor()).run()
    again = SFTPipeline(first, LocalExecutor()).run()  # resume=auto: from step 10, nothing left to do
    assert again["steps"] == straight["steps"] == 10
    assert again["after"] == straight["after"]


@pytest.mark.parametrize("option, expected", [
    ("algorithm.policy_loss_options.scal=0.5", "unknown option 'scal'. Did you mean 'scale'?"),
    ("algorithm.policy_loss_options.scale=-1", "algorithm.policy_loss_options.scale' for policy loss 'scaled_clip': "
                                               "Input should be greater than 0"),
    ("algorithm.policy_loss_options.scale=big", "should be a valid number"),
])
def test_roll_validate_checks_a_plugin_loss_options_against_its_model(roll_plugins, capsys, option, expected):
    from roll_core.cli import main

    roll_plugins(("seams", _plugin()))
    assert main(["validate", "algorithm.policy_loss=scaled_clip", option]) != 0
    assert expected in capsys.readouterr().err
    assert main(["validate", "algorithm.policy_loss=ppo_clip", "algorithm.policy_loss_options.scale=1"]) != 0
    assert "policy loss 'ppo_clip' takes no options" in capsys.readouterr().err
    assert main(["validate", "algorithm.policy_loss=scaled_clip", "algorithm.policy_loss_options.scale=2"]) == 0


class _Recorder:
    """A worker that records what it was called with and answers with its own index."""

    def __init__(self, index: int):
        self.index, self.calls = index, []

    def work(self, part):
        self.calls.append(part)
        return self.index


def test_a_group_of_sharded_replicas_dispatches_each_replica_once():
    """Workers 0-1 hold replica 0 between them, workers 2-3 replica 1 (TP=2 x DP=2): every worker of
    a replica gets the same part, and one answer comes back per replica, in replica order."""
    group = LocalExecutor().spawn("reference", _Recorder, [(i,) for i in range(4)])
    group.dp_ranks = [0, 0, 1, 1]
    assert group.dp_size == 2
    assert group.per_replica("work", _Chunks([0, 1, 2, 3])) == [0, 2]
    assert [w.calls for w in group.handles] == [[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]]
    assert group.on_replica(1, "work", "x") == 2
    assert [w.calls[-1] for w in group.handles] == [[0, 1], [0, 1], "x", "x"]


def test_a_group_gives_each_worker_its_part_and_refuses_what_does_not_fit_its_workers():
    """``map``: one part per worker, in order. ``data_parallel``: rank ``r`` gets its half of every
    mini-batch (rows 0-3 and 4-7 over two ranks: rank 0 rows 0, 1, 4, 5), the workers of one rank
    the same rows; a batch that does not divide over the ranks is refused before any call."""
    import torch

    from roll_core.data import Batch
    from roll_core.errors import RollError

    group = LocalExecutor().spawn("actor_train", _Recorder, [(i,) for i in range(3)])
    with pytest.raises(ValueError, match="actor_train: 2 parts for 3 workers"):
        group.map("work", ["a", "b"])
    assert group.map("work", ["a", "b", "c"]) == [0, 1, 2]
    assert [w.calls for w in group.handles] == [["a"], ["b"], ["c"]]
    group.dp_ranks = [0, 1, 1]  # workers 1 and 2 hold replica 1 between them
    assert group.data_parallel("work", Batch({"row": torch.arange(8)}), mini_batch_size=4) == [0, 1, 2]
    assert [w.calls[-1]["row"].tolist() for w in group.handles] == [[0, 1, 4, 5], [2, 3, 6, 7], [2, 3, 6, 7]]
    with pytest.raises(RollError, match="actor_train: a batch of 7 samples does not split over 2 data-parallel ranks"):
        group.data_parallel("work", Batch({"row": torch.arange(7)}))
    assert [len(w.calls) for w in group.handles] == [2, 2, 2]
    # the same workers serving another role under its method names, replicas as they are
    reference = group.as_role("reference", score="work")
    assert (reference.role, reference.resident_role, group.resident_role) == ("reference", "actor_train", "actor_train")
    assert reference.per_replica("score", _Chunks(["x", "y"])) == [0, 1]
    assert [w.calls[-1] for w in group.handles] == [["x"], ["y"], ["y"]]


class _Chunks(list):
    def chunk(self, n: int):
        size = len(self) // n
        return [list(self[i * size:(i + 1) * size]) for i in range(n)]


def test_dpo_pipeline_raises_heldout_preference_accuracy(tiny_config):
    """DPO on the embedded task's pairs (the right sum chosen, the careless teacher's rejected), from
    the untrained tiny model, against a frozen reference role holding the same model."""
    from roll_core.pipelines.dpo import DPOPipeline

    cfg = tiny_config("pipeline=dpo", "trainer.max_steps=40", "dpo.batch_size=32", "dpo.beta=0.5",
                      "trainer.eval_every=20", "data.eval_size=200", "roles.actor_train.lr=1e-3")
    summary = DPOPipeline(cfg, LocalExecutor()).run()
    before, after = summary["before"], summary["after"]
    assert before["eval/rewards/accuracy"] == 0.0 and before["eval/rewards/margin"] == 0.0  # policy = reference
    assert after["eval/rewards/accuracy"] > 0.7, after
    assert after["eval/rewards/margin"] > 0 and after["eval/loss"] < before["eval/loss"]
    rows = metrics_of(cfg.output_dir)
    assert [r["step"] for r in rows if "eval/rewards/accuracy" in r] == [0, 20, 40]
    assert all("dpo/loss" in r and "dpo/rewards/accuracy" in r for r in rows if r["step"] > 0)


def test_dpo_refuses_odd_micro_batches_and_a_missing_reference(tiny_config):
    from roll_core.errors import ConfigError
    from roll_core.pipelines.dpo import DPOPipeline

    with pytest.raises(ConfigError, match="micro_batch_size': dpo keeps each pair in one micro-batch"):
        DPOPipeline(tiny_config("pipeline=dpo", "roles.actor_train.micro_batch_size=3"), LocalExecutor()).run()
    with pytest.raises(ConfigError, match="precomputed needs"):
        DPOPipeline(tiny_config("pipeline=dpo", "dpo.reference=precomputed"), LocalExecutor()).run()


def test_dpo_uses_reference_log_probs_precomputed_with_the_data(tiny_config, tmp_path):
    """With dpo.reference=precomputed no reference role starts and the pairs' own values are the
    reference: a reference that finds every chosen answer 100 nats less likely than the policy does
    makes every held-out pair count as preferred before any step."""
    from roll_core.embedded.tasks import CarryAdditionTask
    from roll_core.pipelines.dpo import DPOPipeline

    task = CarryAdditionTask()
    for name, rows in (("train", task.train_rows()[:200]), ("eval", task.eval_rows()[:100])):
        write_jsonl(tmp_path / f"{name}.jsonl", [{**r, "reference_chosen_logp": -100.0, "reference_rejected_logp": 0.0}
                                                 for r in rows if "rejected" in r])
    cfg = tiny_config("pipeline=dpo", "dpo.reference=precomputed", "trainer.max_steps=2", "dpo.batch_size=4",
                      f"data.train_file={tmp_path / 'train.jsonl'}", f"data.eval_file={tmp_path / 'eval.jsonl'}")
    pipeline = DPOPipeline(cfg, LocalExecutor())
    summary = pipeline.run()
    assert pipeline.reference is None and "reference" not in pipeline.roles.groups
    assert summary["before"]["eval/rewards/accuracy"] == 1.0


@pytest.fixture(scope="module")
def trained_teacher(tmp_path_factory):
    """A larger tiny model (hidden 192, 3 layers) trained with the sft pipeline: the teacher."""
    from roll_core.config import load_config
    from roll_core.pipelines.sft import SFTPipeline

    run = tmp_path_factory.mktemp("teacher")
    cfg = load_config(None, [f"output_dir={run}", "executor=local", "pipeline=sft", "warmup.steps=60",
                             "model.tiny.hidden_size=192", "model.tiny.num_layers=3", "data.eval_size=16",
                             "trainer.save_every=0", "trackers=[jsonl]"])
    SFTPipeline(cfg, LocalExecutor()).run()
    return run / "checkpoints" / "step_000060" / "actor_train" / "model"


@pytest.mark.parametrize("loss, extra", [("forward_kl", []), ("forward_kl", ["distill.top_k=8", "distill.temperature=2.0"]),
                                         ("jsd", ["teacher-role"]), ("reverse_kl", ["distill.responses=teacher"])])
def test_distill_pipeline_brings_the_student_toward_the_teacher(tiny_config, trained_teacher, loss, extra):
    from roll_core.pipelines.distill import DistillPipeline

    # the teacher is roles.reference, or a role of one's own that distill.teacher names
    teacher = ([f"roles.teacher={{kind: infer, model_path: {trained_teacher}}}", "distill.teacher=teacher",
                "roles.reference=null"] if extra == ["teacher-role"] else [f"roles.reference.model_path={trained_teacher}"])
    cfg = tiny_config("pipeline=distill", f"distill.loss={loss}", *teacher, "trainer.max_steps=30",
                      "trainer.eval_every=15", "data.eval_size=64", "roles.actor_train.lr=1e-3",
                      *(e for e in extra if e != "teacher-role"))
    pipeline = DistillPipeline(cfg, LocalExecutor())
    summary = pipeline.run()
    assert pipeline.teacher.role == ("teacher" if extra == ["teacher-role"] else "reference")
    before, after = summary["before"]["eval/kl_to_teacher"], summary["after"]["eval/kl_to_teacher"]
    assert after < 0.5 * before, (before, after)
    rows = metrics_of(cfg.output_dir)
    assert all(r["distill/loss"] > 0 for r in rows if r["step"] > 0)


def test_roll_validate_checks_the_distillation_loss_options():
    from roll_core.config import load_and_check
    from roll_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown option 'alpah'. Did you mean 'alpha'\? Valid options: alpha$"):
        load_and_check(None, ["pipeline=distill", "distill.loss=skewed_forward_kl", "distill.loss_options={alpah: 0.2}"])
