"""``strategy_options.precision: bf16`` of the torch strategies (roll_core.strategies.precision):
forward passes under bfloat16 autocast, float32 master weights, float32 outputs; near fp32's
numbers and not equal to them (autocast is on); checked before any worker starts."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import metrics_of

from roll_core.algorithms.objective import ActorObjective
from roll_core.config import load_and_check
from roll_core.config.schema import AlgorithmConfig, CriticRoleConfig, InferRoleConfig, TrainRoleConfig
from roll_core.errors import ConfigError
from roll_core.pipelines.rlvr import RLVRPipeline
from roll_core.runtime import LocalExecutor
from roll_core.strategies.hf import HFCriticStrategy, HFInferStrategy, HFTrainStrategy
from roll_core.testing import left_padded_prompts, training_batch
from roll_core.training import UpdateSpec, update


def bf16(cls, path, role=TrainRoleConfig, **settings):
    return cls(str(path), role(strategy_options={"precision": "bf16"}, **settings), seed=0)


def fp32(cls, path, role=TrainRoleConfig, **settings):
    return cls(str(path), role(**settings), seed=0)


@pytest.mark.parametrize("pack", [False, True])
def test_bf16_log_probs_are_float32_near_fp32s_and_not_equal(tiny_model_path, pack):
    batch = training_batch(vocab=90)
    mask = batch["response_mask"].bool()
    half, full = (make(HFTrainStrategy, tiny_model_path, pack_sequences=pack).forward(batch, ("log_probs", "entropy"),
                                                                                      1.0) for make in (bf16, fp32))
    for name in ("log_probs", "entropy"):
        assert half[name].dtype == torch.float32, name
        gap = (half[name] - full[name])[mask].abs()
        assert 1e-4 < float(gap.max()) < 0.02, (name, float(gap.max()))  # bfloat16: 8 bits of mantissa


def test_a_bf16_update_keeps_float32_weights_moments_and_gradients_and_matches_fp32(tiny_model_path):
    batch = training_batch(vocab=90)
    objective, spec = ActorObjective.from_config(AlgorithmConfig()), UpdateSpec(max_grad_norm=1.0, micro_batch_size=8)
    half, full = bf16(HFTrainStrategy, tiny_model_path), fp32(HFTrainStrategy, tiny_model_path)
    got, want = (update(s, batch, objective, spec) for s in (half, full))
    for key in ("train/pg_loss", "train/entropy", "train/grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=5e-3), key
    assert got["train/grad_norm"] != want["train/grad_norm"]  # the forward did run in bfloat16
    assert {p.dtype for p in half.model.parameters()} == {torch.float32}
    moments = [v for state in half.optimizers["default"].state.values() for v in state.values() if v.dim()]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    # the backward of a bf16 forward leaves float32 gradients on the float32 weights
    half._outputs(batch, ("log_probs",), 1.0)["log_probs"].sum().backward()
    assert {p.grad.dtype for p in half.model.parameters() if p.grad is not None} == {torch.float32}


def test_bf16_generation_samples_with_float32_log_probs_of_what_it_sampled(tiny_model_path):
    engine = bf16(HFInferStrategy, tiny_model_path, role=InferRoleConfig)
    out = engine.generate(left_padded_prompts(rows=6), max_new_tokens=5, temperature=1.0, top_p=1.0)
    assert out["infer_log_probs"].dtype == torch.float32 and out["responses"].shape == (6, 5)
    # the sampler's log-probs are those a float32 pass gives the same tokens, up to bfloat16
    again = fp32(HFTrainStrategy, tiny_model_path).compute_log_probs(out, 1.0)
    mask = out["response_mask"].bool()
    assert 1e-4 < float((out["infer_log_probs"] - again)[mask].abs().max()) < 0.02  # not float32 noise (~1e-6)


def test_a_bf16_critic_gives_float32_values_near_fp32s(tiny_model_path):
    batch = training_batch(vocab=90)
    half, full = (make(HFCriticStrategy, tiny_model_path, role=CriticRoleConfig).forward(batch, ("values",), 1.0)
                  for make in (bf16, fp32))
    mask = batch["response_mask"].bool()
    assert half["values"].dtype == torch.float32
    assert 1e-4 < float((half["values"] - full["values"])[mask].abs().max()) < 0.05


def test_bf16_asks_autocast_for_bfloat16_on_every_device_and_fp32_for_nothing():
    from roll_core.strategies import precision

    for device in ("cpu", "cuda"):  # cuda's autocast defaults to float16; built, not entered, so no GPU is needed
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "CUDA is not available": the context is only inspected
            context = precision.autocast(torch.device(device), "bf16")
        assert isinstance(context, torch.autocast) and context.fast_dtype == torch.bfloat16
        assert not isinstance(precision.autocast(torch.device(device), "fp32"), torch.autocast)


def test_precision_is_checked_before_anything_starts():
    with pytest.raises(ConfigError, match=r"strategy_options.precision.*'fp32' or 'bf16'"):
        load_and_check(None, ["roles.actor_train.strategy_options.precision=fp16"])
    with pytest.raises(ConfigError, match=r"precison.*Did you mean 'precision'"):
        load_and_check(None, ["roles.actor_infer.strategy_options.precison=bf16"])
    cfg = load_and_check(None, ["roles.actor_train.strategy_options.precision=bf16"])
    assert cfg.roles.actor_train.strategy_options == {"precision": "bf16"}
    assert cfg.roles.actor_infer.strategy_options == {"precision": "fp32", "cuda_graphs": True}


def test_a_run_with_bf16_roles_reaches_the_workers_and_stays_near_fp32(tiny_config, tmp_path):
    """The setting travels with the config to the workers: the supervised warm-up's loss (trained by
    actor_train) is near the fp32 run's and not equal to it, and the RL steps run."""
    runs = {}
    for precision in ("fp32", "bf16"):
        cfg = tiny_config(f"output_dir={tmp_path / precision}", f"roles.actor_train.strategy_options.precision={precision}",
                          f"roles.actor_infer.strategy_options.precision={precision}")
        RLVRPipeline(cfg, LocalExecutor()).run()
        runs[precision] = metrics_of(tmp_path / precision)
    half, full = (runs[p][0]["warmup/loss"] for p in ("bf16", "fp32"))
    assert half == pytest.approx(full, rel=1e-2) and half != full
    assert [r["step"] for r in runs["bf16"]] == [0, 1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["train/pg_loss"])) for r in runs["bf16"][1:])


