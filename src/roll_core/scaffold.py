"""``roll plugin new KIND NAME``: a third-party plugin package to start from.

Writes ``roll-NAME/`` with a ``pyproject.toml`` whose ``[project.entry-points.roll]`` line makes it
a plugin, ``src/roll_NAME/plugin.py`` (registration only, a lazy target), the component itself
(a working skeleton that passes ``roll check-plugin`` unchanged), tests written with roll's pytest
fixtures and a README. KIND is one of :data:`KINDS`. Then::

    pip install -e roll-NAME[test] && pytest roll-NAME/tests && roll check-plugin NAME

``nox -s scaffolds`` does exactly that for every kind. The skeletons follow the hook specs in
:mod:`roll_core.hookspecs` and the example packages under ``examples/``.
"""

from __future__ import annotations

import keyword
import re
import shutil
from pathlib import Path
from string import Template

from roll_core.errors import RollError

# kind -> (hook, module file, registered target attribute, what the skeleton does)
KINDS: dict[str, tuple[str, str, str, str]] = {
    "reward": ("roll_register_rewards", "reward", "Reward", "1.0 when the response equals the ground truth"),
    "env": ("roll_register_envs", "env", "Env", "count up from a seeded start, one number per turn"),
    "estimator": ("roll_register_advantage_estimators", "estimator", "advantage",
                  "score minus the group's mean score (no std division)"),
    "loss": ("roll_register_policy_losses", "loss", "loss", "REINFORCE: -advantage * log-prob"),
    "tracker": ("roll_register_trackers", "tracker", "Tracker", "every step's metrics appended to metrics.csv"),
}

_PYPROJECT = '''[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "roll-$dash"
version = "0.1.0"
description = "A roll $kind plugin: $what"
requires-python = ">=3.10"
dependencies = ["roll-core"]

# The line that makes this a roll plugin: roll imports this module and calls its hooks.
[project.entry-points.roll]
$name = "$package.plugin"

[project.optional-dependencies]
test = ["pytest>=8"]

[tool.setuptools.packages.find]
where = ["src"]
'''

_PLUGIN = '''"""Registration only: the target is a lazy "module:attribute" string, so `roll list-plugins`
lists it without importing $package.$module."""

from roll_core import hookimpl


@hookimpl
def $hook(register):
    register("$name", "$package.$module:$target", description="$what")
'''

_README = '''# roll-$dash

A roll $kind plugin, `$name`: $what.

```bash
pip install -e ".[test]"
roll list-plugins -v          # shows $name with its description
roll check-plugin $name       # the contract checks roll runs on every $kind
pytest tests
```

$usage

Edit `src/$package/$module.py`; `src/$package/plugin.py` registers it, and the
`[project.entry-points.roll]` line of `pyproject.toml` is how roll finds the package.
'''

_USAGE = {
    "reward": "Use it with `roll run roles.reward.name=$name`.",
    "env": "Play it with `roll play $name --policy random --actions 1,2,3`, and train on it with "
           "`roll run pipeline=agentic agentic.env=$name warmup.steps=0`.",
    "estimator": "Use it with `roll run algorithm.advantage_estimator=$name`.",
    "loss": "Use it with `roll run algorithm.policy_loss=$name`.",
    "tracker": "Use it with `roll run 'trackers=[stdout, $name]'`.",
}

