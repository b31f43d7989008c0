"""Where a run's rows come from: JSONL files or registered datasets, one source or one per domain.

Rows are dicts with ``prompt`` (or ``messages``, a conversation) and ``ground_truth`` (and optionally
``demonstration`` and ``domain``).
With ``data.domains`` every row is tagged with its domain's name.
"""

from __future__ import annotations

from roll_core.chat import render_rows
from roll_core.data import read_jsonl
from roll_core.errors import ConfigError, did_you_mean
from roll_core.multimodal import check_rows, has_images, processor_for


def read_source(source, key: str, plugins) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows of a data config (``data`` or one of ``data.domains``)."""
    if source.train_file:
        return read_jsonl(source.train_file), (read_jsonl(source.eval_file) if source.eval_file else [])
    factory = plugins.datasets.get(source.dataset)
    try:
        built = factory(source.options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"key '{key}.options' for dataset '{source.dataset}': {exc}") from None
    return built.train_rows(), built.eval_rows()


def load_rows(data, plugins, tokenizer) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows of the ``data`` section (held-out cut to ``eval_size`` per source),
    conversations rendered through ``tokenizer``'s chat template (:mod:`roll_core.chat`)."""
    def cut(rows):
        return rows[: data.eval_size] if data.eval_size else rows

    if not data.domains:
        train, evals = read_source(data, "data", plugins)
        evals = cut(evals)
    else:
        train, evals = [], []
        for domain, source in data.domains.items():
            t, e = read_source(source, f"data.domains.{domain}", plugins)
            train += [{**row, "domain": domain} for row in t]
            evals += [{**row, "domain": domain} for row in cut(e)]
    for rows, where in ((train, "training"), (evals, "held-out")):
        if has_images(rows):  # before any worker starts: the counts, and a model that reads images
            check_rows(rows, where)
            processor_for(tokenizer.name_or_path)
    return (render_rows(tokenizer, train, apply_to_prompts=data.apply_chat_template),
            render_rows(tokenizer, evals, apply_to_prompts=data.apply_chat_template))


def check_ground_truth(rows: list[dict], where: str) -> None:
    """Every row a reward scores must say what is right."""
    missing = [i for i, row in enumerate(rows) if "ground_truth" not in row]
    if missing:
        raise ConfigError(f"{len(missing)} {where} rows have no 'ground_truth' (the first: row {missing[0]}), "
                          f"which the reward needs")


def check_domains(rows: list[dict], domain_rewards) -> None:
    """Every domain with its own reward must occur in the data (a typo would silently fall back to
    the default reward)."""
    present = {row.get("domain", "default") for row in rows}
    for domain in domain_rewards:
        if domain not in present:
            raise ConfigError(f"key 'roles.domain_rewards.{domain}': no training row has domain '{domain}'."
                              f"{did_you_mean(domain, present)} The data has: {', '.join(sorted(present))}")
