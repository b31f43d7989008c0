"""The matrix products of roll's torch models on CPU: torch's default GEMM or oneDNN's.

torch computes an fp32 ``nn.Linear`` on CPU with the BLAS its wheel was built with (MKL). MKL is
Intel's library and does not run its AVX-512 code on other vendors' CPUs. On AMD EPYCs with AVX-512
(Zen 4 and Zen 5, 2 cores) MKL's sgemm reached 180-210 GFLOP/s on two threads, about what AVX2 can
give, where oneDNN's fp32 kernels, which ship inside the same torch and choose their code from the
CPU's features, reached 350-430 GFLOP/s on the 95M model's training shapes and 350 against 115
GFLOP/s on a decoding step's ``[64, 768] x [768, 3072]``. On an AMD EPYC without AVX-512 (Zen 2)
both have only AVX2 and were within 0.8-1.3x of each other per product, and the 95M model's update
took 1.7-2.0x longer on oneDNN (28-33 s against 16.5 s), though its generate call ran 1.15x faster.
On an Intel Xeon with AVX-512 (2 cores) the two were level on most shapes and oneDNN was slower on
some (0.50x on a training pass's ``[3240, 3072] x [3072, 768]`` forward and backward; the
quickstart's step 1.25x slower on oneDNN). ``python benchmarks/bench_cpu_matmul.py`` shows it on the
machine it runs on. Both are IEEE fp32 with fp32 accumulation: only the order of the sums differs
(about 1e-6 relative), so this is the same arithmetic done faster, not a lower precision.

``runtime.cpu_matmul`` picks, for every worker process:

* ``auto`` (default): oneDNN on AMD CPUs with AVX-512 (:func:`onednn_preferred`), where this torch
  build offers its kernel and it passes a check against torch's own product at start-up; torch's
  default otherwise. The choice follows the CPU, not a timing at start-up, so two runs of one
  config on one machine always compute alike;
* ``onednn``: oneDNN, an error where it is not offered;
* ``torch``: torch's default everywhere.

How: :func:`adopt` gives every plain ``nn.Linear`` of a model on CPU the class :class:`OneDNNLinear`,
a subclass whose forward (and backward, :class:`_OneDNNLinearFunction`) calls
``torch.ops.mkldnn._linear_pointwise``, the kernel torch's own compiler emits for CPU linear layers.
Parameters, their names, tied weights, hooks and state dicts stay as they were: only each module's
class changes, so checkpoints, weight sync and adapters (``peft`` wraps the layer as before) do not
notice. The choice is made once per process (:func:`configure`, called by every worker with the run's
config, as it sets torch's threads), so the ``local`` and ``ray`` executors compute alike. A run
records each worker's resolved choice in ``placement.json`` (``cpu_matmul``).

**Decoding steps on packed weights** (``runtime.pack_decoding_weights``, on by default). A decoding
step multiplies a few dozen rows by every weight, and torch's default kernel (MKL's sgemm) spends a
large part of such a product reordering the weight into the layout its inner loop reads, again at
every step. :func:`packed_for_decoding` reorders each large weight once per generate call and
computes the products of 4-128 rows from that copy, with the kernel :func:`packing_kernel` picks:

* MKL's (``sgemm_pack``, through ``torch.ops.mkl``, which torch's compiler uses for frozen CPU
  models) on Intel's and unknown CPUs. On an Intel Xeon (2 cores) the 95M model's
  ``[64, 768] x [768, 3072]`` ran 1.27x faster and its whole generate call 1.21x. Its copies hold
  2-5x the bytes of the weights they copy;
* oneDNN's (``torch.ops.mkldnn._reorder_linear_weight``) on AMD's, where MKL's products of a few
  rows are slow, packed or not: on an AMD EPYC with AVX2 only (Zen 2, 2 cores), oneDNN's packed
  products of 8-64 rows ran at 1.2-3.8x MKL's and the generate call 1.3x faster. Its copies hold the
  weights' bytes.

``python benchmarks/bench_packed_decoding.py`` shows both on the machine it runs on. The copies
live for the duration of the call; where they would take more than half the memory available,
nothing is packed. It applies where the layers compute with torch's kernel (not to oneDNN's layers
of ``runtime.cpu_matmul``) and is checked against ``F.linear`` once per weight shape.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F

from roll_core.errors import RollError
from roll_core.strategies.compiled import OutsideCompiledCode

Mode = Literal["auto", "onednn", "torch"]

_mode: Mode = "auto"
_available: bool | None = None  # whether oneDNN's kernel is offered and agrees with torch's (checked once)
_pack_decoding = True  # runtime.pack_decoding_weights
CPUINFO = Path("/proc/cpuinfo")  # where Linux names the CPU's vendor and its features
MEMINFO = Path("/proc/meminfo")  # where Linux says how much memory is available


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a 2-D ``x [N, in]`` and ``weight [out, in]`` (either may be a
    transposed view), on oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``x [..., in]`` as rows ``[N, in]``, and :func:`_onednn_linear` of them shaped ``[..., out]``."""
    rows = x.reshape(-1, x.shape[-1])
    return rows, _onednn_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


