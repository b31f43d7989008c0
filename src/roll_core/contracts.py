"""Contract checks of a plugin: ``roll check-plugin NAME``, run before any training starts.

A plugin that imports and registers can still be wrong in ways that only surface hours into a run:
a reward that returns a string, an estimator that returns ``[B]`` instead of ``[B, R]``, a strategy
that misses a method. These checks call every component the plugin registered, on small sample
inputs, and compare what comes back with the interface:

==========================  ======================================================================
registry                    checks
==========================  ======================================================================
rewards                     a :class:`~roll_core.rewards.Reward` subclass; ``score(sample)`` takes one
                            sample; on sample inputs ``score`` returns a finite number and
                            ``score_batch`` one per sample; the reward's own ``contract_examples()``
                            (``[(options, RewardInput, expected score or None), ...]``) give the
                            expected scores and the options to construct it with; ``close()``
                            does not raise
advantage_estimators        ``fn(AdvantageInput, AlgorithmConfig)`` returns finite ``[B, R]``
                            advantages and returns (with the roles it declares in ``needs``)
policy_losses               ``fn(PolicyLossInput, AlgorithmConfig)`` returns a finite per-token
                            ``[B, R]`` loss that back-propagates, and a dict of float metrics
kl_estimators               ``fn(log_prob, ref_log_prob)`` returns ``[B, R]`` (``[B, R, V]`` inputs
                            for estimators registered with ``distribution=True``)
preference_losses           ``fn(PreferenceInput, beta=, label_smoothing=)`` returns a finite per-pair
                            ``[B]`` loss that back-propagates, and a dict of float metrics
distill_losses              ``fn(student_logp, teacher_logp)`` on ``[B, R, V]`` returns a finite,
                            non-negative ``[B, R]`` that back-propagates and is 0 for equal inputs
datasets                    ``factory({})`` has ``train_rows()``/``eval_rows()``; rows carry ``prompt``
                            and ``ground_truth``
envs                        :class:`~roll_core.envs.Env` subclass; ``reset``/``step`` return the
                            documented tuples
trackers                    logs a step into a temporary directory and closes
strategies, schedulers,     subclasses of their interface with no abstract method left
weight syncs, pipelines
==========================  ======================================================================
"""

from __future__ import annotations

import inspect
import math
import numbers
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from roll_core.errors import PluginError, did_you_mean


@dataclass
class CheckResult:
    component: str  # "rewards:exact_match"
    check: str
    status: str  # ok | failed | skipped
    detail: str = ""


@dataclass
class ContractReport:
    plugin: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.status != "failed" for r in self.results)

    def failures(self) -> str:
        return "; ".join(f"{r.component}: {r.check}: {r.detail}" for r in self.results if r.status == "failed")


class _Fail(Exception):
    pass


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise _Fail(message)


def _finite_number(value: Any, what: str) -> float:
    # numbers.Real covers int, float and numpy / torch-free scalar floats; a bool is a bug, not a score.
    _expect(isinstance(value, numbers.Real) and not isinstance(value, bool),
            f"{what} must be a number, got {type(value).__name__} {value!r}")
    _expect(math.isfinite(float(value)), f"{what} must be finite, got {value!r}")
    return float(value)


# ------------------------------------------------------------------------------------------------
# per-registry checks: each returns a list of (check name, callable) run in order
# ------------------------------------------------------------------------------------------------


