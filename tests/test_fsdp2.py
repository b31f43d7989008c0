"""The ``fsdp2`` training strategy in this process, as one worker runs it (a process group of one):
every decoder layer is an FSDP unit of its own, and a checkpoint of the sharded model and optimizer
resumes the policy bit for bit and exports a plain safetensors model.

``test_distributed.py`` checks two ranks against one ``hf`` worker and a killed worker's restart on
Ray, in minutes; this takes seconds, so hand mutants of ``strategies/fsdp2.py`` run against it."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from conftest import resume_hf_style_checkpoint

from roll_core.config import load_config


@pytest.fixture
def process_group():
    """The group of one that the strategy opens, closed afterwards: later tests start without one."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_sharded_checkpoint_resumes_exactly(tiny_model_path, tmp_path, process_group):
    from torch.distributed.fsdp import FSDPModule

    from roll_core.strategies.compiled import decoder_layers
    from roll_core.strategies.fsdp2 import FSDP2TrainStrategy

    cfg = load_config(None, ["executor=local", "roles.actor_train.strategy=fsdp2"])
    saved, _ = resume_hf_style_checkpoint(FSDP2TrainStrategy, tiny_model_path, cfg, tmp_path / "ckpt")
    layers = decoder_layers(saved.model)
    assert len(layers) == saved.model.config.num_hidden_layers
    assert all(isinstance(m, FSDPModule) for m in layers + [saved.model])
