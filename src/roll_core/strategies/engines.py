"""What inference-engine plugins (roll-vllm, roll-sglang) share about the engine package they wrap:
importing it with an actionable error, warning when its version is outside the tested range, and
checking the engine arguments a user passes through ``strategy_options.engine_args``.

The engine itself is driven by :mod:`roll_core.strategies.engine_loop`; token lists in and out are
in :mod:`roll_core.strategies.sequences`.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping

from roll_core.errors import did_you_mean


def import_engine(module: str, install_hint: str) -> ModuleType:
    """``import module``; when the module itself is missing, an :class:`ImportError` with
    ``install_hint`` (a missing dependency *of* the engine keeps its own error)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            raise ImportError(install_hint) from None
        raise


def check_engine_version(engine: str, version: str, supported: Iterable[str], plugin: str) -> None:
    """Warn when ``version`` of ``engine`` (local suffixes such as ``+cpu`` ignored) is outside the
    ``supported`` specifiers that ``plugin`` is tested with."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    spec = SpecifierSet(",".join(supported))
    if Version(".".join(map(str, Version(version).release))) not in spec:
        warnings.warn(f"{plugin} is tested with {engine}{spec}; {engine} {version} is installed and may not work "
                      "(pin a supported version if generation or weight updates fail)", stacklevel=3)


def check_engine_args(args: dict, known: Iterable[str], own_options: Iterable[str] | Mapping[str, str], engine: str,
                      field: str = "engine_args") -> dict:
    """Validate ``strategy_options.<field>`` (an engine's arguments that roll does not model)
    against the argument names the installed engine declares: ``own_options`` (engine argument
    names, or a map from them to the option that sets them) must be set as options of their own;
    an unknown name gets a did-you-mean. Returns ``args``."""
    known = set(known)
    own = dict(own_options) if isinstance(own_options, Mapping) else {name: name for name in own_options}
    for key in args:
        if key in own:
            raise ValueError(f"'{key}' is an option of its own: set strategy_options.{own[key]}, not {field}.{key}")
        if key not in known:
            raise ValueError(f"unknown {engine} argument '{key}'.{did_you_mean(key, sorted(known))}")
    return args


def engine_cuts(temperature: float, top_p: float, top_k: int) -> tuple[float, int] | None:
    """``(top_p, top_k)`` as vLLM's and SGLang's sampling parameters take them when a draw at these
    settings cuts the distribution (``top_k`` 0 becomes -1, which both take for "every token"), or
    None when it does not (greedy decoding, or no cut asked for).

    Both engines report the sampled tokens' log-probs after their cuts, renormalised over the tokens
    kept; roll's ``infer_log_probs`` are before them (:meth:`~roll_core.strategy.InferStrategy.generate`),
    so an engine that cuts recomputes them with its ``compute_log_probs``."""
    if temperature <= 0 or (top_p >= 1.0 and top_k <= 0):
        return None
    return top_p, top_k if top_k > 0 else -1


def samples_before_cuts(loop, batch, cut: tuple[float, int] | None, samples: Callable[[], dict],
                        rescore: Callable[[Any], Any]):
    """``batch`` updated with ``samples()`` (an engine's ``responses``, ``response_mask`` and
    ``infer_log_probs``); when the draw cut the distribution (``cut``, from :func:`engine_cuts`),
    with ``infer_log_probs`` replaced by ``rescore(batch)`` (the engine's ``compute_log_probs`` at
    the temperature). Both run inside one :meth:`~roll_core.strategies.engine_loop.EngineLoop.whole_call`
    of ``loop``, so a weight update lands before or after the pair, never between: the re-scoring
    sees the weights that sampled."""
    with loop.whole_call() if cut else contextlib.nullcontext():
        batch.update(**samples())
        if cut:
            batch.update(infer_log_probs=rescore(batch))
    return batch
