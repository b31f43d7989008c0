"""``runtime.pack_decoding_weights``: inside a generate call on CPU the large fp32 linear layers compute
small products from a copy of their weight packed once (MKL's layout, or oneDNN's on AMD CPUs);
everything else is left to ``F.linear``, and nothing of it outlives the call. Every test runs on both
kernels, whatever the CPU, where this torch build offers them."""

import pytest
import torch
import torch.nn.functional as F

from roll_core.config import load_config
from roll_core.strategies import cpu_matmul
from roll_core.strategies.cpu_matmul import PACKED_MIN_FEATURES, PACKED_ROWS, PackedLinear, packed_for_decoding

WIDE = PACKED_MIN_FEATURES  # the narrowest layer that is packed


@pytest.fixture(autouse=True, params=["mkl", "onednn"])
def kernel(request):
    """Each test on each packing kernel (:func:`cpu_matmul.packing_kernel` picks one by the CPU);
    the module's state as it was afterwards."""
    mode, pack, chosen = cpu_matmul._mode, cpu_matmul._pack_decoding, cpu_matmul._packing_kernel
    sizes, room = dict(cpu_matmul._packed_sizes), dict(cpu_matmul._room)
    cpu_matmul.configure("torch")
    cpu_matmul._packing_kernel = request.param
    cpu_matmul._packed_sizes.clear()  # each shape's check is the kernel's
    yield request.param
    cpu_matmul._mode, cpu_matmul._pack_decoding, cpu_matmul._packing_kernel = mode, pack, chosen
    for cache, saved in ((cpu_matmul._packed_sizes, sizes), (cpu_matmul._room, room)):
        cache.clear()
        cache.update(saved)


@pytest.fixture
def packing_offered(kernel):
    """Skips where this torch build lacks the kernel (not x86, no MKL); where it has it, its packing
    must agree with ``F.linear``."""
    if not (cpu_matmul.onednn_available() if kernel == "onednn" else torch.backends.mkl.is_available()):
        pytest.skip(f"this torch build has no {kernel} kernel (not x86, or built without it)")
    assert cpu_matmul.packing_agrees(WIDE, WIDE), f"{kernel}'s packed product disagrees with F.linear"


needs_packing = pytest.mark.usefixtures("packing_offered")


