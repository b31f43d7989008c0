"""``runtime.cpu_matmul``: linear layers on oneDNN compute what ``nn.Linear`` computes, in both passes,
and swapping the kernel changes nothing a checkpoint, the weight sync or an adapter sees."""

import copy

import pytest
import torch

from roll_core.config import load_config
from roll_core.errors import RollError
from roll_core.strategies import cpu_matmul
from roll_core.strategies.cpu_matmul import OneDNNLinear

needs_onednn = pytest.mark.skipif(not cpu_matmul.onednn_available(), reason="this torch build has no oneDNN kernel")


@pytest.fixture(autouse=True)
def _restore_mode():
    mode, available = cpu_matmul._mode, cpu_matmul._available
    yield
    cpu_matmul._mode, cpu_matmul._available = mode, available


@needs_onednn
def test_under_autocast_the_layers_are_autocasts(monkeypatch):
    """A bf16 role (strategy_options.precision) runs under autocast, which casts F.linear's inputs and
    not the oneDNN op's: the layer must leave the call to F.linear (bf16 in, bf16 out)."""
    layer = torch.nn.Linear(24, 40)
    cpu_matmul.configure("onednn")
    assert cpu_matmul.adopt(torch.nn.Sequential(layer)) == 1 and type(layer) is OneDNNLinear
    x = torch.randn(5, 24)
    assert layer(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=0.05, rtol=0.02)


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_both_passes_match_nn_linear(bias):
    """Forward on a 3-D input, and the gradients of the input, the weight and the bias."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(24, 40, bias=bias), torch.nn.Tanh(), torch.nn.Linear(40, 7, bias=bias))
    fast = copy.deepcopy(plain)
    cpu_matmul.configure("onednn")
    assert cpu_matmul.adopt(fast) == 2 and all(type(m) is OneDNNLinear for m in (fast[0], fast[2]))
    x = torch.randn(3, 5, 24)
    x_plain, x_fast = x.clone().requires_grad_(), x.clone().requires_grad_()
    weights = torch.randn(3, 5, 7)  # a loss whose gradient differs per output
    (plain(x_plain) * weights).sum().backward()
    (fast(x_fast) * weights).sum().backward()
    torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_fast.grad, x_plain.grad, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(fast.parameters(), plain.parameters()):
        assert mine.grad.shape == theirs.grad.shape
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_frozen_weight_gets_no_gradient_and_no_grad_mode_computes_the_same():
    torch.manual_seed(1)
    layer = torch.nn.Linear(8, 4)
    reference = copy.deepcopy(layer)
    cpu_matmul.configure("onednn")
    cpu_matmul.adopt(layer)
    layer.weight.requires_grad_(False)
    x = torch.randn(6, 8, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is not None and x.grad is not None
    x3 = torch.randn(2, 3, 8)
    with torch.no_grad():
        torch.testing.assert_close(layer(x3), reference(x3), rtol=1e-5, atol=1e-5)
    assert layer(torch.zeros(0, 8)).shape == (0, 4)  # no rows: torch's own kernel


@needs_onednn
def test_other_dtypes_fall_back_to_torch_with_their_bias():
    torch.manual_seed(2)
    layer = torch.nn.Linear(8, 4).double()
    reference = copy.deepcopy(layer)
    cpu_matmul.configure("onednn")
    cpu_matmul.adopt(layer)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    torch.testing.assert_close(layer(x), reference(x))


def test_the_kernel_is_offered_only_when_it_agrees_with_torch(monkeypatch):
    if cpu_matmul.onednn_available():
        cpu_matmul._available = None
        assert cpu_matmul.onednn_available() is True  # checked again, from scratch
    for wrong in (lambda x, w, b: torch.zeros(x.shape[0], w.shape[0]),  # a kernel that computes something else
                  lambda x, w, b: (_ for _ in ()).throw(RuntimeError("unsupported ISA"))):
        monkeypatch.setattr(cpu_matmul, "_onednn_linear", wrong)
        cpu_matmul._available = None
        assert cpu_matmul.onednn_available() is False


@needs_onednn
def test_adopting_keeps_names_tied_weights_and_subclasses(tiny_model_path):
    from roll_core.strategies.models import load_causal_lm

    model = load_causal_lm(str(tiny_model_path))
    before = {name: param for name, param in model.named_parameters()}
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())

    class Adapter(torch.nn.Linear):  # a subclass keeps its own forward
        pass

    model.extra = Adapter(2, 2)
    cpu_matmul.configure("onednn")
    assert cpu_matmul.adopt(model) == linears > 0
    assert type(model.extra) is Adapter
    del model.extra
    assert {name: param for name, param in model.named_parameters()} == before  # the same Parameter objects
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert set(model.state_dict()) == set(load_causal_lm(str(tiny_model_path)).state_dict())


def test_torch_mode_leaves_models_alone():
    cpu_matmul.configure("torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert cpu_matmul.adopt(model) == 0 and type(model[0]) is torch.nn.Linear
    assert not cpu_matmul.uses_onednn()


def test_a_missing_kernel_is_an_error_for_onednn_and_falls_back_for_auto():
    cpu_matmul._available = False  # as on a torch build without oneDNN
    with pytest.raises(RollError, match="^runtime.cpu_matmul: onednn, but .*; use auto or torch$"):
        cpu_matmul.configure("onednn")
    cpu_matmul.configure("auto")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert cpu_matmul.adopt(model) == 0 and type(model[0]) is torch.nn.Linear
    with pytest.raises(RollError, match="^runtime.cpu_matmul: 'fast' is not one of auto, onednn, torch$"):
        cpu_matmul.configure("fast")


@pytest.mark.parametrize("vendor, flags, onednn", [
    ("AuthenticAMD", {"avx2", "avx512f"}, True), ("AuthenticAMD", {"avx2"}, False),
    ("GenuineIntel", {"avx2", "avx512f"}, False), ("", set(), False)])
def test_auto_takes_onednn_on_the_cpus_where_it_was_faster(monkeypatch, vendor, flags, onednn):
    """oneDNN beat MKL's sgemm 2-3x on AMD EPYCs with AVX-512 (Zen 4, Zen 5); on one with AVX2 only
    (Zen 2) and on an Intel Xeon MKL was level or faster, and elsewhere nobody measured. ``onednn``
    and ``torch`` ignore the CPU."""
    monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: frozenset(flags))
    cpu_matmul._available = True
    cpu_matmul.configure("auto")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert cpu_matmul.uses_onednn() is onednn
    assert cpu_matmul.adopt(model) == int(onednn)
    assert type(model[0]) is (OneDNNLinear if onednn else torch.nn.Linear)
    cpu_matmul.configure("onednn")
    assert cpu_matmul.uses_onednn()
    cpu_matmul.configure("torch")
    assert not cpu_matmul.uses_onednn()


def test_the_vendor_is_read_from_proc_cpuinfo(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
                    "processor\t: 1\nvendor_id\t: AuthenticAMD\n")
    monkeypatch.setattr(cpu_matmul, "CPUINFO", info)
    assert cpu_matmul.cpu_vendor() == "AuthenticAMD"
    info.write_bytes(b"processor\t: 0\nmodel name\t: EPYC \xff\xfe\nvendor_id\t: AuthenticAMD\n")  # a stray byte
    assert cpu_matmul.cpu_vendor() == "AuthenticAMD"
    info.write_text("processor\t: 0\nBogoMIPS\t: 48.00\n")  # an Arm CPU: no vendor_id line
    assert cpu_matmul.cpu_vendor() == ""
    info.unlink()  # no /proc (macOS, Windows)
    assert cpu_matmul.cpu_vendor() == ""


def test_the_features_are_read_from_proc_cpuinfo(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpu_matmul, "CPUINFO", info)
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f avx512bw\n"
                    "vmx flags\t: ept\nprocessor\t: 1\nflags\t\t: fpu avx2\n")
    assert cpu_matmul.cpu_flags() == {"fpu", "avx2", "avx512f", "avx512bw"}  # the first CPU's line
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx avx2 fma\n")
    assert "avx512f" not in cpu_matmul.cpu_flags() and "avx2" in cpu_matmul.cpu_flags()
    info.write_text("processor\t: 0\nFeatures\t: fp asimd\n")  # an Arm CPU names them Features
    assert cpu_matmul.cpu_flags() == frozenset()
    info.unlink()
    assert cpu_matmul.cpu_flags() == frozenset()


def test_the_config_key_is_checked_before_anything_starts():
    assert load_config(None, []).runtime.cpu_matmul == "auto"
    with pytest.raises(Exception, match="cpu_matmul"):
        load_config(None, ["runtime.cpu_matmul=mkl"])


@needs_onednn
@pytest.mark.skipif(torch.cuda.is_available(), reason="the strategies put the model on the GPU, where the CPU kernel "
                    "is not used")
@pytest.mark.parametrize("mode, expected", [("onednn", OneDNNLinear), ("torch", torch.nn.Linear)])
def test_workers_take_the_kernel_from_the_run_config(tiny_model_path, mode, expected):
    """Every worker process configures itself from ``runtime.cpu_matmul`` (as it sets its threads),
    and the hf strategies' models follow."""
    from roll_core.runtime.workers import InferWorker

    cfg = load_config(None, ["executor=local", f"runtime.cpu_matmul={mode}"])
    worker = InferWorker("actor_infer", str(tiny_model_path), cfg.roles.actor_infer, cfg, seed=0)
    worker.setup()
    kinds = {type(m) for m in worker.strategy.model.modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {expected}


@needs_onednn
def test_oneDNN_runs_for_fp32_rows_only_and_gradients_reach_whatever_trains(monkeypatch):
    calls = []
    kernel = cpu_matmul._onednn_linear
    monkeypatch.setattr(cpu_matmul, "_onednn_linear", lambda *a: calls.append(a[0].shape) or kernel(*a))
    cpu_matmul.configure("onednn")
    layer = torch.nn.Linear(8, 4)
    cpu_matmul.adopt(layer)
    layer(torch.randn(3, 8))
    assert calls == [(3, 8)]
    layer.double()(torch.randn(3, 8, dtype=torch.float64))  # not fp32: torch's kernel
    layer.float()(torch.zeros(0, 8))  # no rows: torch's kernel
    assert len(calls) == 1
    layer.weight.requires_grad_(False)  # only the bias trains
    layer(torch.randn(3, 8)).sum().backward()
    assert layer.bias.grad is not None and layer.weight.grad is None
    frozen = torch.nn.Linear(8, 4, bias=False).requires_grad_(False)  # only the input needs a gradient
    cpu_matmul.adopt(frozen)
    x = torch.randn(3, 8, requires_grad=True)
    frozen(x).sum().backward()
    torch.testing.assert_close(x.grad, frozen.weight.sum(0).expand(3, 8))
