"""The example environment keeps roll's contract, and its expert finds any number in log2 steps."""

import subprocess
import sys

from roll_guess_number.env import GuessNumber


def test_hints_narrow_the_interval_and_the_right_guess_wins():
    env = GuessNumber(high=16)
    env.reset(seed=3)
    secret = env.secret
    assert env.step("I say 1")[0] == ("higher" if secret > 1 else "yes")
    assert env.step("no idea") == ("a number?", -0.1, False, False, env._info(False))


def test_the_expert_always_wins_within_max_steps():
    for seed in range(50):
        env = GuessNumber(high=16, max_steps=5)
        env.reset(seed=seed)
        for _ in range(5):
            _, reward, terminated, truncated, info = env.step(env.expert_action())
            if terminated or truncated:
                break
        assert info["success"] and reward == 1.0


def test_roll_finds_and_checks_the_installed_plugin():
    listed = subprocess.run([sys.executable, "-m", "roll_core.cli", "list-plugins"], capture_output=True, text=True)
    assert "guess_number" in listed.stdout
    checked = subprocess.run([sys.executable, "-m", "roll_core.cli", "check-plugin", "roll-guess-number"],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
