"""A trained role's decoder layers compiled with ``torch.compile`` (a role's ``compile: true``).

Why: in the forward and backward passes of a transformer on CPU, the matrix products run near the
kernel's speed, but a quarter of a training pass goes to elementwise operations (RMSNorm, rotary
embeddings, the gated MLP and their gradients), each a separate pass over tensors of tens of MB.
``torch.compile`` (TorchInductor) fuses them into a few loops. At 95M parameters (hidden 768, 10
layers, 2 CPU cores) the RL update went 1.23x faster and the whole step 1.15x (generation is not
compiled), after a first pass that compiles; on the 0.5M-parameter tiny model nothing is worth
fusing and the first pass only costs (``docs/benchmarks.md``).

How: the ``forward`` of each decoder layer (the classes the model names in ``_no_split_modules``,
the same units FSDP2 shards) is replaced by its compiled version. Parameter names, ``state_dict``,
checkpoints and weight sync are unchanged, and module hooks (FSDP2's gathers) run outside the
compiled code, as they would around the eager forward. The layers share their code, so one
compilation serves all of them. Shapes are dynamic from the first call: packed rows and
micro-batches change width and count every step, and a graph specialised to one shape would
recompile on the next. The embeddings, the output head and the loss stay eager. Linear layers on
oneDNN (``runtime.cpu_matmul``) are called out of the compiled code, which fuses what lies between.

Compilation happens on the first pass, in the worker (tens of seconds on CPU; TorchInductor caches
the result under ``/tmp/torchinductor_<user>``, so a later run of the same model starts faster),
and needs a C++ compiler (TorchInductor builds its kernels with it; on GPUs too, for its launchers).
The config check looks for one on the driver's machine; :func:`compile_layers` looks again on the
worker's, which on a Ray cluster may be another machine, before anything is compiled.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a model is compiled: the config check needs none of it
    import torch

MISSING_COMPILER = ("torch.compile needs a C++ compiler and none was found (g++, c++, clang++ or $CXX); install "
                    "one (apt-get install g++) or set compile: false")


class OutsideCompiledCode:
    """``fn``, which compiled layers call as it is: TorchDynamo neither traces nor compiles it
    (``torch.compiler.disable``, applied to every such function when :func:`compile_layers` first
    runs). Eager code calls ``fn`` through this object and, once anything was compiled, through
    torch's disable wrapper too (as the decorator had it from the start).

    Why not the decorator itself: it imports TorchDynamo, 1.5 s of a process's start on 2 cores,
    which the processes that never compile (``roll validate``, reward and environment workers, a
    Ray run's driver) need not pay. Used for what TorchInductor cannot lower (oneDNN's private
    linear op) and for what changes shape with every batch (packed attention's plan)."""

    _every: list[OutsideCompiledCode] = []  # disabled together, the first time anything is compiled

    def __init__(self, fn: Callable[..., Any]):
        self.fn, self.disabled = fn, False
        functools.update_wrapper(self, fn)
        OutsideCompiledCode._every.append(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    @classmethod
    def disable_all(cls) -> None:
        """``torch.compiler.disable`` on every function marked so far, once each."""
        import torch

        for marked in cls._every:
            if not marked.disabled:
                marked.fn, marked.disabled = torch.compiler.disable(marked.fn), True


def cxx_compiler() -> str | None:
    """The C++ compiler found on this machine: ``$CXX``, else the first of g++, c++ and clang++ on the
    PATH; None when there is none."""
    return next((c for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c and shutil.which(c)), None)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` whose class (or a base of it) the model names as a layer that must
    not be split (``_no_split_modules``, found on the model or on a wrapped one such as peft's)."""
    names: set[str] = set()
    for module in model.modules():
        names |= set(getattr(module, "_no_split_modules", None) or ())
    # by the class's ancestry too: FSDP2 swaps a sharded layer's class for a subclass (FSDPLlamaDecoderLayer)
    return [module for module in model.modules() if any(c.__name__ in names for c in type(module).__mro__)]


def compile_layers(model: torch.nn.Module) -> int:
    """Compile each decoder layer of ``model`` in place (dynamic shapes); returns how many.

    Raises ``ValueError`` when the model names no such layer (compiling the whole model instead
    would also compile what the strategy does around it, and is not what ``compile: true`` says), or
    when this machine has no C++ compiler."""
    import torch

    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"compile: true, but {type(model).__name__} names no decoder layer (_no_split_modules) "
                         "to compile; set compile: false")
    if cxx_compiler() is None:  # else the first pass would fail deep inside TorchInductor
        raise ValueError(f"compile: true on {platform.node()}: {MISSING_COMPILER}")
    OutsideCompiledCode.disable_all()
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)
    return len(layers)
