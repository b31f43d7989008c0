"""Sokoban as text: push every box onto a target.

Each seed generates its own room, solvable by construction: boxes start on their targets and the
player pulls them away in reverse (a random walk of ``pull_steps`` moves), so pushing them back
solves it. Held-out seeds are held-out rooms.

* **Observation**: the room, rows joined by ``|``, in Sokoban's usual characters: ``#`` wall, ``_``
  floor, ``.`` target, ``$`` box, ``*`` box on a target, ``@`` the player, ``+`` the player on a
  target, e.g. ``######|#_@__#|#_$._#|######``.
* **As an image** (``observation: image``, for image-text models): the room drawn with
  ``cell_pixels`` pixels a cell (walls grey, floor light grey, targets pink, boxes brown, a box on a
  target green, the player blue, on a target purple), or with ``view_radius`` the player's own view
  (:mod:`roll_envs.pictures`), and the text ``<image>``: an :class:`~roll_core.envs.Observation`.
* **Action**: the first move of the reply, as FrozenLake reads it (``L``/``D``/``R``/``U`` or
  ``left``/``down``/``right``/``up``). Walking into a wall, or pushing a box into a wall or
  another box, leaves the room as it was.
* **Rewards** (the gym-sokoban convention ROLL uses): -0.1 per step, +1 for a box pushed onto a
  target, -1 for one pushed off, +10 when every box is on a target (``terminated``, ``success``).
  A reply with no move costs ``invalid_action_penalty`` (-0.1) on top of the step.
* ``truncated`` after ``max_steps`` replies. ``info``: ``success``, ``state_hash`` (the room's CRC).
* **Expert** (``expert_action``): the first move of a shortest solution (breadth-first search over
  player and box positions), for the warm-up's teacher.
"""

from __future__ import annotations

import random
import zlib
from collections import deque
from typing import Any

import numpy as np

from roll_core.envs import Env, Observation
from roll_envs.frozen_lake import MOVES, parse_action
from roll_envs.pictures import Picture

_DELTAS = {0: (0, -1), 1: (1, 0), 2: (0, 1), 3: (-1, 0)}  # gymnasium's order: left, down, right, up
_LETTERS = {v: k for k, v in MOVES.items()}
# RGB of each character of render() in image observations
COLORS = {"#": (110, 110, 110), "_": (225, 225, 225), ".": (250, 170, 190), "$": (150, 95, 40),
          "*": (40, 170, 70), "@": (40, 80, 230), "+": (140, 60, 220)}


