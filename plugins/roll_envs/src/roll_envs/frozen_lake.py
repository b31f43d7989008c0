"""FrozenLake as a text environment, on gymnasium's own implementation.

The agent walks a square of frozen tiles from the start to the goal without stepping into a hole.
Each seed draws its own map (gymnasium's ``generate_random_map``, always solvable), so held-out
seeds are held-out maps. Dynamics, rewards and termination are gymnasium's ``FrozenLakeEnv``; this
class only turns its state into text and text into its actions.

* **Observation**: the map, rows joined by ``|``, the agent's tile shown as ``P``: ``P_O_|____|...``
  (``_`` frozen, ``O`` hole, ``G`` goal; a character set every tokenizer has, the embedded one too).
  With ``show_neighbors``, ``:`` and the four tiles around the agent follow, left, down, right, up
  (``#``: the edge), e.g. ``P_O_|____|...:#_O#``: a view small models read more easily than the map.
* **As an image** (``observation: image``, for image-text models): the map drawn with
  ``cell_pixels`` pixels a tile (frozen light blue, holes dark blue, the goal gold, the agent red),
  or with ``view_radius`` the agent's own view (:mod:`roll_envs.pictures`), and the text
  ``<image>`` (the neighbours' ``:....`` after it with ``show_neighbors``): an
  :class:`~roll_core.envs.Observation`. At 4 pixels a tile, a 4x4 map is a 16x16 image and a view
  of radius 1 a 12x12 one, one patch per tile for the embedded image-text model.
* **Action**: the first word of the text that is one of ``L``, ``D``, ``R``, ``U`` or ``left``,
  ``down``, ``right``, ``up``, case-insensitive (``"I go left"`` is left; ``"refuse"`` is no move).
* **Bad action** (text with no move in it): the documented penalty ``invalid_action_penalty``
  (default -0.1) as the step's reward; the agent stays put and the step counts toward ``max_steps``.
* **Reward**: 1 on reaching the goal, 0 otherwise (gymnasium's schedule). ``terminated`` on a hole
  or the goal; ``truncated`` after ``max_steps`` moves.
* **Expert** (``expert_action``): the first move of a shortest path to the goal over frozen tiles
  (breadth-first search on the map), for the warm-up's teacher; ``actions`` are ``L``, ``D``, ``R``, ``U``.
* **info**: ``success`` (the goal was reached) and ``state_hash`` (a stable hash of the map and the
  agent's tile: GiGPO's step groups).
"""

from __future__ import annotations

import re
import zlib
from collections import deque
from typing import Any

import numpy as np

from roll_core.envs import Env, Observation
from roll_envs.pictures import Picture

MOVES = {"L": 0, "D": 1, "R": 2, "U": 3}
_WORDS = {"LEFT": "L", "DOWN": "D", "RIGHT": "R", "UP": "U"}
_TILES = {"S": "_", "F": "_", "H": "O", "G": "G"}
_STEPS = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}
# RGB of each character of render() in image observations: frozen, hole, goal, the agent
COLORS = {"_": (200, 230, 255), "O": (20, 40, 120), "G": (255, 200, 0), "P": (230, 30, 30)}


def parse_action(text: str) -> int | None:
    """gymnasium's action for the first move named in ``text`` (a letter or a word), or None."""
    for token in re.findall(r"[A-Za-z]+", text):
        word = token.upper()
        if word in _WORDS:
            return MOVES[_WORDS[word]]
        if word in MOVES:  # a single letter; other words ("refuse") name no move
            return MOVES[word]
    return None