_SOURCES = {
    "reward": '''"""$what."""

from roll_core.rewards import Reward, RewardInput


class $cls(Reward):
    """Options come from `roles.reward.options` as keyword arguments."""

    # lightweight = True  # for a quick, pure check like this one: it then scores in the driver process

    def __init__(self, case_sensitive: bool = True):
        self.case_sensitive = case_sensitive

    def _norm(self, text) -> str:
        text = str(text).strip()
        return text if self.case_sensitive else text.lower()

    def score(self, sample: RewardInput) -> float:
        return float(self._norm(sample.response) == self._norm(sample.ground_truth))

    @classmethod
    def contract_examples(cls):
        """What `roll check-plugin` scores: (options, sample, expected score)."""
        return [({}, RewardInput("2+2=", " 4", "4"), 1.0), ({}, RewardInput("2+2=", "5", "4"), 0.0),
                ({"case_sensitive": False}, RewardInput("Capital?", "paris", "Paris"), 1.0)]
''',
    "env": '''"""$what: the observation is the last number, the right action the next one."""

import random

from roll_core.envs import Env


class $cls(Env):
    """Options come from `agentic.env_options` as keyword arguments."""

    actions = tuple(str(n) for n in range(1, 10))

    def __init__(self, length: int = 3, invalid_action_penalty: float = -0.1):
        if length < 1:
            raise ValueError(f"length must be at least 1, got {length}")
        self.length, self.invalid_action_penalty = length, invalid_action_penalty
        self.current, self.left = 0, 0

    def reset(self, seed=None):
        self.current = random.Random(seed).randint(1, 9 - self.length) if self.length < 9 else 0
        self.left = self.length
        return str(self.current), {"state_hash": self.current}

    def step(self, action):
        text = action.strip()
        if not text.isdigit():  # unparseable: the documented penalty, the episode goes on
            return str(self.current), self.invalid_action_penalty, False, False, {"state_hash": self.current}
        if int(text) != self.current + 1:
            return str(self.current), 0.0, True, False, {"success": False, "state_hash": self.current}
        self.current, self.left = self.current + 1, self.left - 1
        done = self.left == 0
        return str(self.current), 1.0, done, False, {"success": done, "state_hash": self.current}

    def expert_action(self):
        return str(self.current + 1)
''',
    "estimator": '''"""$what.

    A_i = score_i - mean_{j in group(i)} score_j

Shapes: `token_level_rewards`, `response_mask` [B, R]; `group_index` [B]; returns [B, R] twice."""

import torch

from roll_core.algorithms.advantages import AdvantageInput, group_stats


def advantage(batch: AdvantageInput, config) -> tuple[torch.Tensor, torch.Tensor]:
    scores = (batch.token_level_rewards * batch.response_mask).sum(-1)
    mean, _, n = group_stats(scores, batch.group_index)
    adv = torch.where(n > 1, scores - mean, torch.zeros_like(scores))  # a group of one has no baseline
    tokens = adv[:, None] * batch.response_mask
    return tokens, tokens
''',
    "loss": '''"""$what.

    loss_t = -A_t * log pi(y_t)

Per token, [B, R]; roll aggregates it by `algorithm.loss_agg_mode`."""

import torch

from roll_core.algorithms.losses import PolicyLossInput


def loss(inputs: PolicyLossInput, config) -> tuple[torch.Tensor, dict[str, float]]:
    mask = inputs.response_mask
    log_ratio = (inputs.log_prob - inputs.old_log_prob).detach()
    drift = float((log_ratio.abs() * mask).sum() / mask.sum().clamp(min=1))
    return -inputs.advantages * inputs.log_prob, {"loss/log_ratio_abs": drift}
''',
    "tracker": '''"""$what (one row per step; a new metric name starts a new header block)."""

import csv

from roll_core.trackers import Tracker


class $cls(Tracker):
    """Built as cls(run_dir, config); run_dir exists."""

    def __init__(self, run_dir, config=None):
        super().__init__(run_dir, config)
        self._file = open(self.run_dir / "metrics.csv", "a", newline="")
        self._writer = csv.writer(self._file)
        self._header: list[str] = []

    def log(self, metrics, step):
        names = sorted(metrics)
        if names != self._header:
            self._header = names
            self._writer.writerow(["step", *names])
        self._writer.writerow([step, *(metrics[n] for n in names)])
        self._file.flush()

    def close(self):
        self._file.close()
''',
}

