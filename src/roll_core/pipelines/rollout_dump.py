"""Rollout dumps: each step's training batch on disk, to read (``roll show-rollouts``) and to train
on again without generating (``roll replay``, :mod:`roll_core.pipelines.replay`).

With ``trainer.dump_rollouts_every: N``, ``rlvr`` and ``agentic`` write the batch of every N-th
step, exactly as the update receives it (after scoring, reference and old log-probs, reward
shaping and advantages), and ``online_dpo`` its pairs with their reference log-probs (none on a
step whose groups all tie), into ``<output_dir>/rollouts/``:

* ``step_000012.pt``: every tensor and list of the batch (``torch.save``), what replay trains on;
* ``step_000012.jsonl``: one readable line per sample: prompt and response text (for an agentic
  episode the conversation, the policy's turns and the environment's replies apart), score,
  reward components, domain, ground truth, advantage, the sampler's and the trainer's log-probs
  summed over the response, and the policy version that generated it (asynchronous rollout).

Both are written atomically (a temporary name, then a rename). ``roll export-pairs`` turns the
dumps of an ``rlvr`` or ``online_dpo`` run into preference pairs of the policy's own answers
(each prompt's best- and worst-scored), a ``data.train_file`` for ``dpo`` or ``reward_model``. Run::

    roll run trainer.dump_rollouts_every=10
    roll show-rollouts runs/quickstart --step 10
    roll export-pairs runs/quickstart -o pairs.jsonl
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from roll_core.data import Batch
from roll_core.errors import RollError
from roll_core.files import write_json_lines
from roll_core.multimodal import readable, sample_image_counts, tokens_per_image


def dump_path(run_dir: Path, step: int, suffix: str) -> Path:
    return Path(run_dir) / "rollouts" / f"step_{step:06d}.{suffix}"


def dumped_steps(run_dir: Path) -> list[int]:
    """The steps whose batch ``run_dir`` holds, in order."""
    return sorted(int(p.stem.removeprefix("step_")) for p in (Path(run_dir) / "rollouts").glob("step_*.pt"))


def _segments(tokens: list[int], is_action: list[bool]) -> list[tuple[bool, list[int]]]:
    """Runs of consecutive tokens that are, or are not, the policy's own."""
    out: list[tuple[bool, list[int]]] = []
    for token, action in zip(tokens, is_action):
        if out and out[-1][0] == action:
            out[-1][1].append(token)
        else:
            out.append((action, [token]))
    return out


def readable_rows(batch: Batch, tokenizer) -> list[dict]:
    """One dict per sample of ``batch``: text, rewards, advantage, log-probs, version."""
    rows = []
    responses, mask = batch["responses"], batch["response_mask"].bool()
    counts = sample_image_counts(batch)
    for i in range(len(batch)):
        valid = mask[i]
        tokens = responses[i][valid].tolist()
        prompt_ids = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        # a sample's images, in its prompt and (an episode's) replies, have as many tokens each
        per_image = tokens_per_image(tokenizer, prompt_ids + tokens, counts[i]) if counts else None
        row: dict = {"index": i, "prompt": readable(tokenizer, prompt_ids, per_image)}
        if "action_mask" in batch:  # an episode: the policy's turns and the environment's replies
            actions = batch["action_mask"][i][valid].bool().tolist()
            row["turns"] = [{"role": "policy" if a else "environment", "text": readable(tokenizer, t, per_image)}
                            for a, t in _segments(tokens, actions)]
        else:
            row["response"] = tokenizer.decode(tokens)
        for key in ("scores", "advantages", "infer_log_probs", "old_log_probs", "ref_log_probs"):
            if key not in batch.tensors:
                continue
            value = batch[key][i]
            if value.dim() == 0:
                row[key] = float(value)
            elif key == "advantages":
                row["advantage"] = float(value[valid].mean()) if valid.any() else 0.0
            else:
                row[f"{key}_sum"] = float(value[valid].sum())
        for key in ("reward_components", "domain", "ground_truth", "version", "env", "group"):
            if key in batch.non_tensors:
                row[key] = batch[key][i]
            elif key in batch.tensors and batch[key].dim() == 1:
                row[key] = batch[key][i].item()
        row["response_tokens"] = len(tokens)
        rows.append(row)
    return rows


def write_dump(run_dir: Path, step: int, batch: Batch, tokenizer) -> None:
    """``step_<step>.pt`` and ``.jsonl`` under ``run_dir/rollouts`` (see the module docstring)."""
    tensors_file, text_file = dump_path(run_dir, step, "pt"), dump_path(run_dir, step, "jsonl")
    tensors_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = tensors_file.with_suffix(".pt.tmp")
    torch.save({"tensors": dict(batch.tensors), "non_tensors": dict(batch.non_tensors)}, tmp)
    tmp.replace(tensors_file)
    write_json_lines(text_file, readable_rows(batch, tokenizer))


