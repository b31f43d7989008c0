"""Sending a synchronous step's generation requests early (``RolloutScheduler.prefetch``).

Under the hybrid engine the pipeline queues the next step's requests behind the weight update, so
generation overlaps the driver's work between steps. The samples must be the ones the next step
would have drawn anyway, and no checkpoint may fall between the early draw and its step. On Ray
the update, the weight hand-over and those requests go to the trainer's worker as one task.
"""

from __future__ import annotations

import types

import pytest
import torch

from conftest import metrics_of

from roll_core.config.loader import load_config
from roll_core.data import PromptStream
from roll_core.embedded.model import build_char_tokenizer
from roll_core.pipelines.runtime import TrainingLoop
from roll_core.rollout.sync import SyncRolloutScheduler
from roll_core.runtime import LocalExecutor
from roll_core.runtime.executor import WorkerGroup


class Engine:
    """Answers every sample with ``"1"`` then EOS, and records each generate call's prompts and
    sampling settings."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def generate(self, part, **sampling):
        self.calls.append((list(part["prompt"]), sampling))
        one = self.tokenizer.convert_tokens_to_ids("1")
        responses = torch.tensor([[one, self.tokenizer.eos_token_id]] * len(part))
        return part.update(responses=responses, response_mask=torch.ones_like(responses),
                           infer_log_probs=torch.zeros(responses.shape))


class Rewards:
    """Scores a sample 1 when its ground truth starts with its response."""

    def submit(self, samples):
        return [float(s.ground_truth.startswith(s.response)) for s in samples]

    def gather(self, ticket):
        return ticket, [{} for _ in ticket], 0.0


def _scheduler(executor=None, workers=1, **overrides):
    settings = {"rollout.prompts_per_step": 3, "rollout.num_return_sequences": 2, "rollout.request_size": 4,
                "rollout.temperature": 0.7, **overrides}  # 6 samples a round: requests of 4 and 2
    config = load_config(None, [f"{k}={v}" for k, v in settings.items()])
    tokenizer = build_char_tokenizer()
    engine, executor = Engine(tokenizer), executor or LocalExecutor()
    scheduler = SyncRolloutScheduler(config, executor, WorkerGroup("actor_infer", [engine] * workers, executor),
                                     Rewards(), tokenizer)
    # every third ground truth starts with "1", the engine's answer: scores of 1 and 0
    rows = [{"prompt": f"{i}+{i}=", "ground_truth": f"{i % 3}{2 * i}"} for i in range(10, 20)]
    scheduler.start(PromptStream(rows, seed=5))
    return scheduler, engine


def test_a_prefetched_round_is_the_one_the_next_step_would_have_sent():
    early, early_engine = _scheduler()
    plain, plain_engine = _scheduler()
    for _ in range(3):  # steps, each prefetched by the step before (the first is not)
        got, want = early.next_batch()[0], plain.next_batch()[0]
        assert got["prompt"] == want["prompt"] and torch.equal(got["scores"], want["scores"])
        assert torch.equal(got["group_index"], want["group_index"])
        assert got["scores"].tolist() == [float(t.startswith("1")) for t in got["ground_truth"]]
        assert 0 < got["scores"].sum() < len(got)
        early.prefetch()
        early.prefetch()  # a second call sends nothing more
    assert early_engine.calls[:6] == plain_engine.calls  # the same requests, in the same order
    assert len(early_engine.calls) == 8  # the fourth step's two, sent early
    assert {s["temperature"] for _, s in early_engine.calls} == {0.7}
    assert early.stream.state() != plain.stream.state()  # its prompts are drawn...
    early.stop()  # ...and a run that ends here lets them finish unread
    assert early._prefetched is None


def test_a_prefetched_round_sent_with_other_calls_reports_the_workers_generation_seconds():
    """Requests sent in one task with other calls return only with the task's last call, so the
    driver cannot time them: the round's generation time is the seconds its workers spent on them
    (requests of 4 and 2 samples on one worker, run in turn; on two workers, the slower one).
    Requests sent on their own keep the driver's wall time."""

    class Chained(LocalExecutor):
        def call_seconds(self, future):
            return 0.25 * len(future)  # as if the worker took 0.25 s a sample

    scheduler, _ = _scheduler(Chained())
    scheduler.prefetch()
    assert scheduler.next_batch()[1]["time/generate_s"] == pytest.approx(1.5)
    two, _ = _scheduler(Chained(), workers=2)  # 3 samples on each worker, generated side by side
    two.prefetch()
    assert two.next_batch()[1]["time/generate_s"] == pytest.approx(0.75)
    plain, _ = _scheduler()
    plain.prefetch()
    assert plain.next_batch()[1]["time/generate_s"] < 0.5


