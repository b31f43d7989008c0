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

A policy is any ``policy(conversations: list[list[int]], envs) -> list[(action_ids, log_probs)]``,
given the live episodes' conversations and their environments; where observations carry images
(:class:`~roll_core.envs.Observation`), it is also given ``images=``, each conversation's so far
(``[k, C, H, W]``, in the order of their image tokens; None for none). :func:`engine_policy` wraps an
inference strategy's ``generate`` (and ignores the environments); :func:`teacher_policy` reads the
state through ``env.expert_action()`` (the warm-up's demonstrations); tests and ``roll play`` use
scripted ones. :func:`play_jobs` steps every live episode once per policy call (a synchronous batch
rollout, several environments' episodes together; :func:`play` for one environment); :func:`play_one` is one environment's own loop, which environment-level asynchronous
rollout (:mod:`roll_core.agentic.async_rollout`) runs for every environment at once, with no barrier.
An environment that raises, or (on an env worker) hangs past its timeout, fails its episode only
(``info["error"]``, ``info["hung"]``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from roll_core.agentic.env_workers import EnvFailed, EnvHung
from roll_core.agentic.samples import Episode, Turn, shown_images
from roll_core.data import Batch
from roll_core.envs import Env, Observation, observation_parts
from roll_core.multimodal import encode_text, readable, stack_images, tokens_per_image

Policy = Callable[..., list[tuple[list[int], list[float]]]]  # (conversations, envs[, images=]) -> replies


@dataclass(frozen=True)
class TurnFormat:
    """How observations become prompt text: the first is ``instruction + prefix + observation +
    suffix``, each later one ``prefix + observation + suffix`` (appended after the action, whose
    own EOS ends it). Plain text, so it works with any tokenizer, the embedded one too. Each returns
    the ids and, for an observation with images, their pixels ``[k, C, H, W]`` (else None)."""

    instruction: str = ""
    prefix: str = ""
    suffix: str = ">"

    def first(self, tokenizer, observation: str | Observation) -> tuple[list[int], torch.Tensor | None]:
        text, images = observation_parts(observation)
        return encode_text(tokenizer, self.instruction + self.prefix + text + self.suffix, images)

    def next(self, tokenizer, observation: str | Observation) -> tuple[list[int], torch.Tensor | None]:
        text, images = observation_parts(observation)
        return encode_text(tokenizer, self.prefix + text + self.suffix, images)


@dataclass
class _Playing:
    """An episode in progress: its environment and rules, the conversation the policy sees next, and
    the observation ids, pixels and state the next turn starts from."""

    env: Env
    rules: Rules
    episode: Episode
    conversation: list[int]
    pending: list[int]
    state: int
    pending_images: torch.Tensor | None = None

    @property
    def conversation_images(self) -> torch.Tensor | None:
        """Every image of the conversation so far ``[k, C, H, W]`` (its turns' and the pending
        observation's), or None."""
        return shown_images([*(t.observation_images for t in self.episode.turns), self.pending_images])


@dataclass(frozen=True)
class Rules:
    """How turns are written and when an episode is cut (the module docstring)."""

    tokenizer: Any
    turn_format: TurnFormat = TurnFormat()
    max_turns: int = 10
    max_length: int = 512


def _fail(episode: Episode, what: str, exc: Exception) -> None:
    episode.failed = True
    episode.info = {"error": str(exc) if isinstance(exc, EnvFailed) else f"{what}: {type(exc).__name__}: {exc}",
                    "hung": isinstance(exc, EnvHung)}


def start(env: Env, seed: int | None, episode: Episode, rules: Rules) -> _Playing | None:
    """Reset ``env``; the episode in progress, or None when the reset failed (``episode.failed``)."""
    try:
        observation, info = env.reset(seed=seed)
    except Exception as exc:  # noqa: BLE001 - an environment's bug ends its episode, not the run
        _fail(episode, "reset", exc)
        return None
    try:
        ids, pixels = rules.turn_format.first(rules.tokenizer, observation)
    except (TypeError, ValueError) as exc:  # an observation that breaks its own format: the env's bug
        _fail(episode, "reset", exc)
        return None
    return _Playing(env, rules, episode, list(ids), ids, int(info.get("state_hash", 0)), pixels)


def advance(p: _Playing, action_ids: list[int], log_probs: list[float]) -> bool:
    """Apply the policy's reply to ``p``'s environment and record the turn; True while the episode goes on."""
    episode, rules, tokenizer = p.episode, p.rules, p.rules.tokenizer
    text = tokenizer.decode(action_ids, skip_special_tokens=True)
    try:
        observation, reward, terminated, truncated, info = p.env.step(text)
    except Exception as exc:  # noqa: BLE001
        episode.turns.append(Turn(p.pending, action_ids, log_probs, 0.0, p.state, p.pending_images))
        _fail(episode, "step", exc)
        return False
    episode.turns.append(Turn(p.pending, action_ids, log_probs, float(reward), p.state, p.pending_images))
    episode.info = {"success": bool(info.get("success", False))}
    if terminated or truncated:
        episode.truncated = bool(truncated) and not terminated
        return False
    try:
        reply, pixels = rules.turn_format.next(tokenizer, observation)
    except (TypeError, ValueError) as exc:
        _fail(episode, "step", exc)
        return False
    if len(episode.turns) >= rules.max_turns or len(p.conversation) + len(action_ids) + len(reply) >= rules.max_length:
        episode.truncated = True
        return False
    p.conversation += list(action_ids) + reply
    p.pending, p.pending_images, p.state = reply, pixels, int(info.get("state_hash", 0))
    return True


@dataclass(frozen=True)
class Job:
    """One episode to play: on ``env``, reset with ``seed``, in group ``group``, under ``rules``,
    labelled ``label`` (``Episode.env``)."""

    env: Env
    seed: int | None
    group: int
    rules: Rules
    label: str = ""


def play(envs: Sequence[Env], seeds: Sequence[int], groups: Sequence[int], policy: Policy, tokenizer, *,
         turn_format: TurnFormat = TurnFormat(), max_turns: int = 10, max_length: int = 512,
         concurrent_steps: bool = False) -> list[Episode]:
    """Play one episode in each of ``envs`` (reset with its seed) to the end, all in lockstep under
    the same rules: :func:`play_jobs` for one environment's episodes."""
    rules = Rules(tokenizer, turn_format, max_turns, max_length)
    return play_jobs([Job(env, seed, group, rules) for env, seed, group in zip(envs, seeds, groups)], policy,
                     concurrent_steps=concurrent_steps)


def play_jobs(jobs: Sequence[Job], policy: Policy, *, concurrent_steps: bool = False) -> list[Episode]:
    """Play every job's episode to the end, all in lockstep: one policy call per turn for every live
    episode, whatever its environment (a synchronous batch rollout; see the module docstring). The
    episodes come back in the jobs' order. With ``concurrent_steps`` the environments of a turn step
    at once, each in a thread (remote or slow environments); the turn still waits for the slowest."""
    episodes = [Episode([], job.group, env=job.label) for job in jobs]
    pool = ThreadPoolExecutor(max(len(jobs), 1)) if concurrent_steps else None
    try:
        def each(fn, *columns):
            return list(pool.map(fn, *columns)) if pool else list(map(fn, *columns))

        live = [p for p in each(lambda job, e: start(job.env, job.seed, e, job.rules), jobs, episodes) if p]
        while live:
            replies = policy([p.conversation for p in live], [p.env for p in live],
                             **images_keyword([p.conversation_images for p in live]))
            going = each(lambda p, reply: advance(p, reply[0], reply[1]), live, replies)
            live = [p for p, on in zip(live, going) if on]
    finally:
        if pool:
            pool.shutdown(wait=False)
    return episodes


def images_keyword(images: list[torch.Tensor | None]) -> dict[str, list]:
    """The ``images=`` keyword of a policy call whose conversations have shown ``images``; none
    where none has any, so a text-only policy ``(conversations, envs)`` keeps working."""
    return {"images": images} if any(i is not None for i in images) else {}


def play_one(env: Env, seed: int | None, group: int, ask: Callable[..., tuple[list[int], list[float]]],
             rules: Rules, label: str = "") -> Episode:
    """One episode on its own, each turn's reply from ``ask(conversation, env)`` (with ``images=`` the
    conversation's, where it has any): the loop of one environment in environment-level asynchronous
    rollout (:mod:`roll_core.agentic.async_rollout`)."""
    episode = Episode([], group, env=label)
    p = start(env, seed, episode, rules)
    while p is not None:
        images = p.conversation_images
        action_ids, log_probs = ask(p.conversation, p.env, **({} if images is None else {"images": images}))
        if not advance(p, action_ids, log_probs):
            break
    return episode


def engine_policy(generate: Callable[..., Batch], pad_token_id: int, **sampling) -> Policy:
    """A policy from an inference strategy's ``generate(batch, **sampling)`` (or a worker's): the
    conversations left-padded into one batch, with their images (:func:`roll_core.multimodal.stack_images`),
    each reply's generated tokens and log-probs back."""
    def policy(conversations: list[list[int]], envs=None, images=None) -> list[tuple[list[int], list[float]]]:
        width = max(len(c) for c in conversations)
        ids = torch.full((len(conversations), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(conversations), width, dtype=torch.long)
        for row, tokens in enumerate(conversations):
            ids[row, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
            mask[row, width - len(tokens):] = 1
        prompts = {"prompt_ids": ids, "prompt_mask": mask, **(stack_images(images) if images else {})}
        out = generate(Batch(prompts), **sampling)
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

    def policy(conversations: list[list[int]], envs=None, images=None) -> list[tuple[list[int], list[float]]]:
        replies = []
        for tokens in conversations:
            if randomly:
                text = actions[int(torch.randint(len(actions), (1,), generator=rng))]
            else:
                text = actions[min(tokens.count(tokenizer.eos_token_id), len(actions) - 1)]
            ids = encode_text(tokenizer, text)[0] + [tokenizer.eos_token_id]
            replies.append((ids, [0.0] * len(ids)))
        return replies

    return policy


def teacher_policy(tokenizer, *, noise: float = 0.0, seed: int = 0) -> Policy:
    """A careless teacher: each turn the environment's ``expert_action()``, except that with
    probability ``noise`` (and whenever the expert has no answer) a uniform draw from
    ``env.actions``; replies end with EOS and have log-probs 0. Its episodes are the agentic
    warm-up's demonstrations: mostly good, with mistakes for RL to unlearn."""
    if not 0 <= noise <= 1:
        raise ValueError(f"noise must be in [0, 1], got {noise}")
    rng = torch.Generator().manual_seed(seed)

    def policy(conversations: list[list[int]], envs: list[Env], images=None) -> list[tuple[list[int], list[float]]]:
        replies = []
        for env in envs:
            action = env.expert_action()
            if action is None or float(torch.rand((), generator=rng)) < noise:
                if not env.actions:
                    raise ValueError(f"{type(env).__name__} has no expert action here and no 'actions' to draw "
                                     f"from; a teacher needs one of them")
                action = env.actions[int(torch.randint(len(env.actions), (1,), generator=rng))]
            ids = encode_text(tokenizer, action)[0] + [tokenizer.eos_token_id]
            replies.append((ids, [0.0] * len(ids)))
        return replies

    return policy


def transcript(episode: Episode, tokenizer) -> str:
    """An episode as readable text: each turn's observation, the reply, and what it earned."""
    lines = []
    for k, turn in enumerate(episode.turns):
        images = 0 if turn.observation_images is None else len(turn.observation_images)
        per_image = tokens_per_image(tokenizer, turn.observation_ids, images)
        shown = readable(tokenizer, turn.observation_ids, per_image, skip_special_tokens=True)
        lines.append(f"[turn {k}] {shown}")
        lines.append(f"  reply: {tokenizer.decode(turn.action_ids, skip_special_tokens=True)!r}   reward {turn.reward:g}")
    ending = ("failed: " + episode.info.get("error", "")) if episode.failed else (
        "truncated" if episode.truncated else "ended by the environment")
    lines.append(f"return {episode.reward:g}, {len(episode.turns)} turns, success {episode.info.get('success', False)}, "
                 f"{ending}")
    return "\n".join(lines)

