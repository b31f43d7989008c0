"""``roll report RUN_DIR [RUN_DIR ...]``: plots of one run, or of several overlaid, as PNG files and
one self-contained HTML page (the images are embedded, so the page can be mailed or attached).

Each panel plots a family of metrics from every run's ``metrics.jsonl`` against the step, one line
per run and metric: reward (overall and per domain), held-out accuracy or success rate (overall and
per domain or environment), KL, entropy, losses, response lengths, time per phase, staleness and
the train/inference log-prob gap. A panel no run has data for is left out. The page adds a table of
each run's before/after numbers (``summary.json``) and, for several runs, the config keys in which
they differ. Reads only the files a run writes, so it works on runs that are still going::

    roll report runs/quickstart                        # -> runs/quickstart/report/
    roll report runs/grpo runs/dapo --out compare/     # two runs on one page

Plots use matplotlib (``pip install 'roll-core[report]'``), drawn off-screen (the Agg backend).
"""

from __future__ import annotations

import base64
import html
import json
import re
from dataclasses import dataclass
from pathlib import Path

from roll_core.config.resume import flatten
from roll_core.errors import RollError
from roll_core.trackers import read_metrics


@dataclass(frozen=True)
class Panel:
    """One plot: the metrics whose names match ``pattern`` (a full match)."""

    name: str
    title: str
    pattern: str
    ylabel: str = ""


PANELS = (
    Panel("reward", "Reward of the trained samples", r"reward/(mean|[^/]+/mean)", "reward"),
    Panel("accuracy", "Held-out accuracy / success rate", r"eval/(accuracy|success_rate|[^/]+/(accuracy|success_rate))",
          "fraction"),
    Panel("kl", "KL to the reference", r"train/kl", "nats / token"),
    Panel("entropy", "Policy entropy", r"train/entropy", "nats / token"),
    Panel("loss", "Losses", r"(train/pg_loss|warmup/loss|critic/vf_loss|dpo/loss|distill/loss|eval/loss)", "loss"),
    Panel("response_length", "Response length", r"response_length/(mean|max)", "tokens"),
    Panel("time", "Time per phase", r"time/[a-z_]+_s", "seconds"),
    Panel("staleness", "Staleness of the trained samples", r"rollout/staleness_(mean|max)", "policy versions"),
    Panel("mismatch", "Train/inference log-prob gap", r"train/infer_log_prob_gap", "nats / token"),
)


@dataclass
class Run:
    """One run directory's metrics (``{name: ([steps], [values])}``), summary and config."""

    label: str
    path: Path
    series: dict[str, tuple[list[int], list[float]]]
    summary: dict
    config: dict


