"""runtime.cudnn_attention: workers turn cuDNN's attention kernel off unless the run asks for it.

The switch is torch's process-wide flag; what it buys is measured on a GPU (the module's docstring),
so these tests check that every worker sets it from the run's config, before its strategy computes.
"""

import pytest
import torch

from roll_core.config import load_config
from roll_core.strategies import cudnn_attention


@pytest.fixture(autouse=True)
def restore_flag():
    before = cudnn_attention.enabled()
    yield
    cudnn_attention.configure(before)


def test_configure_sets_torchs_flag():
    cudnn_attention.configure(True)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    cudnn_attention.configure(False)
    assert not torch.backends.cuda.cudnn_sdp_enabled() and not cudnn_attention.enabled()


def test_off_by_default_and_a_checked_key():
    assert load_config(None, []).runtime.cudnn_attention is False
    with pytest.raises(Exception, match="cudnn_attention"):
        load_config(None, ["runtime.cudnn_attention=sometimes"])


@pytest.mark.parametrize(("overrides", "expected"), [([], False), (["runtime.cudnn_attention=true"], True)])
@pytest.mark.parametrize("kind", ["InferWorker", "TrainWorker"])
def test_every_worker_sets_the_flag_from_the_run_config(monkeypatch, tiny_model_path, kind, overrides, expected):
    from roll_core.runtime import workers

    monkeypatch.setattr(workers, "bind_devices", lambda devices: None)  # keep this process's CUDA view
    cfg = load_config(None, ["executor=local", *overrides])
    cudnn_attention.configure(not expected)  # the opposite of what the worker must set
    role = "actor_infer" if kind == "InferWorker" else "actor_train"
    getattr(workers, kind)(role, str(tiny_model_path), getattr(cfg.roles, role), cfg, seed=0)
    assert cudnn_attention.enabled() is expected
