"""Grid worlds drawn as pictures, for image-text models (``observation: image``).

FrozenLake and Sokoban render their state as rows of characters; :class:`Picture` draws such rows
with one colour per character, ``cell_pixels`` square pixels a cell, as an ``[H, W, 3]`` uint8
image (what :class:`roll_core.envs.Observation` takes). With ``view_radius`` r the picture is the
agent's own view: the (2r+1) x (2r+1) cells around it, the agent in the middle and black past the
grid's edge. Visual agents usually see grid worlds that way: what lies next to the agent is always
at the same place in the picture, which small models learn to read far sooner than a whole map
(docs/vlm.md measures it on FrozenLake). At 4 pixels a cell, one cell is one image patch of the
embedded image-text model (``model.tiny.vision``, 4-pixel patches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

OBSERVATIONS = ("text", "image")
EDGE = (0, 0, 0)  # past the grid's edge, in an agent's view


@dataclass(frozen=True)
class Picture:
    """How an environment draws its grid: ``cell_pixels`` a cell, the whole grid or ``view_radius``."""

    cell_pixels: int = 4
    view_radius: int | None = None

    @classmethod
    def from_options(cls, observation: str, cell_pixels: int, view_radius: int | None) -> Picture | None:
        """The picture an environment's options ask for, or None for text observations; bad values are
        a ``ValueError`` naming the option (the config's checks report it)."""
        if observation not in OBSERVATIONS:
            raise ValueError(f"observation must be one of {', '.join(OBSERVATIONS)}, got {observation!r}")
        if cell_pixels < 1:
            raise ValueError(f"cell_pixels must be at least 1, got {cell_pixels}")
        if view_radius is not None and view_radius < 1:
            raise ValueError(f"view_radius must be at least 1 (or None: the whole grid), got {view_radius}")
        return cls(cell_pixels, view_radius) if observation == "image" else None

    def draw(self, rows: Sequence[str], colors: Mapping[str, tuple[int, int, int]],
             agent: tuple[int, int]) -> np.ndarray:
        """``rows`` (one character a cell) in ``colors``; the agent's cell ``(row, column)`` centres a view."""
        height, width = len(rows), len(rows[0])
        if self.view_radius is None:
            ys, xs = range(height), range(width)
        else:
            ys, xs = (range(a - self.view_radius, a + self.view_radius + 1) for a in agent)
        cells = np.array([[colors[rows[y][x]] if 0 <= y < height and 0 <= x < width else EDGE for x in xs]
                          for y in ys], dtype=np.uint8)
        return np.repeat(np.repeat(cells, self.cell_pixels, axis=0), self.cell_pixels, axis=1)