class FrozenLake(Env):
    actions = tuple(MOVES)

    def __init__(self, size: int = 4, frozen_fraction: float = 0.8, is_slippery: bool = False,
                 max_steps: int = 10, invalid_action_penalty: float = -0.1, show_neighbors: bool = False,
                 observation: str = "text", cell_pixels: int = 4, view_radius: int | None = None):
        if size < 2:
            raise ValueError(f"size must be at least 2, got {size}")
        if not 0 < frozen_fraction <= 1:
            raise ValueError(f"frozen_fraction must be in (0, 1], got {frozen_fraction}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        self.picture = Picture.from_options(observation, cell_pixels, view_radius)
        self.image_observations = self.picture is not None
        self.size, self.frozen_fraction, self.is_slippery = size, frozen_fraction, is_slippery
        self.max_steps, self.invalid_action_penalty = max_steps, invalid_action_penalty
        self.show_neighbors = show_neighbors
        self._env: Any = None
        self._map: list[str] = []
        self._position, self._steps = 0, 0

    def reset(self, seed: int | None = None) -> tuple[str | Observation, dict[str, Any]]:
        from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv, generate_random_map

        self._map = generate_random_map(self.size, self.frozen_fraction, seed=seed)
        self._env = FrozenLakeEnv(desc=self._map, is_slippery=self.is_slippery)
        self._position, _ = self._env.reset(seed=seed)
        self._steps = 0
        return self._observation(), self._info(success=False)

    def step(self, action: str) -> tuple[str | Observation, float, bool, bool, dict[str, Any]]:
        if self._env is None:
            raise RuntimeError("step() before reset()")
        self._steps += 1
        move = parse_action(action)
        if move is None:
            return self._observation(), self.invalid_action_penalty, False, self._steps >= self.max_steps, \
                self._info(success=False, invalid_action=True)
        self._position, reward, terminated, _, _ = self._env.step(move)
        success = self._tile() == "G"
        return self._observation(), float(reward), bool(terminated), not terminated and self._steps >= self.max_steps, \
            self._info(success=success)

    def expert_action(self) -> str | None:
        """The first move of a shortest path to the goal that avoids holes (None: no path, or no episode)."""
        if self._env is None:
            return None
        n = self.size
        start = divmod(self._position, n)
        first: dict[tuple[int, int], str | None] = {start: None}
        queue = deque([start])
        while queue:
            r, c = queue.popleft()
            if self._map[r][c] == "G":
                return first[(r, c)]
            if self._map[r][c] == "H":
                continue
            for move, (dr, dc) in _STEPS.items():
                nxt = (r + dr, c + dc)
                if 0 <= nxt[0] < n and 0 <= nxt[1] < n and nxt not in first:
                    first[nxt] = first[(r, c)] or move
                    queue.append(nxt)
        return None

    def _observation(self) -> str | Observation:
        if self.picture is None:
            return self.render()
        tiles, _, neighbors = self.render().partition(":")  # neighbors: empty without show_neighbors
        return Observation("<image>" + (":" + neighbors if neighbors else ""), [self._draw(tiles)])

    def render_image(self) -> np.ndarray:
        """The map, or the agent's view, as an ``[H, W, 3]`` uint8 image (:mod:`roll_envs.pictures`)."""
        return self._draw(self.render().partition(":")[0])

    def _draw(self, tiles: str) -> np.ndarray:
        """``tiles`` (:meth:`render`'s map, rows joined by ``|``) drawn as :meth:`render_image` says."""
        picture = self.picture or Picture()
        return picture.draw(tiles.split("|"), COLORS, divmod(self._position, self.size))

    def render(self) -> str:
        rows = []
        for r, row in enumerate(self._map):
            rows.append("".join("P" if r * self.size + c == self._position else _TILES[t] for c, t in enumerate(row)))
        text = "|".join(rows)
        if self.show_neighbors:
            r, c = divmod(self._position, self.size)
            around = [(r + dr, c + dc) for dr, dc in _STEPS.values()]
            text += ":" + "".join(_TILES[self._map[y][x]] if 0 <= y < self.size and 0 <= x < self.size else "#"
                                  for y, x in around)
        return text

    def _tile(self) -> str:
        return self._map[self._position // self.size][self._position % self.size]

    def _info(self, success: bool, invalid_action: bool = False) -> dict[str, Any]:
        state = zlib.crc32(f"{''.join(self._map)}:{self._position}".encode())
        return {"success": success, "state_hash": state, "invalid_action": invalid_action}

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
