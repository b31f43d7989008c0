"""Guess the number: the seed hides a number in 1..high; each reply guesses one, and the
environment answers "higher", "lower" or ends the episode with reward 1.

The contract roll checks (``roll check-plugin roll-guess-number``): ``reset(seed)`` makes the
episode deterministic, ``step`` returns ``(observation, reward, terminated, truncated, info)``,
and ``info`` carries ``success`` and ``state_hash`` (here the interval still possible: two
episodes in the same interval are in the same state, which GiGPO's step groups use).
"""

from __future__ import annotations

import random
import re

from roll_core.envs import Env


class GuessNumber(Env):
    def __init__(self, high: int = 16, max_steps: int = 6, invalid_action_penalty: float = -0.1):
        if high < 2:
            raise ValueError(f"high must be at least 2, got {high}")
        self.high, self.max_steps, self.invalid_action_penalty = high, max_steps, invalid_action_penalty
        # every possible guess: a random policy and the warm-up's careless teacher draw from them
        self.actions = tuple(str(n) for n in range(1, high + 1))
        self.secret = self.low = self.top = self.steps = 0

    def reset(self, seed=None):
        self.secret = random.Random(seed).randint(1, self.high)
        self.low, self.top, self.steps = 1, self.high, 0
        return f"guess 1-{self.high}", self._info(False)

    def step(self, action):
        self.steps += 1
        out_of_time = self.steps >= self.max_steps
        found = re.search(r"\d+", action)
        if found is None:  # a reply with no number: the documented penalty, nothing learned
            return "a number?", self.invalid_action_penalty, False, out_of_time, self._info(False)
        guess = int(found.group())
        if guess == self.secret:
            return "yes", 1.0, True, False, self._info(True)
        if guess < self.secret:
            self.low = max(self.low, guess + 1)
            return "higher", 0.0, False, out_of_time, self._info(False)
        self.top = min(self.top, guess - 1)
        return "lower", 0.0, False, out_of_time, self._info(False)

    def expert_action(self):
        """Binary search: the middle of what is still possible (the warm-up's teacher follows it)."""
        return str((self.low + self.top) // 2)

    def _info(self, success):
        return {"success": success, "state_hash": self.low * 1000 + self.top}
