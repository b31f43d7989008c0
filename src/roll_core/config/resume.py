"""Whether a run in ``output_dir`` may be resumed with the config given now.

``roll run`` resumes from the latest checkpoint by default. Resuming with a config that means a
different run (another reward, other data, model or algorithm) would silently continue the old
run under the new name: a 20-step try of a new reward in the quickstart's directory would train
zero steps and reprint the old accuracy. So every checkpoint records its config, and a resume
compares it with the new one key by key.

Changes that keep the run's meaning resume as before (:data:`RESUMABLE`): more or fewer steps and
the rest of ``trainer``, where and how workers run (executor, Ray, runtime, worker counts, devices,
threads, strategies), trackers, the reward workers' failure policy, and the asynchronous
scheduler's throughput knobs. Anything else is refused with the differing keys and the two ways
forward. A key the checkpoint's config lacks was added to roll since it was written; it counts as
its default, so a run resumes under a newer roll unless the new key is set to something else. Only
what the run's pipeline reads is compared (``Pipeline.resume_view``): an rlvr run resumes whatever
``dpo.*`` says, and a null that means "the loss's own choice" equals the choice it resolves to.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any, Callable

from roll_core.errors import ConfigError

RESUMABLE = (
    "exp_name", "output_dir", "executor", "torch_threads", "trackers", "trainer.*", "ray.*", "runtime.*",
    "rollout.request_size", "rollout.max_running_requests",
    "roles.*.num_workers", "roles.*.device_mapping*", "roles.*.num_devices_per_worker", "roles.*.torch_threads",
    "roles.*.strategy", "roles.*.micro_batch_size", "roles.*.timeout_s", "roles.*.on_timeout", "roles.*.on_nonfinite",
    "roles.*.cpus", "roles.*.envs_per_worker",
    # where env workers ran before they became roles.env (a checkpoint written then still resumes)
    "agentic.env_workers", "agentic.env_worker_cpus", "agentic.envs_per_worker",
)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; empty dicts and other values are leaves."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def meaningful_changes(saved: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any] | None = None,
                       view: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` for every key that differs outside :data:`RESUMABLE`.
    With ``defaults`` (a whole default config), a key ``current`` has and ``saved`` lacks takes its default value,
    unless ``saved`` holds a plain value above it (``roles.critic: None`` lacks ``roles.critic.lr``
    because it had no critic, not because the key is new). ``view`` maps both flattened configs to
    what decides the run (the pipeline's ``resume_view``: the sections it reads, nulls resolved)."""
    old, new = flatten(saved), flatten(current)
    for key, value in flatten(defaults or {}).items():
        parts = key.split(".")
        if key in new and key not in old and not any(".".join(parts[:i]) in old for i in range(1, len(parts))):
            old[key] = value
    if view is not None:
        old, new = view(old), view(new)
    missing = object()
    changes = []
    for key in sorted(old.keys() | new.keys()):
        before, after = old.get(key, missing), new.get(key, missing)
        if before != after and not any(fnmatchcase(key, pattern) for pattern in RESUMABLE):
            changes.append((key, None if before is missing else before, None if after is missing else after))
    return changes


def check_resume(saved: dict[str, Any] | None, current: dict[str, Any], checkpoint,
                 view: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
    """Raise :class:`ConfigError` when resuming ``checkpoint`` (saved with ``saved``) under ``current``
    would change the run's meaning (as ``view`` sees it; see :func:`meaningful_changes`).
    Checkpoints written before configs were recorded pass."""
    if saved is None:
        return
    from roll_core.config.schema import RollConfig

    changes = meaningful_changes(saved, current, RollConfig().model_dump(mode="json"), view)
    if not changes:
        return
    shown = "; ".join(f"{k}: {_short(a)} -> {_short(b)}" for k, a, b in changes[:8])
    more = f" (and {len(changes) - 8} more)" if len(changes) > 8 else ""
    raise ConfigError(
        f"output_dir '{current['output_dir']}' holds a run with a different config (checkpoint {checkpoint}): "
        f"{shown}{more}. Resuming would continue that run, not start this one. Use a new output_dir, or start "
        f"over in this one with trainer.resume=never. (Changes to steps, trainer, executor, runtime, trackers, "
        f"workers, devices and threads do resume.)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
