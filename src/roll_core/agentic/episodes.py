"""Playing episodes: the multi-turn loop between a policy and environments.

Each turn of each live episode: the conversation so far (token ids) goes to the policy, which
generates an action; the action's text goes to ``env.step``; the environment's reply is formatted
(:class:`TurnFormat`) and appended, and the next turn starts from the longer conversation. The
policy always sees the exact ids that will be trained on, so the sampled log-probs and the
trainer's agree. Episodes end when the environment says so, after ``max_turns`` turns (truncated),
when the next turn would not fit in ``max_length`` tokens (truncated), or when the environment
raises (``failed``: no reward for the failing step, the episode kept for the metrics, the run goes
on). The result is a list of :class:`~roll_core.agentic.samples.Episode` for
:func:`~roll_core.agentic.samples.episode_batch`.

A policy is any ``policy(conversations: list[list[int]]) -> list[(action_ids, log_probs)]``:
:func:`engine_policy` wraps an inference strategy's ``generate``; tests and ``roll play`` use
scripted ones. This loop steps every live episode once per policy call (a synchronous batch);
environment-level asynchronous rollout is not built yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from roll_core.agentic.samples import Episode, Turn
from roll_core.data import Batch
from roll_core.envs import Env

Policy = Callable[[list[list[int]]], list[tuple[list[int], list[float]]]]


@dataclass
class TurnFormat:
    """How observations become prompt text: the first is ``instruction + prefix + observation +
    suffix``, each later one ``prefix + observation + suffix`` (appended after the action, whose
    own EOS ends it). Plain text, so it works with any tokenizer, the embedded one too."""

    instruction: str = ""
    prefix: str = ""
    suffix: str = ">"

    def first(self, tokenizer, observation: str) -> list[int]:
        return _ids(tokenizer, self.instruction + self.prefix + observation + self.suffix)

    def next(self, tokenizer, observation: str) -> list[int]:
        return _ids(tokenizer, self.prefix + observation + self.suffix)


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class _Playing:
    """An episode in progress: its environment, the conversation the policy sees next, and the
    observation ids and state the next turn starts from."""

    env: Env
    episode: Episode
    conversation: list[int]
    pending: list[int]
    state: int


def play(envs: Sequence[Env], seeds: Sequence[int], groups: Sequence[int], policy: Policy, tokenizer, *,
         turn_format: TurnFormat = TurnFormat(), max_turns: int = 10, max_length: int = 512) -> list[Episode]:
    """Play one episode in each of ``envs`` (reset with its seed) to the end; see the module docstring."""
    episodes = [Episode([], group) for group in groups]
    live: list[_Playing] = []
    for env, seed, episode in zip(envs, seeds, episodes):
        try:
            observation, info = env.reset(seed=seed)
        except Exception as exc:  # noqa: BLE001 - an environment's bug ends its episode, not the run
            episode.failed, episode.info = True, {"error": f"reset: {type(exc).__name__}: {exc}"}
            continue
        ids = turn_format.first(tokenizer, observation)
        live.append(_Playing(env, episode, list(ids), ids, int(info.get("state_hash", 0))))
    while live:
        actions = policy([p.conversation for p in live])
        still = []
        for p, (action_ids, log_probs) in zip(live, actions):
            episode = p.episode
            text = tokenizer.decode(action_ids, skip_special_tokens=True)
            try:
                observation, reward, terminated, truncated, info = p.env.step(text)
            except Exception as exc:  # noqa: BLE001
                episode.turns.append(Turn(p.pending, action_ids, log_probs, 0.0, p.state))
                episode.failed, episode.info = True, {"error": f"step: {type(exc).__name__}: {exc}"}
                continue
            episode.turns.append(Turn(p.pending, action_ids, log_probs, float(reward), p.state))
            episode.info = {"success": bool(info.get("success", False))}
            if terminated or truncated:
                episode.truncated = bool(truncated) and not terminated
                continue
            reply = turn_format.next(tokenizer, observation)
            if len(episode.turns) >= max_turns or len(p.conversation) + len(action_ids) + len(reply) >= max_length:
                episode.truncated = True
                continue
            p.conversation += list(action_ids) + reply
            p.pending, p.state = reply, int(info.get("state_hash", 0))
            still.append(p)
        live = still
    return episodes


def engine_policy(generate: Callable[..., Batch], pad_token_id: int, **sampling) -> Policy:
    """A policy from an inference strategy's ``generate(batch, **sampling)`` (or a worker's): the
    conversations left-padded into one batch, each reply's generated tokens and log-probs back."""
    def policy(conversations: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        width = max(len(c) for c in conversations)
        ids = torch.full((len(conversations), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(conversations), width, dtype=torch.long)
        for row, tokens in enumerate(conversations):
            ids[row, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
            mask[row, width - len(tokens):] = 1
        out = generate(Batch({"prompt_ids": ids, "prompt_mask": mask}), **sampling)
        replies = []
        for tokens, keep, logp in zip(out["responses"], out["response_mask"], out["infer_log_probs"]):
            keep = keep.bool()
            replies.append((tokens[keep].tolist(), logp[keep].tolist()))
        return replies

    return policy


def scripted_policy(actions: Sequence[str], tokenizer, *, randomly: bool = False, seed: int = 0) -> Policy:
    """A policy without a model: at turn k each episode replies ``actions[k]`` (the last one from then
    on), or with ``randomly`` one of ``actions`` drawn from a seeded RNG; each reply ends with EOS and
    has log-probs 0. The turn is read off the conversation (one EOS per earlier reply)."""
    rng = torch.Generator().manual_seed(seed)

    def policy(conversations: list[list[int]]) -> list[tuple[list[int], list[float]]]:
        replies = []
        for tokens in conversations:
            if randomly:
                text = actions[int(torch.randint(len(actions), (1,), generator=rng))]
            else:
                text = actions[min(tokens.count(tokenizer.eos_token_id), len(actions) - 1)]
            ids = _ids(tokenizer, text) + [tokenizer.eos_token_id]
            replies.append((ids, [0.0] * len(ids)))
        return replies

    return policy


def transcript(episode: Episode, tokenizer) -> str:
    """An episode as readable text: each turn's observation, the reply, and what it earned."""
    lines = []
    for k, turn in enumerate(episode.turns):
        lines.append(f"[turn {k}] {tokenizer.decode(turn.observation_ids, skip_special_tokens=True)}")
        lines.append(f"  reply: {tokenizer.decode(turn.action_ids, skip_special_tokens=True)!r}   reward {turn.reward:g}")
    ending = ("failed: " + episode.info.get("error", "")) if episode.failed else (
        "truncated" if episode.truncated else "ended by the environment")
    lines.append(f"return {episode.reward:g}, {len(episode.turns)} turns, success {episode.info.get('success', False)}, "
                 f"{ending}")
    return "\n".join(lines)