def load_run(path: Path) -> Run:
    """Read ``metrics.jsonl`` (required), ``summary.json`` and ``config.json`` (when present)."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise RollError(f"{path} is not a run directory: it has no metrics.jsonl (the jsonl tracker writes it)")
    series: dict[str, tuple[list[int], list[float]]] = {}
    for row in read_metrics(metrics):
        step = int(row.pop("step"))
        for key, value in row.items():
            if isinstance(value, (int, float)) and value == value:  # numbers, not NaN
                steps, values = series.setdefault(key, ([], []))
                steps.append(step)
                values.append(float(value))

    def read(name: str) -> dict:
        file = path / name
        return json.loads(file.read_text()) if file.is_file() else {}

    return Run(path.name, path, series, read("summary.json"), read("config.json"))


def plot(panel: Panel, runs: list[Run], out: Path) -> Path | None:
    """Draw ``panel`` for ``runs`` into ``out/<name>.png``; None when no run has its metrics."""
    import matplotlib

    matplotlib.use("Agg")  # off-screen: no display needed
    import matplotlib.pyplot as plt

    lines = [(run, key) for run in runs for key in sorted(run.series) if re.fullmatch(panel.pattern, key)]
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=100)
    for run, key in lines:
        steps, values = run.series[key]
        label = key if len(runs) == 1 else f"{run.label}: {key}"
        style = ("-", "--", ":", "-.")[runs.index(run) % 4]  # one line style per run
        ax.plot(steps, values, style, marker="o" if len(steps) < 12 else None, markersize=3, linewidth=1.5,
                label=label)
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    file = out / f"{panel.name}.png"
    fig.savefig(file)
    plt.close(fig)
    return file


def config_differences(runs: list[Run]) -> dict[str, list[object]]:
    """The config keys whose values differ between runs (output_dir and exp_name aside)."""
    flat = [flatten(run.config) for run in runs]
    keys = sorted(set().union(*flat)) if flat else []
    return {k: [f.get(k) for f in flat] for k in keys
            if k not in ("output_dir", "exp_name") and len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1}


def _summary_rows(run: Run) -> list[tuple[str, str]]:
    """Steps, restarts and every number of ``summary.json`` (``before.eval/accuracy`` ...)."""
    s = run.summary
    rows = [("steps", str(s.get("steps", max((max(st) for st, _ in run.series.values()), default=0))))]
    rows += [(k, f"{v:.4g}") for k, v in flatten(s).items()
             if k not in ("steps", "restarts") and isinstance(v, (int, float)) and not isinstance(v, bool)]
    if "restarts" in s:
        rows.append(("restarts", str(s["restarts"])))
    return rows


def write_report(run_dirs: list[Path], out: Path) -> Path:
    """Plot every panel of ``run_dirs`` into ``out`` and write ``out/report.html``; returns its path."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RollError("roll report draws with matplotlib, which is not installed: "
                        "pip install 'roll-core[report]'") from None
    runs = [load_run(Path(p)) for p in run_dirs]
    labels = [r.label for r in runs]
    for i, run in enumerate(runs):  # two runs with one directory name: tell them apart
        if labels.count(run.label) > 1:
            run.label = f"{run.label} ({run.path.parent.name or i})"
    out.mkdir(parents=True, exist_ok=True)
    images = [(panel, file) for panel in PANELS if (file := plot(panel, runs, out)) is not None]
    drawn = {panel.name for panel, _ in images}
    for panel in PANELS:  # an earlier report's plot of a metric these runs lack, in a reused folder
        if panel.name not in drawn:
            (out / f"{panel.name}.png").unlink(missing_ok=True)
    if not images:
        raise RollError(f"no plottable metrics in {', '.join(str(p) for p in run_dirs)}")
    parts = [f"<h1>roll report: {html.escape(', '.join(r.label for r in runs))}</h1>", "<h2>Plots</h2>"]
    for panel, file in images:
        data = base64.b64encode(file.read_bytes()).decode()
        parts.append(f'<figure><img alt="{html.escape(panel.title)}" src="data:image/png;base64,{data}"></figure>')
    parts.append("<h2>Summary</h2>")
    for run in runs:
        cells = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in _summary_rows(run))
        parts.append(f"<h3>{html.escape(run.label)} <small>({html.escape(str(run.path))})</small></h3>"
                     f"<table>{cells}</table>")
    if len(runs) > 1:
        diff = config_differences(runs)
        head = "".join(f"<th>{html.escape(r.label)}</th>" for r in runs)
        body = "".join(f"<tr><td>{html.escape(k)}</td>" + "".join(f"<td>{html.escape(json.dumps(v))}</td>" for v in vs)
                       + "</tr>" for k, vs in diff.items())
        parts.append(f"<h2>Config differences</h2><details{' open' if len(diff) <= 20 else ''}><summary>"
                     f"{len(diff)} key(s) differ</summary><table><tr><th>key</th>{head}</tr>{body}</table></details>"
                     if diff else "<h2>Config differences</h2><p>none</p>")
    style = ("body{font-family:sans-serif;margin:2em;max-width:1500px} table{border-collapse:collapse;margin-bottom:1em}"
             "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left} figure{display:inline-block;margin:4px}")
    page = out / "report.html"
    page.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>roll report</title>"
                    f"<style>{style}</style></head><body>{''.join(parts)}</body></html>")
    return page