def model() -> torch.nn.Sequential:
    """Two layers to pack and one too narrow (a small vocabulary's head); each shape's packing is
    checked here (:func:`cpu_matmul.packing_agrees`), before a test spies on the packed product."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(WIDE, WIDE + 64), torch.nn.Linear(WIDE + 64, WIDE, bias=False),
                              torch.nn.Linear(WIDE, 32))
    for layer in net:
        cpu_matmul.packing_agrees(*layer.weight.shape)
    return net


@needs_packing
def test_wide_layers_compute_small_products_from_the_packed_copy_inside_only(monkeypatch):
    net = model()
    calls = []
    kernel = cpu_matmul._packed_linear
    monkeypatch.setattr(cpu_matmul, "_packed_linear", lambda x, *a: calls.append(tuple(x.shape)) or kernel(x, *a))
    x = torch.randn(2, 16, WIDE)  # 32 rows, as a [batch, positions, features] input
    with torch.no_grad():
        expected = net(x)
        with packed_for_decoding(net) as layers:
            assert layers == 2 and [type(m) for m in net] == [PackedLinear, PackedLinear, torch.nn.Linear]
            got = net(x)
    assert calls == [(2, 16, WIDE), (2, 16, WIDE + 64)]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert [type(m) for m in net] == [torch.nn.Linear] * 3 and not any("_packed" in vars(m) for m in net)
    with torch.no_grad():
        net(x)
    assert len(calls) == 2  # outside the block: F.linear again


@needs_packing
@pytest.mark.parametrize("rows", [1, PACKED_ROWS[0] - 1, PACKED_ROWS[1] + 1])
def test_row_counts_outside_the_packed_range_take_f_linear_exactly(monkeypatch, rows):
    net = model()
    monkeypatch.setattr(cpu_matmul, "_packed_linear", lambda *a: pytest.fail("the packed copy was used"))
    x = torch.randn(rows, WIDE)
    with torch.no_grad(), packed_for_decoding(net):
        assert torch.equal(net[0](x), F.linear(x, net[0].weight, net[0].bias))


@needs_packing
@pytest.mark.parametrize("rows", PACKED_ROWS)
def test_the_ends_of_the_row_range_are_packed(monkeypatch, rows):
    net = model()
    used = []
    kernel = cpu_matmul._packed_linear
    monkeypatch.setattr(cpu_matmul, "_packed_linear", lambda *a: used.append(a[-1]) or kernel(*a))
    x = torch.randn(rows, WIDE)
    with torch.no_grad(), packed_for_decoding(net):
        torch.testing.assert_close(net[0](x), F.linear(x, net[0].weight, net[0].bias), rtol=1e-4, atol=1e-5)
    assert used == [rows]  # each call passes its own row count


@needs_packing
def test_gradients_autocast_and_empty_inputs_take_f_linear(monkeypatch):
    net = model()
    monkeypatch.setattr(cpu_matmul, "_packed_linear", lambda *a: pytest.fail("the packed copy was used"))
    x = torch.randn(8, WIDE)
    with packed_for_decoding(net):
        net[0](x).sum().backward()  # grad mode on: the weight gets its gradient
        assert net[0].weight.grad is not None
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):  # a bf16 role: autocast casts F.linear's inputs
                assert net[0](x).dtype == torch.bfloat16
            assert net[0](torch.zeros(0, WIDE)).shape == (0, WIDE + 64)


def test_off_unavailable_or_disagreeing_packs_nothing(monkeypatch):
    net = model()
    cpu_matmul.configure("torch", pack_decoding_weights=False)  # runtime.pack_decoding_weights=false
    with packed_for_decoding(net) as layers:
        assert layers == 0 and type(net[0]) is torch.nn.Linear
    cpu_matmul.configure("torch")
    with torch.autocast("cpu", dtype=torch.bfloat16), packed_for_decoding(net) as layers:  # a bf16 role's call
        assert layers == 0
    cpu_matmul._packed_sizes.clear()

    def missing(weight):
        raise RuntimeError("no MKL")  # what torch.ops raises where the op is not built in

    monkeypatch.setattr(cpu_matmul, "_pack", missing)
    assert not cpu_matmul.packing_agrees(WIDE, WIDE)  # the op is missing: not offered
    with packed_for_decoding(net) as layers:
        assert layers == 0
    monkeypatch.undo()
    cpu_matmul._packed_sizes.clear()
    # a layout that depended on the row count: right for the count it was packed for, wrong for the others
    monkeypatch.setattr(cpu_matmul, "_packed_linear",
                        lambda x, packed, w, b, rows: F.linear(x, w, b) + 1e-3 * (rows != PACKED_ROWS[1]))
    assert not cpu_matmul.packing_agrees(WIDE, WIDE + 64)


@needs_packing
def test_subclasses_other_devices_and_dtypes_are_left_alone():
    class Adapter(torch.nn.Linear):
        pass

    net = torch.nn.Sequential(Adapter(WIDE, WIDE), torch.nn.Linear(WIDE, WIDE).double(), torch.nn.Linear(WIDE, WIDE))
    with packed_for_decoding(net) as layers:
        assert layers == 1 and [type(m) for m in net] == [Adapter, torch.nn.Linear, PackedLinear]


@needs_packing
def test_an_error_inside_restores_every_layer():
    net = model()
    with pytest.raises(KeyError), packed_for_decoding(net):
        raise KeyError("stop")
    assert [type(m) for m in net] == [torch.nn.Linear] * 3 and not any("_packed" in vars(m) for m in net)


@needs_packing
@pytest.mark.skipif(torch.cuda.is_available(), reason="the strategy puts the model on the GPU")
def test_the_hf_engine_samples_the_same_tokens_with_and_without_packing(tmp_path, monkeypatch):
    """A model wide enough to pack (hidden 256), one generate call each way from the same seed: the
    same tokens, log-probs equal to float rounding, and the call did go through the packed layers."""
    from roll_core.config.schema import InferRoleConfig, TinyModelConfig
    from roll_core.data import Batch
    from roll_core.embedded.model import build_tiny_model
    from roll_core.strategies.hf import HFInferStrategy

    path = build_tiny_model(tmp_path / "wide", TinyModelConfig(hidden_size=WIDE, num_layers=2, num_heads=4,
                                                               intermediate_size=2 * WIDE))
    engine = HFInferStrategy(str(path), InferRoleConfig(), seed=0)
    prompts = {"prompt_ids": torch.tensor([[5, 6, 7, 8]] * 6 + [[0, 9, 10, 11]] * 6),
               "prompt_mask": torch.tensor([[1, 1, 1, 1]] * 6 + [[0, 1, 1, 1]] * 6)}
    linears = [m for m in engine.model.modules() if type(m) is torch.nn.Linear and min(m.weight.shape) >= WIDE]
    assert len(linears) == 14 and all(cpu_matmul.packing_agrees(*m.weight.shape) for m in linears)  # checked first
    calls = []
    kernel = cpu_matmul._packed_linear
    monkeypatch.setattr(cpu_matmul, "_packed_linear", lambda *a: calls.append(a[-1]) or kernel(*a))
    outs, used = [], []
    for pack in (False, True):
        cpu_matmul.configure("torch", pack_decoding_weights=pack)
        engine.generator.manual_seed(3)
        outs.append(engine.generate(Batch(dict(prompts)), max_new_tokens=6, temperature=1.0, top_p=1.0))
        used.append(len(calls))
    assert used[0] == 0 and used[1] >= 2 * len(linears)  # off: none; on: the prefill's and the decoding steps' products
    assert all(type(m) is torch.nn.Linear for m in engine.model.modules() if isinstance(m, torch.nn.Linear))
    assert torch.equal(outs[0]["responses"], outs[1]["responses"])
    torch.testing.assert_close(outs[0]["infer_log_probs"], outs[1]["infer_log_probs"], rtol=0, atol=1e-4)


def test_the_config_key_reaches_every_worker(tiny_model_path):
    from roll_core.runtime.workers import InferWorker

    assert load_config(None, []).runtime.pack_decoding_weights is True
    cfg = load_config(None, ["executor=local", "runtime.pack_decoding_weights=false", "runtime.cpu_matmul=torch"])
    InferWorker("actor_infer", str(tiny_model_path), cfg.roles.actor_infer, cfg, seed=0)
    assert cpu_matmul._pack_decoding is False
    with pytest.raises(Exception, match="pack_decoding_weight"):
        load_config(None, ["runtime.pack_decoding_weight=false"])


@needs_packing
def test_copies_too_large_for_the_memory_available_are_not_made_and_the_answer_is_kept(monkeypatch, tmp_path):
    """The copies of ``model()``'s two wide layers take ``need`` bytes: they are made where that is at
    most half the available memory, not where it is more (a warning says so) or where nobody says."""
    net = model()
    need = sum(cpu_matmul._packed_size(*m.weight.shape) for m in net[:2])
    assert need >= 2 * 4 * WIDE * WIDE  # either layout takes at least the weights' own bytes
    for available, packs in ((2 * need, True), (2 * need - 1, False), (None, False)):
        cpu_matmul._room.clear()
        monkeypatch.setattr(cpu_matmul, "available_memory", lambda: available)
        if packs:
            with packed_for_decoding(net) as layers:
                assert layers == 2
        else:
            with pytest.warns(RuntimeWarning, match="decoding without packed weights .* would take"), \
                    packed_for_decoding(net) as layers:
                assert layers == 0 and type(net[0]) is torch.nn.Linear
    monkeypatch.setattr(cpu_matmul, "available_memory", lambda: pytest.fail("asked again"))
    with packed_for_decoding(net) as layers:  # decided once per size: the last answer (unknown memory) holds
        assert layers == 0


def test_available_memory_is_read_from_proc_meminfo(monkeypatch, tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n")
    monkeypatch.setattr(cpu_matmul, "MEMINFO", info)
    assert cpu_matmul.available_memory() == 20000000 * 1024
    info.write_bytes(b"Hugepagesize:    2048 kB \xff\nMemAvailable:   20000000 kB\n")  # a stray byte
    assert cpu_matmul.available_memory() == 20000000 * 1024
    info.write_text("MemTotal:       24576000 kB\n")  # a kernel too old to say
    assert cpu_matmul.available_memory() is None
    info.unlink()  # no /proc
    assert cpu_matmul.available_memory() is None


@pytest.mark.parametrize("vendor, onednn, chosen", [("AuthenticAMD", True, "onednn"), ("AuthenticAMD", False, "mkl"),
                                                    ("GenuineIntel", True, "mkl"), ("", True, "mkl")])
def test_amd_cpus_pack_for_onednn_and_the_rest_for_mkl(monkeypatch, vendor, onednn, chosen):
    """MKL's products of a few rows ran at 0.25-0.9x oneDNN's on an AMD EPYC; on an Intel Xeon MKL's
    packing was the faster. Decided once: the CPU is not read again."""
    monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_matmul, "onednn_available", lambda: onednn)
    cpu_matmul._packing_kernel = None
    assert cpu_matmul.packing_kernel() == chosen
    monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda: pytest.fail("the CPU was read again"))
    assert cpu_matmul.packing_kernel() == chosen


@needs_packing
def test_each_kernel_packs_its_own_layout(kernel):
    """oneDNN's copy has the weight's shape and size; MKL's is a buffer of its own size. Either serves
    every row count of the packed range."""
    weight, bias = torch.randn(WIDE + 64, WIDE), torch.randn(WIDE + 64)
    packed = cpu_matmul._pack(weight)
    assert (packed.shape == weight.shape) is (kernel == "onednn")
    if kernel == "onednn":
        assert cpu_matmul._packed_size(WIDE + 64, WIDE) == weight.numel() * 4
    assert cpu_matmul.packing_agrees(768, 3072)  # the 95M model's MLP: sums of 3,072 terms pass the check
    for rows in (PACKED_ROWS[0], 9, PACKED_ROWS[1]):
        x = torch.randn(2, rows, WIDE) * WIDE ** -0.5
        torch.testing.assert_close(cpu_matmul._packed_linear(x, packed, weight, bias, 2 * rows),
                                   F.linear(x, weight, bias), rtol=1e-4, atol=1e-5)