@pytest.mark.ray
def test_on_ray_a_steps_update_weight_hand_over_and_next_generation_are_one_task(tiny_config):
    """Under the hybrid engine each RL step sends the update, the hand-over and (unless a checkpoint
    comes next) the next step's requests to actor_train's worker in one block, so one task; the
    step's phases are then the worker's own seconds."""
    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.runtime.executor import RayExecutor, make_executor

    blocks: list[list[str]] = []
    invoke, block, seconds = RayExecutor.invoke, RayExecutor.one_task_per_worker, RayExecutor.call_seconds

    def recording_invoke(executor, handle, method, args, kwargs):
        if executor._batches is not None:
            blocks[-1].append(method)
        return invoke(executor, handle, method, args, kwargs)

    def recording_block(executor):
        blocks.append([])
        return block(executor)

    def marked_seconds(executor, future):  # the worker's seconds, marked to be told from the driver's
        return None if seconds(executor, future) is None else 0.001234

    cfg = tiny_config("executor=ray", "trainer.max_steps=3", "trainer.save_every=2", "trainer.eval_every=0",
                      "trackers=[jsonl]")
    mp = pytest.MonkeyPatch()
    mp.setattr(RayExecutor, "invoke", recording_invoke)
    mp.setattr(RayExecutor, "one_task_per_worker", recording_block)
    mp.setattr(RayExecutor, "call_seconds", marked_seconds)
    executor = make_executor(cfg)
    try:
        RLVRPipeline(cfg, executor).run()
    finally:
        executor.shutdown()
        mp.undo()
    # step 2 is followed by a checkpoint, step 3 by none: no requests sent early
    assert blocks == [["update", "pass_weights", "generate"], ["update", "pass_weights"], ["update", "pass_weights"]]
    rows = metrics_of(cfg.output_dir)
    assert [row["time/train_s"] for row in rows[1:]] == [0.001234] * 3
    generated = [row["time/generate_s"] for row in rows[1:]]
    assert generated[1] == 0.001234  # step 2's requests, sent by step 1
    assert generated[0] != 0.001234 and generated[2] != 0.001234  # sent on their own: the driver's time


def test_a_checkpoint_follows_every_save_every_steps_and_the_last():
    for save_every, saved in ((3, [3, 6, 7]), (0, [7])):
        config = load_config(None, ["trainer.max_steps=7", f"trainer.save_every={save_every}"])
        loop = types.SimpleNamespace(config=config, max_steps=7)
        assert [s for s in range(1, 8) if TrainingLoop.saves_after(loop, s)] == saved


def test_an_iteration_counts_the_step_and_the_loops_logging_not_evaluation_or_checkpoints():
    """``time/iteration_s``: a step's wall time as the run goes. The step (50 ms) and the trackers'
    logging of the previous one (20 ms) count; evaluation (every step, 150 ms) and checkpoints
    (every second step, 150 ms) do not."""
    import time as clock

    class Loop(TrainingLoop):
        def build(self): pass
        def begin(self): return {}
        def save(self, step): clock.sleep(0.15)
        def step(self, step):
            clock.sleep(0.05)
            return {}
        def evaluate(self):
            clock.sleep(0.15)
            return {}
        def write_checkpoint(self, tmp): return {}
        def restore(self, path, state): pass

    class Tracker:
        def __init__(self): self.rows = []
        def rewind(self, step): pass
        def log(self, metrics, step):
            self.rows.append(dict(metrics))
            clock.sleep(0.02)

    loop = Loop.__new__(Loop)
    loop.config = load_config(None, ["trainer.max_steps=4", "trainer.eval_every=1", "trainer.save_every=2"])
    loop.roles = types.SimpleNamespace(reset=lambda: None)
    tracker = Tracker()
    loop._attempt([tracker], resume=False)
    iterations = [row["time/iteration_s"] for row in tracker.rows[1:]]  # row 0: step 0, before RL
    assert len(iterations) == 4
    assert 0.05 <= iterations[0] < 0.12  # the first step: nothing logged before it
    for seconds in iterations[1:]:
        assert 0.07 <= seconds < 0.14  # never the 0.15 s evaluation or checkpoint