def _reward_checks(target) -> list[tuple[str, Callable[[], str]]]:
    from roll_core.rewards import Reward, RewardInput

    def is_reward():
        _expect(isinstance(target, type) and issubclass(target, Reward),
                f"must be a subclass of roll_core.rewards.Reward, got {target!r}")
        params = [p for p in inspect.signature(target.score).parameters.values() if p.name != "self"]
        _expect(len(params) == 1, f"score() must take exactly one sample, takes ({', '.join(p.name for p in params)})")
        return ""

    def examples():
        cases = target.contract_examples() if hasattr(target, "contract_examples") else None
        if cases is None:  # no examples of its own: construct without options, generic inputs
            try:
                reward = target()
            except TypeError as exc:
                raise _Fail(f"cannot be built without options ({exc}); define contract_examples() "
                            "returning [(options, RewardInput, expected score), ...]") from None
            samples = [RewardInput("1+1=", "2", "2"), RewardInput("1+1=", "3", "2"), RewardInput("", "", "")]
            cases = [({}, s, None) for s in samples]
            built = {(): reward}
        else:
            _expect(isinstance(cases, list), "contract_examples() must return a list")
            if not cases:
                return "skipped: contract_examples() is empty (needs an external service)"
            built = {}
        checked = 0
        for options, sample, expected in cases:
            key = tuple(sorted(options.items(), key=lambda kv: kv[0]))
            try:
                reward = built.get(key) or built.setdefault(key, target(**options))
            except Exception as exc:
                raise _Fail(f"construction with options {options} raised {type(exc).__name__}: {exc}") from None
            value = _finite_number(reward.score(sample), f"score({sample.response!r})")
            if expected is not None:
                _expect(abs(value - expected) <= 1e-6,
                        f"score({sample.response!r}, ground truth {sample.ground_truth!r}) = {value}, expected {expected}")
            batch = reward.score_batch([sample, sample])
            _expect(isinstance(batch, list) and len(batch) == 2,
                    f"score_batch of 2 samples must return a list of 2, got {batch!r}")
            for v in batch:
                _expect(abs(_finite_number(v, "score_batch item") - value) <= 1e-6,
                        f"score_batch disagrees with score ({batch} vs {value})")
            checked += 1
        for options, reward in built.items():  # as a run's end does (Reward.close)
            try:
                reward.close()
            except Exception as exc:
                raise _Fail(f"close() of the reward built with options {dict(options)} raised "
                            f"{type(exc).__name__}: {exc}") from None
        return f"{checked} sample(s)"

    return [("interface", is_reward), ("sample inputs", examples)]


def _sample_advantage_input(needs: tuple[str, ...]):
    import torch

    from roll_core.algorithms.advantages import AdvantageInput
    from roll_core.algorithms.shaping import outcome_token_rewards

    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0])
    g = torch.Generator().manual_seed(0)
    return AdvantageInput(
        token_level_rewards=outcome_token_rewards(scores, mask), response_mask=mask,
        group_index=torch.tensor([0, 0, 1, 1]),
        values=torch.rand(4, 3, generator=g) if "critic" in needs else None,
        old_log_probs=-torch.rand(4, 3, generator=g),
        teacher_log_probs=-torch.rand(4, 3, generator=g) if "reference" in needs else None,
    )


def _estimator_checks(target, needs) -> list[tuple[str, Callable[[], str]]]:
    def run():
        import torch

        from roll_core.config.schema import AlgorithmConfig

        batch = _sample_advantage_input(tuple(needs))
        out = target(batch, AlgorithmConfig())
        _expect(isinstance(out, tuple) and len(out) == 2, "must return (advantages, returns)")
        for name, t in zip(("advantages", "returns"), out):
            _expect(isinstance(t, torch.Tensor) and t.shape == (4, 3), f"{name} must be a [B, R] = [4, 3] tensor, "
                    f"got {getattr(t, 'shape', type(t).__name__)}")
            _expect(bool(torch.isfinite(t).all()), f"{name} has non-finite values")
        return "[4, 3] advantages and returns"

    return [("sample batch", run)]