class Sokoban(Env):
    actions = tuple(MOVES)

    def __init__(self, size: int = 6, num_boxes: int = 1, pull_steps: int = 12, max_steps: int = 20,
                 invalid_action_penalty: float = -0.1, observation: str = "text", cell_pixels: int = 4,
                 view_radius: int | None = None):
        if size < 4:
            raise ValueError(f"size must be at least 4 (walls around a 2x2 floor), got {size}")
        if not 1 <= num_boxes <= (size - 2) ** 2 // 3:
            raise ValueError(f"num_boxes must be in 1..{(size - 2) ** 2 // 3} for size {size}, got {num_boxes}")
        if pull_steps < 1 or max_steps < 1:
            raise ValueError("pull_steps and max_steps must be at least 1")
        self.picture = Picture.from_options(observation, cell_pixels, view_radius)
        self.image_observations = self.picture is not None
        self.size, self.num_boxes, self.pull_steps = size, num_boxes, pull_steps
        self.max_steps, self.invalid_action_penalty = max_steps, invalid_action_penalty
        self.walls: set[tuple[int, int]] = set()
        self.targets: frozenset[tuple[int, int]] = frozenset()
        self.boxes: frozenset[tuple[int, int]] = frozenset()
        self.player = (0, 0)
        self._steps = 0

    # -- the room ---------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> tuple[str | Observation, dict[str, Any]]:
        rng = random.Random(seed)
        n = self.size
        while True:  # rooms where the reverse walk left every box on its target are drawn again
            self.walls = {(r, c) for r in range(n) for c in range(n) if r in (0, n - 1) or c in (0, n - 1)}
            inner = [(r, c) for r in range(1, n - 1) for c in range(1, n - 1)]
            for cell in rng.sample(inner, rng.randint(0, max(0, len(inner) // 6))):
                self.walls.add(cell)  # a few inner walls
            free = [cell for cell in inner if cell not in self.walls]
            if len(free) < self.num_boxes + 2:
                continue
            picked = rng.sample(free, self.num_boxes + 1)
            self.targets = frozenset(picked[:-1])
            self.boxes, self.player = self.targets, picked[-1]
            for _ in range(self.pull_steps):
                self._pull(rng.randrange(4))
            if self.boxes != self.targets and self._solution_length() is not None:
                break
        self._steps = 0
        return self._observation(), self._info()

    def _pull(self, move: int) -> None:
        """Reverse play: the player steps away from a box behind it and drags it along."""
        dr, dc = _DELTAS[move]
        r, c = self.player
        ahead, behind = (r + dr, c + dc), (r - dr, c - dc)
        if ahead in self.walls or ahead in self.boxes:
            return
        if behind in self.boxes:
            self.boxes = (self.boxes - {behind}) | {(r, c)}
        self.player = ahead

    def _push(self, player, boxes, move: int):
        """The state after ``move`` from (player, boxes), or None when nothing moves."""
        dr, dc = _DELTAS[move]
        ahead = (player[0] + dr, player[1] + dc)
        if ahead in self.walls:
            return None
        if ahead in boxes:
            beyond = (ahead[0] + dr, ahead[1] + dc)
            if beyond in self.walls or beyond in boxes:
                return None
            return ahead, (boxes - {ahead}) | {beyond}
        return ahead, boxes

    def _solution_length(self) -> int | None:
        path = self._solve()
        return None if path is None else len(path)

    def _solve(self) -> list[int] | None:
        """A shortest list of moves that puts every box on a target (breadth-first search)."""
        start = (self.player, self.boxes)
        first: dict = {start: []}
        queue = deque([start])
        while queue:
            state = queue.popleft()
            if state[1] == self.targets:
                return first[state]
            for move in range(4):
                nxt = self._push(*state, move)
                if nxt is not None and nxt not in first:
                    first[nxt] = first[state] + [move]
                    queue.append(nxt)
        return None

    # -- the Env interface ------------------------------------------------------------------------
    def step(self, action: str) -> tuple[str | Observation, float, bool, bool, dict[str, Any]]:
        if not self.targets:
            raise RuntimeError("step() before reset()")
        self._steps += 1
        out_of_steps = self._steps >= self.max_steps
        move = parse_action(action)
        if move is None:
            return self._observation(), -0.1 + self.invalid_action_penalty, False, out_of_steps, \
                self._info(invalid=True)
        reward = -0.1
        after = self._push(self.player, self.boxes, move)
        if after is not None:
            on_before = len(self.boxes & self.targets)
            self.player, self.boxes = after
            reward += len(self.boxes & self.targets) - on_before
        solved = self.boxes == self.targets
        if solved:
            reward += 10.0
        return self._observation(), reward, solved, out_of_steps and not solved, self._info()

    def expert_action(self) -> str | None:
        path = self._solve() if self.targets else None
        return _LETTERS[path[0]] if path else None

    def _observation(self) -> str | Observation:
        return self.render() if self.picture is None else Observation("<image>", [self.render_image()])

    def render_image(self) -> np.ndarray:
        """The room, or the player's view, as an ``[H, W, 3]`` uint8 image (:mod:`roll_envs.pictures`)."""
        return (self.picture or Picture()).draw(self.render().split("|"), COLORS, self.player)

    def render(self) -> str:
        rows = []
        for r in range(self.size):
            row = ""
            for c in range(self.size):
                cell, target = (r, c), (r, c) in self.targets
                if cell in self.walls:
                    row += "#"
                elif cell == self.player:
                    row += "+" if target else "@"
                elif cell in self.boxes:
                    row += "*" if target else "$"
                else:
                    row += "." if target else "_"
            rows.append(row)
        return "|".join(rows)

    def _info(self, invalid: bool = False) -> dict[str, Any]:
        return {"success": self.boxes == self.targets, "state_hash": zlib.crc32(self.render().encode()),
                "invalid_action": invalid}
