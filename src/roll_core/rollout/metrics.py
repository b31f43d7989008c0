"""Metrics of a trained batch, the same whichever scheduler produced it (see ``docs/design.md``)."""

from __future__ import annotations

import torch

from roll_core.data import Batch
from roll_core.rewards import RewardInput


def rows_by_domain(batch: Batch) -> dict[str, list[int]]:
    """Row indices of each domain, domains sorted by name."""
    out: dict[str, list[int]] = {}
    for i, d in enumerate(batch["domain"]):
        out.setdefault(d, []).append(i)
    return dict(sorted(out.items()))


def batch_metrics(batch: Batch, per_domain: bool) -> dict[str, float]:
    """``reward/mean`` and ``reward/std`` of the samples trained on, response lengths, and with
    ``per_domain`` each domain's reward, accuracy (share of samples with score >= 1), response
    length, sample count and the mean of every reward component of a domain scored by several rewards."""
    scores = batch["scores"]
    lengths = batch["response_mask"].sum(-1).float()
    out = {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
           "response_length/mean": float(lengths.mean()),
           "response_length/clip_ratio": float(batch["truncated"].float().mean()) if "truncated" in batch else 0.0}
    if not per_domain:
        return out
    for d, idx in rows_by_domain(batch).items():
        out[f"reward/{d}/mean"] = float(scores[idx].mean())
        out[f"reward/{d}/accuracy"] = float((scores[idx] >= 1.0).float().mean())
        out[f"response_length/{d}/mean"] = float(lengths[idx].mean())
        out[f"samples/{d}"] = float(len(idx))
        parts = [batch["reward_components"][i] for i in idx] if "reward_components" in batch else []
        if parts and len(parts[0]) > 1:
            for name in parts[0]:
                out[f"reward/{d}/{name}"] = sum(p[name] for p in parts) / len(parts)
    return out


def heldout_accuracy(scheduler, rows: list[dict], reward, evaluator=None) -> dict[str, float]:
    """Held-out accuracy with greedy decoding: the mean verifiable reward of one sample per row,
    per domain too when there are several, and the evaluation's own reward failures (popped, so
    they are not counted in the next RL step). With ``evaluator`` (``roles.eval_reward``'s router)
    that reward scores the samples again and its scores are the accuracy: the scheduler scores
    everything it generates with the training rewards, whose mean is then ``eval/train_reward``."""
    batch = scheduler.collect(rows, num_return_sequences=1, temperature=0.0)
    scores = batch["scores"]
    metrics = {f"eval/{k}": v for k, v in reward.pop_failures().items() if v}
    if evaluator is not None:
        metrics["eval/train_reward"] = float(scores.mean())
        samples = [RewardInput(p, t, g, d) for p, t, g, d in
                   zip(batch["prompt"], batch["response_text"], batch["ground_truth"], batch["domain"])]
        scores = torch.tensor(evaluator.gather(evaluator.submit(samples))[0], dtype=torch.float32)
        metrics.update({f"eval/eval_{k}": v for k, v in evaluator.pop_failures().items() if v})
    metrics["eval/accuracy"] = float(scores.mean())
    domains = rows_by_domain(batch)
    if len(domains) > 1:
        metrics.update({f"eval/accuracy/{d}": float(scores[idx].mean()) for d, idx in domains.items()})
    return metrics


def idle_times(step_s: float, train_s: float, old_log_probs_s: float, generate_s: float | None,
               overlapping: bool) -> dict[str, float]:
    """Idle seconds of each role in one RL step: the trainer works on the old log-probs and the
    update; generation, with a scheduler that waits for training, only while it generates (with
    one that overlaps training the idle share is not known here, so it is not reported)."""
    out = {"time/idle/actor_train_s": max(0.0, step_s - train_s - old_log_probs_s)}
    if not overlapping and generate_s is not None:
        out["time/idle/actor_infer_s"] = max(0.0, step_s - generate_s)
    return out


def accuracy_summary(before: dict[str, float], after: dict[str, float], steps: int) -> dict:
    """The run's summary: held-out accuracy before and after RL and the gain in percentage points
    (also printed), when the run had held-out rows."""
    summary = {"steps": steps, "before_rl": before, "after_rl": after}
    if before and after:
        b, a = before["eval/accuracy"], after["eval/accuracy"]
        summary["accuracy_gain_pp"] = round(100 * (a - b), 2)
        print(f"held-out accuracy (greedy): before RL {b:.1%} -> after RL {a:.1%} "
              f"({100 * (a - b):+.1f} pp) after {steps} RL steps", flush=True)
    return summary