def _loss_and_metrics(out, shape: tuple[int, ...], unit: str, leaf) -> str:
    """A loss's ``(loss, metrics)``: ``loss`` of ``shape`` (``unit`` names it), finite, back-propagating
    to ``leaf``; ``metrics`` a dict of finite numbers."""
    import torch

    size = list(shape)
    _expect(isinstance(out, tuple) and len(out) == 2, f"must return (loss {unit.split(', ')[-1]}, metrics)")
    loss, metrics = out
    _expect(isinstance(loss, torch.Tensor) and loss.shape == shape,
            f"the loss must be {unit} = {size}, got {getattr(loss, 'shape', type(loss).__name__)}")
    _expect(bool(torch.isfinite(loss).all()), f"the loss is not finite: {loss}")
    loss.sum().backward()
    _expect(leaf.grad is not None and bool(torch.isfinite(leaf.grad).all()),
            "loss does not back-propagate to the policy's log-probs")
    _expect(isinstance(metrics, dict), "metrics must be a dict")
    for k, v in metrics.items():
        _finite_number(v, f"metric {k!r}")
    return f"{size} loss, {len(metrics)} metric(s)"


def _loss_checks(target) -> list[tuple[str, Callable[[], str]]]:
    def run():
        import torch

        from roll_core.algorithms.losses import PolicyLossInput
        from roll_core.config.schema import AlgorithmConfig

        g = torch.Generator().manual_seed(0)
        log_prob = (-torch.rand(4, 3, generator=g)).requires_grad_()
        old = log_prob.detach() - 0.1 * torch.randn(4, 3, generator=g)
        inputs = PolicyLossInput(log_prob, old, torch.randn(4, 3, generator=g), torch.ones(4, 3),
                                 infer_log_probs=old.clone())
        return _loss_and_metrics(target(inputs, AlgorithmConfig()), (4, 3), "per token, [B, R]", log_prob)

    return [("sample batch", run)]


def _kl_checks(target, distribution: bool) -> list[tuple[str, Callable[[], str]]]:
    def run():
        import torch

        g = torch.Generator().manual_seed(0)
        shape = (4, 3, 5) if distribution else (4, 3)
        a = torch.log_softmax(torch.randn(*shape, generator=g), -1)
        b = torch.log_softmax(torch.randn(*shape, generator=g), -1)
        out = target(a, b)
        _expect(isinstance(out, torch.Tensor) and out.shape == (4, 3),
                f"must return [B, R] = [4, 3], got {getattr(out, 'shape', type(out).__name__)}")
        _expect(bool(torch.isfinite(out).all()), "non-finite values")
        return "[4, 3]" + (" from [4, 3, 5] distributions" if distribution else "")

    return [("sample log-probs", run)]


def _preference_checks(target) -> list[tuple[str, Callable[[], str]]]:
    def run():
        import torch

        from roll_core.algorithms.preference import PreferenceInput

        g = torch.Generator().manual_seed(0)
        chosen, rejected = (-5 * torch.rand(4, generator=g)).requires_grad_(), (-5 * torch.rand(4, generator=g))
        inputs = PreferenceInput(chosen, rejected.requires_grad_(), chosen.detach() - 0.1, rejected.detach() + 0.1)
        return _loss_and_metrics(target(inputs, beta=0.1, label_smoothing=0.0), (4,), "per pair, [B]", chosen)

    return [("sample pairs", run)]


def _distill_checks(target) -> list[tuple[str, Callable[[], str]]]:
    def run():
        import torch

        g = torch.Generator().manual_seed(0)
        logits = torch.randn(4, 3, 5, generator=g, requires_grad=True)
        teacher = torch.log_softmax(torch.randn(4, 3, 5, generator=g), -1)
        out = target(torch.log_softmax(logits, -1), teacher)
        _expect(isinstance(out, torch.Tensor) and out.shape == (4, 3),
                f"must return a per-token loss [B, R] = [4, 3], got {getattr(out, 'shape', type(out).__name__)}")
        _expect(bool(torch.isfinite(out).all()), f"non-finite values: {out}")
        _expect(bool((out >= -1e-6).all()), "a divergence cannot be negative")
        out.sum().backward()
        _expect(logits.grad is not None and bool(torch.isfinite(logits.grad).all()),
                "loss does not back-propagate to the student")
        same = target(teacher, teacher)
        _expect(float(same.abs().max()) < 1e-5, "equal distributions must give 0")
        return "[4, 3] from [4, 3, 5] distributions, 0 when equal"

    return [("sample distributions", run)]


