"""Grid worlds as pictures (``observation: image``, :mod:`roll_envs.pictures`): FrozenLake's map and
Sokoban's room drawn one square a cell in their documented colours, the agent's own view with black
past the edge, and the options' checks."""

from __future__ import annotations

import numpy as np
import pytest

from roll_core.envs import Observation, observation_parts
from roll_envs.frozen_lake import COLORS as LAKE, FrozenLake
from roll_envs.pictures import EDGE, Picture
from roll_envs.sokoban import COLORS as ROOM, Sokoban


def _cells(image: np.ndarray, pixels: int) -> list[list[tuple]]:
    """The colour of each cell of ``image``, checking every cell is one colour throughout."""
    rows = []
    for y in range(0, image.shape[0], pixels):
        row = []
        for x in range(0, image.shape[1], pixels):
            block = image[y:y + pixels, x:x + pixels].reshape(-1, 3)
            assert (block == block[0]).all(), (y, x)
            row.append(tuple(int(v) for v in block[0]))
        rows.append(row)
    return rows


def test_frozen_lake_draws_its_map_one_square_per_tile_with_the_agent_in_red():
    env = FrozenLake(size=4, observation="image", cell_pixels=2)
    assert env.image_observations and not FrozenLake().image_observations
    observation, _ = env.reset(seed=3)
    text, (image,) = observation_parts(observation)
    assert text == "<image>" and image.shape == (8, 8, 3) and image.dtype == np.uint8
    assert LAKE == {"P": (230, 30, 30), "_": (200, 230, 255), "O": (20, 40, 120), "G": (255, 200, 0)}
    assert _cells(image, 2) == [[LAKE[tile] for tile in row] for row in env.render().split("|")]
    moved, *_ = env.step("R")
    assert _cells(observation_parts(moved)[1][0], 2)[0][:2] == [LAKE["_"], LAKE["P"]]  # the agent went right
    with_neighbors = FrozenLake(observation="image", show_neighbors=True)
    assert with_neighbors.reset(seed=3)[0].text == "<image>:" + with_neighbors.render().split(":")[1]


def test_a_view_radius_shows_the_cells_around_the_agent_with_black_past_the_edge():
    env = FrozenLake(size=4, observation="image", cell_pixels=1, view_radius=1)
    view = env.reset(seed=3)[0].images[0]
    rows = env.render().split("|")  # the agent starts in the top-left corner
    assert EDGE == (0, 0, 0) and _cells(view, 1) == [[EDGE, EDGE, EDGE],
                                                     [EDGE, LAKE["P"], LAKE[rows[0][1]]],
                                                     [EDGE, LAKE[rows[1][0]], LAKE[rows[1][1]]]]
    env.step("R")  # one tile right: the view follows the agent's column, not its row
    rows = env.render().split("|")
    assert rows[0][1] == "P", rows
    assert _cells(env.render_image(), 1)[1:] == [[LAKE[rows[0][0]], LAKE["P"], LAKE[rows[0][2]]],
                                                 [LAKE[rows[1][c]] for c in range(3)]]
    wide = Picture(cell_pixels=1, view_radius=2).draw(["ab", "cd"], {"a": (1, 1, 1), "b": (2, 2, 2), "c": (3, 3, 3),
                                                                     "d": (4, 4, 4)}, (1, 0))
    assert _cells(wide, 1)[2] == [EDGE, EDGE, (3, 3, 3), (4, 4, 4), EDGE]  # the agent's row, in the middle
    whole = Picture(cell_pixels=1).draw(["abc", "def"], {k: (i, i, i) for i, k in enumerate("abcdef")}, (0, 0))
    assert _cells(whole, 1) == [[(0,) * 3, (1,) * 3, (2,) * 3], [(3,) * 3, (4,) * 3, (5,) * 3]]  # 2 rows of 3


def test_sokoban_draws_its_room_and_the_player_s_view():
    env = Sokoban(observation="image", cell_pixels=3)
    observation, _ = env.reset(seed=5)
    assert isinstance(observation, Observation) and observation.text == "<image>"
    room = env.render().split("|")
    assert _cells(observation.images[0], 3) == [[ROOM[cell] for cell in row] for row in room]
    assert len(set(ROOM.values())) == len(ROOM)  # every kind of cell tells apart from the others
    view = Sokoban(observation="image", cell_pixels=1, view_radius=1).reset(seed=5)[0].images[0]
    r, c = env.player
    assert _cells(view, 1) == [[ROOM[room[y][x]] for x in (c - 1, c, c + 1)] for y in (r - 1, r, r + 1)]
    assert Sokoban().reset(seed=5)[0] == env.render()  # text by default


@pytest.mark.parametrize("env", [FrozenLake, Sokoban])
def test_picture_options_are_checked_by_name(env):
    with pytest.raises(ValueError, match="observation must be one of text, image, got 'pixels'"):
        env(observation="pixels")
    with pytest.raises(ValueError, match="cell_pixels must be at least 1, got 0"):
        env(observation="image", cell_pixels=0)
    with pytest.raises(ValueError, match=r"view_radius must be at least 1 \(or None: the whole grid\), got 0"):
        env(observation="image", view_radius=0)
