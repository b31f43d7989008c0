"""AdamW of the torch strategies (roll_core.strategies.hf.fused_adamw): torch's fused kernel wherever
it takes the parameters, the same update as torch's default loop up to float rounding, and the
default kept for what the kernel does not take."""

from __future__ import annotations

import pytest
import torch

from roll_core.config.schema import ActorTrainRoleConfig, CriticRoleConfig, TrainRoleConfig
from roll_core.strategies.hf import HFCriticStrategy, HFTrainStrategy, fused_adamw


class _Sharded(torch.Tensor):
    """A tensor subclass, as FSDP2's DTensor parameters are."""


def test_plain_float_parameters_on_one_supported_device_step_fused():
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]
    assert fused_adamw(params) is True
    assert fused_adamw([*params, torch.randn(2).as_subclass(_Sharded)]) is None
    assert fused_adamw([*params, torch.zeros(2, device="meta")]) is None  # two device types
    assert fused_adamw([torch.zeros(2, device="meta")]) is None  # a device without the kernel
    assert fused_adamw([*params, torch.zeros(2, dtype=torch.long)]) is None
    assert fused_adamw([]) is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_the_fused_step_is_the_default_loops_up_to_rounding(device):
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(64, 32, generator=g).to(device), torch.randn(32, generator=g).to(device)]
    grads = [[torch.randn(t.shape, generator=g).to(device) for t in start] for _ in range(3)]
    weights = []
    for fused in (None, True):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused)
        for step in grads:
            for p, grad in zip(params, step):
                p.grad = grad.clone()
            optimizer.step()
        weights.append(params)
    for loop, fused in zip(*weights):
        torch.testing.assert_close(fused, loop, atol=1e-6, rtol=1e-6)
    assert float((weights[0][0] - start[0]).abs().max()) > 1e-3  # three steps of lr 1e-2 moved them


def test_the_trainer_and_the_value_model_step_fused_lora_adapters_too(tiny_model_path):
    trainer = HFTrainStrategy(str(tiny_model_path), TrainRoleConfig(), seed=0)
    assert trainer.optimizers["default"].defaults["fused"] is True
    trainer.optimizer_step("phase2", lr=1e-3)  # a phase of its own gets a fresh optimizer, fused as well
    assert trainer.optimizers["phase2"].defaults["fused"] is True
    critic = HFCriticStrategy(str(tiny_model_path), CriticRoleConfig(), seed=0)
    assert critic.optimizers["default"].defaults["fused"] is True
    adapters = HFTrainStrategy(str(tiny_model_path), ActorTrainRoleConfig(lora={"rank": 4}), seed=0)
    assert adapters.optimizers["default"].defaults["fused"] is True