def _dataset_checks(target) -> list[tuple[str, Callable[[], str]]]:
    def run():
        source = target({})
        counts = []
        for split in ("train_rows", "eval_rows"):
            _expect(callable(getattr(source, split, None)), f"the dataset has no {split}()")
            rows = getattr(source, split)()
            _expect(isinstance(rows, list), f"{split}() must return a list")
            for row in rows[:50]:
                _expect(isinstance(row, dict) and "prompt" in row and "ground_truth" in row,
                        f"{split}() rows need 'prompt' and 'ground_truth', got {row!r:.120}")
            counts.append(len(rows))
        _expect(counts[0] > 0, "train_rows() is empty")
        return f"{counts[0]} train / {counts[1]} held-out rows"

    return [("default options", run)]


def _env_checks(target) -> list[tuple[str, Callable[[], str]]]:
    from roll_core.envs import Env, Observation, observation_parts
    from roll_core.multimodal import IMAGE_PLACEHOLDER, load_image

    def _is_observation(obs) -> bool:
        return isinstance(obs, (str, Observation))

    def _comparable(obs):
        """An observation as values ``==`` compares: its text and each image's pixels."""
        text, images = observation_parts(obs)
        return text, [load_image(image).tobytes() for image in images]

    def run():
        _expect(isinstance(target, type) and issubclass(target, Env), "must be a subclass of roll_core.envs.Env")
        _expect(not inspect.isabstract(target), f"abstract methods left: {sorted(target.__abstractmethods__)}")
        env = target()
        obs, info = env.reset(seed=0)
        _expect(_is_observation(obs) and isinstance(info, dict), "reset() must return (observation, dict), the "
                                                                 "observation a str or a roll_core.envs.Observation")
        out = env.step("")
        _expect(isinstance(out, tuple) and len(out) == 5, "step() must return 5 values")
        _finite_number(out[1], "step() reward")
        _expect(_is_observation(out[0]) and isinstance(out[4], dict),
                "step() must return (observation, reward, bool, bool, dict)")
        if env.image_observations or isinstance(obs, Observation) or isinstance(out[0], Observation):
            _expect(env.image_observations, "an observation carries images, but the class does not set "
                                            "image_observations = True (the run's checks read it)")
            for o in (obs, out[0]):
                text, images = observation_parts(o)
                _expect(text.count(IMAGE_PLACEHOLDER) == len(images),
                        f"an observation has {len(images)} image(s) and {text.count(IMAGE_PLACEHOLDER)} "
                        f"'{IMAGE_PLACEHOLDER}' placeholder(s); put one where each image goes")
        return "reset and one step"

    def same_seed():
        actions = ["", "L", "D", "R", "U", "1", "left", "a"]
        episodes = []
        for _ in range(2):
            env = target()
            trace = [_comparable(env.reset(seed=1234)[0])]
            for action in actions:
                obs, reward, terminated, truncated, _ = env.step(action)
                trace.append((_comparable(obs), reward, terminated, truncated))
                if terminated or truncated:
                    break
            env.close()
            episodes.append(trace)
        _expect(episodes[0] == episodes[1], "two episodes with seed 1234 and the same actions differ: reset(seed) "
                                            "must make the episode deterministic")
        return f"{len(episodes[0]) - 1} steps replayed identically"

    return [("episode", run), ("determinism under a seed", same_seed)]


def _tracker_checks(target) -> list[tuple[str, Callable[[], str]]]:
    def run():
        with tempfile.TemporaryDirectory() as tmp:
            tracker = target(Path(tmp), None)
            tracker.log({"check/value": 1.0}, 1)
            tracker.close()
        return "logged one step"

    return [("log and close", run)]


