"""Training samples from multi-turn episodes: the whole conversation as one sequence.

An environment manager plays an episode turn by turn: the model sees the conversation so far (the
first observation, its earlier actions and the environment's replies, formatted as text by the
manager's ``TurnFormat``: :mod:`roll_core.agentic.episodes`) and generates an action. What it saw and what it generated are token ids; this module
lays an :class:`Episode` out as one training row, the layout the multi-turn estimators read
(:mod:`roll_core.algorithms.advantages`)::

    prompt_ids      the first observation (left-padded across the batch)
    responses       action_0, observation_1, action_1, observation_2, ..., action_{T-1}
    response_mask   1 on every real token of ``responses``: the model attends to the whole conversation
    action_mask     1 on action tokens only: the loss (and its entropy and KL terms) never trains the
                    environment's text; the multi-turn estimators take it as their response mask
    turn_index      k on the tokens of action k, -1 elsewhere
    turn_rewards    [T] the reward of each turn, later placed on the last token of its action
    state_hash      [T] the environment state each turn acted in (GiGPO's step groups)
    scores          the episode's return (group filters and difficulty masks read it)
    infer_log_probs the sampler's log-probs of the action tokens, 0 elsewhere
    pixel_values    [B, K, C, H, W] where observations carry images: every image of the kept turns,
                    in order, zero past a row's own
    image_counts    [B] how many of each row's images are real (:mod:`roll_core.multimodal`)

Every token of the row is exactly what the model saw or produced when it acted, so the trainer's
log-probs are those of the sampled policy. That is why a conversation longer than ``max_length``
is cut at a turn boundary and never inside one: :func:`fit_turns` keeps the longest prefix of whole
turns that fits, marks the episode ``truncated`` and drops the later turns with their rewards (the
manager also stops an episode before its next turn would overflow, so in practice this only trims
what a shorter training context needs). An episode whose first turn does not fit is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable

import torch

from roll_core.data import Batch
from roll_core.multimodal import stack_images


@dataclass
class Turn:
    """One action of the agent: the tokens shown before it, the tokens it generated, what followed."""

    observation_ids: list[int]  # for turn 0 the whole first prompt; later, the environment's reply
    action_ids: list[int]
    action_log_probs: list[float]  # the sampler's, one per action token
    reward: float = 0.0
    state_hash: int = 0  # the environment state the action was taken in
    observation_images: torch.Tensor | None = None  # [k, C, H, W]: the observation's images, if any

    def __post_init__(self):
        if len(self.action_log_probs) != len(self.action_ids):
            raise ValueError(f"a turn has {len(self.action_ids)} action tokens but {len(self.action_log_probs)} "
                             f"log-probs")
        if not self.action_ids:
            raise ValueError("a turn needs at least one action token")

    @property
    def length(self) -> int:
        return len(self.observation_ids) + len(self.action_ids)


@dataclass
class Episode:
    """A played episode: its turns, the group it belongs to (episodes from the same seed), and why it ended."""

    turns: list[Turn]
    group: int
    truncated: bool = False
    failed: bool = False  # the environment raised or hung: no reward, counted in the metrics
    info: dict = field(default_factory=dict)
    env: str = ""  # the label of the environment that played it (agentic.envs); metrics split by it

    @property
    def reward(self) -> float:
        return sum(t.reward for t in self.turns)


def fit_turns(episode: Episode, max_length: int) -> Episode:
    """The longest prefix of whole turns whose tokens fit in ``max_length`` (``truncated`` when any
    turn was dropped)."""
    if not episode.turns:
        raise ValueError("an episode without turns (its environment failed at reset) is not a training row; "
                         "leave it out of the batch")
    kept, used = [], 0
    for turn in episode.turns:
        if used + turn.length > max_length:
            break
        kept.append(turn)
        used += turn.length
    if not kept:
        raise ValueError(f"the first turn of an episode has {episode.turns[0].length} tokens, more than "
                         f"max_length={max_length}")
    if len(kept) == len(episode.turns):
        return episode
    return replace(episode, turns=kept, truncated=True)


def _row(episode: Episode) -> dict[str, list]:
    first, *rest = episode.turns
    tokens, mask, turn_index, log_probs = [], [], [], []
    for k, turn in enumerate(episode.turns):
        if k:  # the environment's reply: context, not a target
            tokens += turn.observation_ids
            mask += [0] * len(turn.observation_ids)
            turn_index += [-1] * len(turn.observation_ids)
            log_probs += [0.0] * len(turn.observation_ids)
        tokens += turn.action_ids
        mask += [1] * len(turn.action_ids)
        turn_index += [k] * len(turn.action_ids)
        log_probs += turn.action_log_probs
    return {"prompt": first.observation_ids, "response": tokens, "mask": mask, "turn_index": turn_index,
            "log_probs": log_probs}


def episode_batch(episodes: list[Episode], pad_token_id: int, max_length: int) -> Batch:
    """``episodes`` (each cut by :func:`fit_turns`) as one training batch; the layout is the module's.
    Rows are left-padded prompts and right-padded responses; ``turn_rewards`` and ``state_hash`` are
    padded with 0 past an episode's last turn (``turn_index`` never points there)."""
    episodes = [fit_turns(e, max_length) for e in episodes]
    rows = [_row(e) for e in episodes]
    n, p = len(rows), max(len(r["prompt"]) for r in rows)
    width, turns = max(len(r["response"]) for r in rows), max(len(e.turns) for e in episodes)
    prompt_ids = torch.full((n, p), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(n, p, dtype=torch.long)
    responses = torch.full((n, width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(n, width, dtype=torch.long)
    action_mask = torch.zeros(n, width, dtype=torch.long)
    turn_index = torch.full((n, width), -1, dtype=torch.long)
    infer_log_probs = torch.zeros(n, width)
    turn_rewards = torch.zeros(n, turns)
    state_hash = torch.zeros(n, turns, dtype=torch.long)
    for i, (row, episode) in enumerate(zip(rows, episodes)):
        a, b = len(row["prompt"]), len(row["response"])
        prompt_ids[i, p - a:] = torch.tensor(row["prompt"], dtype=torch.long)
        prompt_mask[i, p - a:] = 1
        responses[i, :b] = torch.tensor(row["response"], dtype=torch.long)
        response_mask[i, :b] = 1
        action_mask[i, :b] = torch.tensor(row["mask"], dtype=torch.long)
        turn_index[i, :b] = torch.tensor(row["turn_index"], dtype=torch.long)
        infer_log_probs[i, :b] = torch.tensor(row["log_probs"])
        turn_rewards[i, :len(episode.turns)] = torch.tensor([t.reward for t in episode.turns])
        state_hash[i, :len(episode.turns)] = torch.tensor([t.state_hash for t in episode.turns], dtype=torch.long)
    return Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "responses": responses,
                  "response_mask": response_mask, "action_mask": action_mask, "turn_index": turn_index, "infer_log_probs": infer_log_probs,
                  "turn_rewards": turn_rewards, "state_hash": state_hash,
                  "group_index": torch.tensor([e.group for e in episodes], dtype=torch.long),
                  "scores": torch.tensor([e.reward for e in episodes], dtype=torch.float32),
                  "truncated": torch.tensor([e.truncated for e in episodes]),
                  "failed": torch.tensor([e.failed for e in episodes]),
                  **stack_images([shown_images(t.observation_images for t in e.turns) for e in episodes])})


def shown_images(observations: Iterable[torch.Tensor | None]) -> torch.Tensor | None:
    """The images of ``observations`` (each ``[k, C, H, W]`` or None) as one ``[k, C, H, W]``, in
    order, or None where none has any: what a conversation has shown so far."""
    images = [i for i in observations if i is not None]
    return torch.cat(images) if images else None


def turn_token_rewards(turn_rewards: torch.Tensor, turn_index: torch.Tensor) -> torch.Tensor:
    """Each turn's reward on the last token of its action. ``[B, T]`` and ``[B, R]`` -> ``[B, R]``.

    The multi-turn estimators sum a turn's token rewards into its reward, so this round-trips:
    :func:`roll_core.algorithms.advantages.turn_rewards` gives ``turn_rewards`` back."""
    rewards = torch.zeros(turn_index.shape, dtype=torch.float32)
    if turn_index.numel() == 0:
        return rewards
    positions = torch.arange(turn_index.shape[1]).expand_as(turn_index)
    for k in range(turn_rewards.shape[1]):
        in_turn = turn_index == k
        has = in_turn.any(1)
        last = torch.where(in_turn, positions, -1).max(1).values
        rows = has.nonzero(as_tuple=True)[0]
        rewards[rows, last[rows]] = turn_rewards[rows, k].float()
    return rewards