def test_bf16_lora_trains_float32_adapters_near_fp32s_update(tiny_model_path):
    pytest.importorskip("peft", reason="LoRA needs peft: pip install 'roll-core[lora]'")
    from roll_core.config import load_config

    batch = training_batch(vocab=90)
    metrics, trainers = {}, {}
    for precision in ("fp32", "bf16"):
        cfg = load_config(None, ["roles.actor_train.lora={rank: 8, alpha: 16}", "roles.actor_train.lr=0.01",
                                 f"roles.actor_train.strategy_options.precision={precision}"])
        trainers[precision] = HFTrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=0)
        metrics[precision] = update(trainers[precision], batch, ActorObjective.from_config(cfg.algorithm),
                                    UpdateSpec(max_grad_norm=1.0, micro_batch_size=8))
    # the same seed, the same fresh adapters (lora.wrap): the norms are 3e-5 apart on either CPU kernel
    assert metrics["bf16"]["train/grad_norm"] == pytest.approx(metrics["fp32"]["train/grad_norm"], rel=5e-3)
    assert metrics["bf16"]["train/grad_norm"] != metrics["fp32"]["train/grad_norm"]
    adapters = [p for p in trainers["bf16"].model.parameters() if p.requires_grad]
    assert adapters and {p.dtype for p in adapters} == {torch.float32}