def _subclass_checks(target, base_path: str) -> list[tuple[str, Callable[[], str]]]:
    def run():
        from roll_core.registry import import_target

        bases = [import_target(p) for p in base_path.split("|")]
        _expect(isinstance(target, type) and issubclass(target, tuple(bases)),
                f"must subclass {' or '.join(b.__qualname__ for b in bases)}")
        _expect(not inspect.isabstract(target), f"abstract methods left: {sorted(target.__abstractmethods__)}")
        return ""

    return [("interface", run)]


_BASES = {
    "train_strategies": "roll_core.strategy:TrainStrategy",
    "infer_strategies": "roll_core.strategy:InferStrategy",
    "critic_strategies": "roll_core.strategy:CriticStrategy",
    "schedulers": "roll_core.rollout:RolloutScheduler",
    "weight_syncs": "roll_core.runtime.weight_sync:WeightSync",
    "pipelines": "roll_core.pipelines:Pipeline",
}


def _checks_for(registry: str, target, metadata: dict):
    if registry == "rewards":
        return _reward_checks(target)
    if registry == "advantage_estimators":
        return _estimator_checks(target, metadata.get("needs", ()))
    if registry == "policy_losses":
        return _loss_checks(target)
    if registry == "kl_estimators":
        return _kl_checks(target, bool(metadata.get("distribution")))
    if registry == "preference_losses":
        return _preference_checks(target)
    if registry == "distill_losses":
        return _distill_checks(target)
    if registry == "datasets":
        return _dataset_checks(target)
    if registry == "envs":
        return _env_checks(target)
    if registry == "trackers":
        return _tracker_checks(target)
    return _subclass_checks(target, _BASES[registry])


def find_plugins(name: str, plugins) -> list:
    """Plugins called ``name``, or every plugin of the distribution ``name``."""
    found = [p for p in plugins.plugins.values() if p.name == name or p.distribution == name]
    if not found:
        known = sorted({p.name for p in plugins.plugins.values()} | {p.distribution for p in plugins.plugins.values()})
        raise PluginError(f"no installed plugin or distribution '{name}'.{did_you_mean(name, known)} "
                          f"Installed: {', '.join(known)}")
    return found


def check_plugin(name: str, plugins=None) -> ContractReport:
    """Run the contract checks of every component registered by plugin (or distribution) ``name``."""
    from roll_core.plugins import get_plugins

    plugins = plugins or get_plugins()
    report = ContractReport(name)
    for info in find_plugins(name, plugins):
        if info.status != "ok":
            report.results.append(CheckResult(info.name, "loads", "failed", f"{info.status}: {info.error}"))
            continue
        if not info.provides:
            report.results.append(CheckResult(info.name, "registers", "failed", "the plugin registers nothing"))
            continue
        for registry_name, names in info.provides.items():
            registry = plugins.registry(registry_name)
            for item in names:
                component = f"{registry_name}:{item}"
                missing = registry.entry(item).missing_packages()
                if missing:  # an optional service or engine not installed here: nothing to check it with
                    report.results += [CheckResult(component, "requires", "skipped", f"skipped: needs the '{module}' "
                                                   f"package, not installed here: {hint}")
                                       for module, hint in missing.items()]
                    continue
                try:
                    target = registry.get(item)
                except Exception as exc:
                    report.results.append(CheckResult(component, "import", "failed", str(exc)))
                    continue
                for check, fn in _checks_for(registry_name, target, registry.entry(item).metadata):
                    try:
                        detail = fn()
                        status = "skipped" if detail.startswith("skipped") else "ok"
                        report.results.append(CheckResult(component, check, status, detail))
                    except _Fail as exc:
                        report.results.append(CheckResult(component, check, "failed", str(exc)))
                        break
                    except Exception as exc:
                        report.results.append(CheckResult(component, check, "failed",
                                                          f"raised {type(exc).__name__}: {exc}"))
                        break
    return report
