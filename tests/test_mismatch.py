"""Train/inference mismatch: the step-0 check, its metric and its gate."""

from pathlib import Path

import pytest
import torch

from conftest import metrics_of

from roll_core.pipelines.mismatch import MismatchError, check_mismatch, log_prob_gap
from roll_core.runtime.executor import LocalExecutor
from roll_core.strategies.hf import HFInferStrategy
from roll_core.testing import hooks


def test_the_gap_is_the_mean_absolute_difference_over_sampled_tokens():
    train = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    infer = torch.tensor([[-1.5, -1.0, -9.0], [-0.5, -0.25, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # |0.5| + |1.0| + |0| + |0.25| over 4 tokens; the masked ones (6 and 5 apart) do not count
    assert log_prob_gap(train, infer, mask) == pytest.approx(1.75 / 4)
    assert log_prob_gap(train, infer, torch.zeros(2, 3)) == 0.0


def test_the_gate_stops_only_above_its_limit_and_says_what_usually_causes_it():
    check_mismatch(0.5, None)
    check_mismatch(0.5, 0.5)
    with pytest.raises(MismatchError, match=r"differ from the inference engine's by 0.51 per token on average, "
                                            r"above trainer.max_initial_mismatch=0.5.*different dtypes"):
        check_mismatch(0.51, 0.5)


class _Skewed(HFInferStrategy):
    """An engine whose log-probs of its own samples are off by 0.3 per token."""

    def generate(self, batch, **sampling):
        out = super().generate(batch, **sampling)
        return out.update(infer_log_probs=out["infer_log_probs"] - 0.3 * out["response_mask"])


def test_step_0_reports_the_gap_and_leaves_the_sampling_rng_as_it_was(tiny_config):
    from roll_core.pipelines.rlvr import RLVRPipeline

    cfg = tiny_config("warmup.steps=0", "trainer.max_initial_mismatch=1e-4")
    pipeline = RLVRPipeline(cfg, LocalExecutor())
    pipeline.prepare()
    pipeline.build()
    before = [pipeline.infer.handles[0].rng_state()]
    metrics = pipeline._initial_mismatch()
    assert 0 <= metrics["train/infer_log_prob_gap"] < 1e-4  # the same engine code and weights: float noise
    after = [pipeline.infer.handles[0].rng_state()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_run_whose_engines_disagree_is_stopped_at_step_0(tiny_config, roll_plugins):
    from roll_core.pipelines.rlvr import RLVRPipeline

    roll_plugins(("skewed", hooks(roll_register_strategies=lambda register: register("skewed", _Skewed, kind="infer"))))
    cfg = tiny_config("warmup.steps=0", "roles.actor_infer.strategy=skewed", "trainer.max_initial_mismatch=0.1")
    with pytest.raises(MismatchError, match="by 0.3 per token"):
        RLVRPipeline(cfg, LocalExecutor()).run()
    assert not (Path(cfg.output_dir) / "checkpoints").exists() or not any((Path(cfg.output_dir) / "checkpoints").iterdir())

    # without the gate the run trains and reports the gap at step 0 and at every step
    cfg = tiny_config("warmup.steps=0", "roles.actor_infer.strategy=skewed", "trainer.max_steps=2")
    RLVRPipeline(cfg, LocalExecutor()).run()
    rows = metrics_of(cfg.output_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["train/infer_log_prob_gap"] == pytest.approx(0.3, abs=1e-4) for r in rows)
