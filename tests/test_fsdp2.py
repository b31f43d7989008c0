"""The ``fsdp2`` training strategy in this process, as one worker runs it (a process group of one):
every decoder layer is an FSDP unit of its own, and a checkpoint of the sharded model and optimizer
resumes the policy bit for bit and exports a plain safetensors model.

``test_distributed.py`` checks two ranks against one ``hf`` worker and a killed worker's restart on
Ray, in minutes; this takes seconds, so mutation testing runs it for ``strategies/fsdp2.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from roll_core.config import load_config
from roll_core.testing import assert_checkpoint_resumes_exactly


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
    made = []

    def make_trainer(seed):
        made.append(FSDP2TrainStrategy(str(tiny_model_path), cfg.roles.actor_train, seed=seed))
        return made[-1]

    assert_checkpoint_resumes_exactly(make_trainer, cfg, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model" / "model.safetensors").is_file()
    model = made[0].model
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers and all(isinstance(m, FSDPModule) for m in layers + [model])
    # the sampling generator resumes too: the strategy built with seed 1 draws on with seed 0's state
    saved = torch.load(tmp_path / "ckpt" / "train_state.pt", weights_only=False)["generator"]
    assert torch.equal(made[1].rng_state(), saved)
    assert not torch.equal(saved, torch.Generator(device="cpu").manual_seed(1).get_state())