def load_dump(run_dir: Path, step: int) -> Batch:
    """The batch of ``step`` as it was dumped."""
    path = dump_path(run_dir, step, "pt")
    if not path.is_file():
        have = dumped_steps(run_dir)
        raise RollError(f"{run_dir} has no rollout dump of step {step}; dumped steps: "
                        f"{step_ranges(have) or 'none (set trainer.dump_rollouts_every)'}")
    saved = torch.load(path, weights_only=False)
    return Batch(saved["tensors"], saved["non_tensors"])


def dump_pairs(batch: Batch) -> list[dict]:
    """A dumped step's samples as preference pairs, in the rows the ``dpo`` and ``reward_model``
    pipelines train on (``prompt``, ``chosen``, ``rejected``, with both scores and the ground truth):
    an ``online_dpo`` step's own pairs, or each group of an ``rlvr`` step as its best- and
    worst-scored samples (:func:`~roll_core.algorithms.preference.best_worst_pairs`; tied groups
    give none)."""
    from roll_core.algorithms.objective import pair_sides
    from roll_core.algorithms.preference import best_worst_pairs

    if "response_text" not in batch.non_tensors or "scores" not in batch.tensors:
        raise RollError("only rlvr and online_dpo dumps hold scored responses to pair (an agentic dump holds "
                        "episodes)")
    if "pair" in batch.tensors:  # online_dpo: chosen, rejected, chosen, ...
        chosen = pair_sides(batch)
        index = torch.stack([chosen.nonzero().flatten(), (~chosen).nonzero().flatten()], dim=1)
    else:
        index = best_worst_pairs(batch["scores"], batch["group_index"])
    scores, texts = batch["scores"].tolist(), batch["response_text"]
    return [{"prompt": batch["prompt"][c], "chosen": texts[c], "rejected": texts[r], "chosen_score": scores[c],
             "rejected_score": scores[r], "ground_truth": batch["ground_truth"][c]}
            for c, r in index.tolist()]


def export_pairs(run_dir: Path, out: Path, steps: tuple[int, int] | None = None) -> tuple[int, list[int]]:
    """Write the preference pairs of every dumped step in ``steps`` (inclusive; None: all) to
    ``out`` as JSON lines, each with its ``step`` (written atomically); returns the number of pairs
    and the steps read."""
    run_dir = Path(run_dir)
    dumped = dumped_steps(run_dir)
    chosen = [s for s in dumped if steps is None or steps[0] <= s <= steps[1]]
    if not chosen:
        raise RollError(f"{run_dir} has no rollout dumps{f' in steps {steps[0]}-{steps[1]}' if steps else ''} "
                        f"(dumped: {step_ranges(dumped) or 'none'}; run with trainer.dump_rollouts_every=N)")
    rows = [{**pair, "step": step} for step in chosen for pair in dump_pairs(load_dump(run_dir, step))]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_lines(out, rows)
    return len(rows), chosen


def step_ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    parts: list[list[int]] = []
    for s in steps:
        if parts and s == parts[-1][1] + 1:
            parts[-1][1] = s
        else:
            parts.append([s, s])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in parts)


def show(run_dir: Path, step: int | None = None, limit: int | None = 8) -> str:
    """The readable dump of ``step`` (None: the last one dumped), ``limit`` samples (None: all)."""
    run_dir = Path(run_dir)
    steps = dumped_steps(run_dir)
    if not steps:
        raise RollError(f"{run_dir} has no rollout dumps (rollouts/step_*.pt); run with "
                        f"trainer.dump_rollouts_every=N to write them")
    step = steps[-1] if step is None else step
    path = dump_path(run_dir, step, "jsonl")
    if step not in steps:
        raise RollError(f"{run_dir} has no rollout dump of step {step}; dumped steps: {step_ranges(steps)}")
    if not path.is_file():  # the batch is written first, its readable copy second
        raise RollError(f"{run_dir}: the dump of step {step} has no readable copy ({path.name} is missing: the "
                        f"run stopped while writing it); roll replay can still train on its batch")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    lines = [f"step {step}: {len(rows)} samples" + (f", the first {limit}" if limit and limit < len(rows) else "")]
    for row in rows[:limit]:
        facts = [f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}"
                 for k in ("scores", "advantage", "infer_log_probs_sum", "old_log_probs_sum", "version", "domain",
                           "env", "response_tokens") if k in row]
        if row.get("reward_components") and len(row["reward_components"]) > 1:
            facts.append("components=" + ",".join(f"{k}:{v:.3g}" for k, v in row["reward_components"].items()))
        lines.append(f"--- sample {row['index']}  " + " ".join(facts))
        lines.append(f"  prompt:   {row['prompt']!r}")
        if "turns" in row:
            lines += [f"  {t['role']:<12}{t['text']!r}" for t in row["turns"]]
        else:
            lines.append(f"  response: {row['response']!r}")
        if "ground_truth" in row:
            lines.append(f"  expected: {row['ground_truth']!r}")
    return "\n".join(lines)