def onednn_available() -> bool:
    """Whether this torch build offers oneDNN's linear kernel and it computes what ``F.linear`` does
    (checked once per process on a small product)."""
    global _available
    if _available is None:
        _available = False
        try:
            if torch.backends.mkldnn.is_available():
                gen = torch.Generator().manual_seed(0)
                x, w, b = (torch.randn(*shape, generator=gen) for shape in ((5, 16), (12, 16), (12,)))
                _available = bool(torch.allclose(_onednn_linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-5))
        except (AttributeError, RuntimeError, NotImplementedError):  # op not built in, or refused on this CPU
            _available = False
    return _available


def _proc_field(path: Path, key: str) -> str | None:
    """The value after the colon on the first line of a ``/proc`` file that starts with ``key``, or
    None where the file is missing or has no such line (other systems, older kernels)."""
    try:
        with path.open(encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith(key):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def cpu_vendor() -> str:
    """The CPU's vendor as Linux reports it (``AuthenticAMD``, ``GenuineIntel``), or "" where
    ``/proc/cpuinfo`` does not say (other systems, other architectures)."""
    return _proc_field(CPUINFO, "vendor_id") or ""


def cpu_flags() -> frozenset[str]:
    """The CPU's features as Linux reports them (``avx2``, ``avx512f``, ...), or none where
    ``/proc/cpuinfo`` has no ``flags`` line (other systems, other architectures)."""
    return frozenset((_proc_field(CPUINFO, "flags") or "").split())


def onednn_preferred() -> bool:
    """Whether ``auto`` takes oneDNN on this CPU: on AMD's with AVX-512, which MKL leaves unused there
    and where its sgemm ran at a third to a half of oneDNN's speed. Elsewhere MKL matched or beat it
    (Intel; AMD with AVX2 only, where oneDNN's update was 1.7-2x slower), or nobody has measured."""
    return cpu_vendor() == "AuthenticAMD" and "avx512f" in cpu_flags()


def configure(mode: Mode, pack_decoding_weights: bool = True) -> None:
    """This process's choice for every model :func:`adopt` is given from now on, and whether
    :func:`packed_for_decoding` packs weights."""
    global _mode, _pack_decoding
    if mode not in get_args(Mode):
        raise RollError(f"runtime.cpu_matmul: '{mode}' is not one of {', '.join(get_args(Mode))}")
    if mode == "onednn" and not onednn_available():
        raise RollError("runtime.cpu_matmul: onednn, but this torch build offers no working oneDNN linear kernel "
                        "(torch.ops.mkldnn._linear_pointwise); use auto or torch")
    _mode, _pack_decoding = mode, pack_decoding_weights


def uses_onednn() -> bool:
    """Whether :func:`adopt` switches models to oneDNN in this process."""
    if _mode == "auto":
        return onednn_preferred() and onednn_available()
    return _mode == "onednn" and onednn_available()


class _OneDNNLinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with both passes on oneDNN: ``dx = dy W`` and ``dW = dy^T x`` are the same
    kernel on transposed views (no copies), ``db`` the sum of ``dy`` over rows.
    Shapes: ``x [..., in]``, ``W [out, in]``, ``b [out]``, ``y [..., out]``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows, out = _onednn_rows(x, weight, bias)
        ctx.save_for_backward(rows, weight)
        ctx.in_shape, ctx.has_bias = x.shape, bias is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor):
        rows, weight = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn_linear(grad_rows, weight.t(), None).view(ctx.in_shape)
        if ctx.needs_input_grad[1]:
            grad_w = _onednn_linear(grad_rows.t(), rows.t(), None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_rows.sum(0)
        return grad_x, grad_w, grad_b


class OneDNNLinear(torch.nn.Linear):
    """An ``nn.Linear`` computed by oneDNN on CPU in fp32 (anything else, and any call under autocast,
    which casts ``F.linear``'s inputs and not this op's: ``F.linear``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # TorchInductor cannot lower the private op: call out of the graph
            return _onednn_outside_compiled_code(self, input)
        return _onednn_forward(self, input)


def _onednn_forward(layer: OneDNNLinear, input: torch.Tensor) -> torch.Tensor:
    """``layer(input)`` on oneDNN where it applies (fp32 on CPU, no autocast), else ``F.linear``."""
    weight, bias = layer.weight, layer.bias
    if input.device.type != "cpu" or input.dtype != torch.float32 or weight.dtype != torch.float32 \
            or input.numel() == 0 or torch.is_autocast_enabled("cpu"):
        return F.linear(input, weight, bias)
    if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _OneDNNLinearFunction.apply(input, weight, bias)
    return _onednn_rows(input, weight, bias)[1]


# only while compiling: once compile_layers has run, this calls through torch.compiler.disable's wrapper
# (a few microseconds a call), which eager code, calling _onednn_forward itself, does without
_onednn_outside_compiled_code = OutsideCompiledCode(_onednn_forward)


def adopt(model: torch.nn.Module) -> int:
    """Compute ``model``'s plain ``nn.Linear`` layers on oneDNN when this process uses it and the
    model is on CPU; returns how many layers changed. Subclasses of ``nn.Linear`` (adapters,
    quantized layers) keep their own forward."""
    if not uses_onednn() or any(p.device.type != "cpu" for p in model.parameters()):
        return 0
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = OneDNNLinear
            changed += 1
    return changed


# -- decoding steps on packed weights (runtime.pack_decoding_weights) --------------------------------------

PACKED_ROWS = (4, 128)  # products of this many rows (inclusive) take the packed copy: 1-3 rows ran slower
PACKED_MIN_FEATURES = 256  # smaller layers (the tiny model's, a small vocabulary's head) gained nothing or lost
MEMORY_SHARE = 0.5  # the packed copies may take at most this share of the memory available when first asked
_packed_sizes: dict[tuple[int, int], int] = {}  # bytes of a weight shape's packed copy; 0: not usable here
_room: dict[int, bool] = {}  # whether packed copies of so many bytes fit, decided once per process


_packing_kernel: Literal["mkl", "onednn"] | None = None  # packing_kernel()'s answer, once per process


def packing_kernel() -> Literal["mkl", "onednn"]:
    """The kernel :func:`packed_for_decoding` packs weights for: oneDNN's on AMD CPUs where this torch
    build offers it (MKL's products of a few rows ran at 0.25-0.9x its speed on an AMD EPYC), MKL's
    elsewhere. Decided once per process: the CPU does not change."""
    global _packing_kernel
    if _packing_kernel is None:
        _packing_kernel = "onednn" if cpu_vendor() == "AuthenticAMD" and onednn_available() else "mkl"
    return _packing_kernel


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` reordered into the packed layout of :func:`packing_kernel`'s kernel (an
    opaque buffer: MKL's of shape ``[bytes / 4, 1]``, oneDNN's of the weight's shape)."""
    if packing_kernel() == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_ROWS[1])
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, PACKED_ROWS[1])


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   rows: int) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [..., in]`` of ``rows`` rows, from ``packed = _pack(weight)``,
    on the kernel that packed it. MKL's op takes the packed copy only for the row count given; its
    layout does not depend on it (nor does its size), which :func:`packing_agrees` checks, so each
    call passes its own. oneDNN's packed layout serves any row count."""
    if packing_kernel() == "onednn":  # both copies are tensors of torch's _mkldnn layout: they do not tell
        return _onednn_rows(x, packed, bias)[1]
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)


