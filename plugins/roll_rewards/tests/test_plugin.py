"""The installed plugin is discovered through its entry point, listed, and usable by name."""

import json
import os
import subprocess
import sys


def roll(*args):
    return subprocess.run([sys.executable, "-m", "roll_core.cli", *args], capture_output=True, text=True, timeout=120)


def test_listed_with_its_rewards():
    out = roll("list-plugins", "--json")
    assert out.returncode == 0, out.stderr
    plugins = {p["name"]: p for p in json.loads(out.stdout)["plugins"]}
    mine = plugins["rewards"]
    assert mine["distribution"] == "roll-rewards" and mine["status"] == "ok"
    assert mine["provides"] == {"rewards": [
        "code", "ifeval", "llm_judge", "math_verify", "multiple_choice", "reward_model", "shaped", "trl_function",
        "verl_compute_score"]}


def test_listing_does_not_import_sympy_math_verify_httpx_or_the_reward_model():
    code = ("import sys; from roll_core.plugins import get_plugins; assert 'code' in get_plugins().rewards; "
            "print([m for m in ('sympy', 'math_verify', 'roll_rewards.sandbox', 'httpx', 'roll_rewards.reward_model') "
            "if m in sys.modules])")
    # GEM (roll-envs[gem]), when installed, imports sympy itself while it lists its environments
    env = {**os.environ, "ROLL_DISABLE_PLUGINS": "gem"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_config_selects_the_reward_by_name(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("roles:\n  reward:\n    name: math_verify\n    options: {timeout_seconds: 3}\n")
    out = roll("validate", str(cfg))
    assert out.returncode == 0, out.stderr
    out = roll("validate", str(cfg), "roles.reward.name=math_verfy")
    assert out.returncode == 2 and "Did you mean 'math_verify'?" in out.stderr