_TESTS = {
    "reward": '''    from $package.$module import $cls
    from roll_core.rewards import RewardInput

    assert $cls().score(RewardInput("p", " 12 ", "12")) == 1.0
    assert $cls().score(RewardInput("p", "13", "12")) == 0.0
''',
    "env": '''    from $package.$module import $cls

    env = $cls(length=2)
    observation, _ = env.reset(seed=0)
    start = int(observation)
    assert env.step("x")[1] == -0.1  # unparseable: the penalty, the episode goes on
    _, reward, done, _, info = env.step(str(start + 1))
    assert reward == 1.0 and not done
    _, reward, done, _, info = env.step(env.expert_action())
    assert reward == 1.0 and done and info["success"]
''',
    "estimator": '''    import torch

    from $package.$module import advantage
    from roll_core.algorithms.advantages import AdvantageInput

    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 2.0]])
    adv, _ = advantage(AdvantageInput(rewards, torch.ones(3, 2), torch.tensor([0, 0, 1])), None)
    assert adv.tolist() == [[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0]]  # the group of one gets 0
''',
    "loss": '''    import torch

    from $package.$module import loss
    from roll_core.algorithms.losses import PolicyLossInput

    log_prob = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    value, metrics = loss(PolicyLossInput(log_prob, log_prob.detach(), torch.tensor([[1.0, -1.0]]),
                                          torch.ones(1, 2)), None)
    assert value.tolist() == [[1.0, -2.0]] and metrics["loss/log_ratio_abs"] == 0.0
''',
    "tracker": '''    from $package.$module import $cls

    tracker = $cls(tmp_path)
    tracker.log({"reward/mean": 0.5}, 1)
    tracker.log({"reward/mean": 0.75}, 2)
    tracker.close()
    assert (tmp_path / "metrics.csv").read_text().splitlines() == ["step,reward/mean", "1,0.5", "2,0.75"]
''',
}

_TEST_FILE = '''"""Tests of $name, with the fixtures roll-core gives plugin authors (`roll_plugins`, `tiny_config`)."""


def test_$name(tmp_path):
$body

def test_registered_through_the_installed_entry_point(roll_plugins):
    plugins = roll_plugins()
    assert plugins.registry("$registry").entry("$name").plugin == "$name"


def test_contract_checks_pass(roll_plugins):
    from roll_core.contracts import check_plugin

    report = check_plugin("$name", roll_plugins())
    assert report.ok, report.failures()
'''

_REGISTRY = {"reward": "rewards", "env": "envs", "estimator": "advantage_estimators", "loss": "policy_losses",
             "tracker": "trackers"}


def new_plugin(kind: str, name: str, directory: Path) -> Path:
    """Write the package for a ``kind`` plugin registering ``name`` under ``directory``; its root."""
    if kind not in KINDS:
        raise RollError(f"unknown plugin kind '{kind}'; kinds: {', '.join(KINDS)}")
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise RollError(f"plugin name '{name}' must be a lowercase Python identifier (letters, digits, _)")
    hook, module, target, what = KINDS[kind]
    cls = "".join(part.capitalize() for part in name.split("_"))
    target = cls if target in ("Reward", "Env", "Tracker") else target
    values = {"name": name, "dash": name.replace("_", "-"), "package": f"roll_{name}", "kind": kind, "hook": hook,
              "module": module, "target": target, "cls": cls, "what": what, "registry": _REGISTRY[kind]}
    values["usage"] = Template(_USAGE[kind]).substitute(values)
    values["body"] = Template(_TESTS[kind]).substitute(values)
    root = Path(directory) / f"roll-{values['dash']}"
    if root.exists():
        raise RollError(f"{root} exists already; choose another name or directory")
    files = {
        "pyproject.toml": _PYPROJECT,
        "README.md": _README,
        f"src/roll_{name}/__init__.py": '"""$what."""\n',
        f"src/roll_{name}/plugin.py": _PLUGIN,
        f"src/roll_{name}/{module}.py": _SOURCES[kind],
        f"tests/test_{name}.py": _TEST_FILE,
    }
    partial = root.with_name(root.name + ".partial")  # written whole, then renamed: never half a package
    try:
        shutil.rmtree(partial, ignore_errors=True)
        for relative, template in files.items():
            path = partial / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(Template(template).substitute(values))
        partial.rename(root)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise RollError(f"cannot write the package at {root}: {exc.strerror or exc}") from None
    return root