def _packed_size(out_features: int, in_features: int) -> int:
    """Bytes of the packed copy of an fp32 weight ``[out, in]``, or 0 where this torch build offers no
    packed product on :func:`packing_kernel`'s kernel or, for this shape, it does not give
    ``F.linear``'s result at the row counts decoding uses (checked once per shape and process)."""
    shape = (out_features, in_features)
    if shape not in _packed_sizes:
        _packed_sizes[shape] = 0
        try:
            if packing_kernel() == "onednn" or torch.backends.mkl.is_available():
                gen = torch.Generator().manual_seed(0)
                weight, bias = torch.randn(*shape, generator=gen), torch.randn(out_features, generator=gen)
                packed = _pack(weight)
                # inputs of an activation's scale (outputs about 1): fp32's rounding stays far inside the
                # tolerance on either kernel, a wrong layout far outside it
                if all(torch.allclose(_packed_linear(x, packed, weight, bias, len(x)), F.linear(x, weight, bias),
                                      rtol=1e-4, atol=1e-4)
                       for x in (torch.randn(n, in_features, generator=gen) * in_features ** -0.5
                                 for n in (PACKED_ROWS[0], 37, PACKED_ROWS[1]))):
                    _packed_sizes[shape] = packed.numel() * packed.element_size()
        except (AttributeError, RuntimeError, NotImplementedError):  # op not built in (not x86, no MKL)
            pass
    return _packed_sizes[shape]


def packing_agrees(out_features: int, in_features: int) -> bool:
    """Whether this torch build offers :func:`packing_kernel`'s packed product and, for a weight of this
    shape, it gives ``F.linear``'s result at the row counts decoding uses (checked once per shape and
    process)."""
    return _packed_size(out_features, in_features) > 0


def available_memory() -> int | None:
    """Bytes of memory Linux says are available to new allocations (``MemAvailable``), or None where
    ``/proc/meminfo`` does not say."""
    value = _proc_field(MEMINFO, "MemAvailable:")  # "20000000 kB"
    try:
        return int(value.split()[0]) * 1024 if value else None
    except ValueError:
        return None


def _room_for(nbytes: int) -> bool:
    """Whether packed copies of ``nbytes`` fit in ``MEMORY_SHARE`` of the available memory, decided
    the first time a process asks for that size (later, a process that keeps its freed memory,
    ``runtime.reuse_freed_memory``, holds the copies' last allocation and the system reads less)."""
    if nbytes not in _room:
        available = available_memory()
        _room[nbytes] = available is not None and nbytes <= MEMORY_SHARE * available
        if not _room[nbytes]:
            have = "an unknown amount" if available is None else f"{available / 2**30:.1f} GiB"
            warnings.warn(f"decoding without packed weights (runtime.pack_decoding_weights): their copies would take "
                          f"{nbytes / 2**30:.1f} GiB, and {have} of memory is available", RuntimeWarning, stacklevel=4)
    return _room[nbytes]


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` inside :func:`packed_for_decoding`: fp32 products of ``PACKED_ROWS`` rows
    without gradients come from the packed copy of the weight, anything else from ``F.linear``."""

    _packed: torch.Tensor | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        packed = self._packed
        rows = input.numel() // input.shape[-1] if input.dim() and input.shape[-1] else 0
        if packed is None or not PACKED_ROWS[0] <= rows <= PACKED_ROWS[1] or input.dtype != torch.float32 \
                or input.device.type != "cpu" or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") \
                or torch.compiler.is_compiling():
            return F.linear(input, self.weight, self.bias)
        return _packed_linear(input, packed, self.weight, self.bias, rows)


@contextlib.contextmanager
def packed_for_decoding(model: torch.nn.Module) -> Iterator[int]:
    """Inside, ``model``'s plain fp32 ``nn.Linear`` layers on CPU with both sizes at least
    ``PACKED_MIN_FEATURES`` compute small products from a copy of their weight packed on entry, so
    weights must not change inside (a generate call); yields how many layers. On exit each layer is
    a plain ``nn.Linear`` again and the copies are freed. Nothing changes where packing is off
    (``runtime.pack_decoding_weights``), under CPU autocast, unavailable, disagrees with
    ``F.linear``, or where the copies would take more than ``MEMORY_SHARE`` of the available memory
    (a warning says so, once)."""
    # under autocast (a bf16 role) every layer calls F.linear: copies would cost time and memory for nothing
    wanted = _pack_decoding and not torch.is_autocast_enabled("cpu")
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear] if wanted else []
    layers = [m for m in layers if m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
              and min(m.weight.shape) >= PACKED_MIN_FEATURES and packing_agrees(*m.weight.shape)]
    if layers and not _room_for(sum(_packed_size(*m.weight.shape) for m in layers)):
        layers = []
    try:
        with torch.no_grad():
            for layer in layers:
                layer._packed = _pack(layer.weight)
                layer.__class__ = PackedLinear
        yield len(layers)
    finally:
        for layer in layers:
            layer.__class__ = torch.nn.Linear
            layer.__dict__.pop("_packed", None)  # absent where packing stopped part-way
