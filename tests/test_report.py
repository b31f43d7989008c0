"""``roll report``: PNG plots and an HTML page, checked by rendering the page in headless Chromium."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="pip install 'roll-core[report]' (the README's setup does)")

from conftest import write_jsonl  # noqa: E402

from roll_core.cli import main  # noqa: E402
from roll_core.report import config_differences, load_run  # noqa: E402

_BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


def _run(path: Path, rows: list[dict], summary: dict | None = None, config: dict | None = None) -> Path:
    """A run directory with these metrics rows, and a summary and config when given."""
    path.mkdir(parents=True)
    write_jsonl(path / "metrics.jsonl", rows)
    for name, content in (("summary.json", summary), ("config.json", config)):
        if content is not None:
            (path / name).write_text(json.dumps(content))
    return path


def _synthetic_run(path: Path, steps: int = 20) -> Path:
    """A run directory as the runtime writes it, with an async run's metrics and two domains."""
    rows = [{"step": 0, "eval/accuracy": 0.3, "eval/math/accuracy": 0.2, "train/infer_log_prob_gap": 1e-7}]
    for s in range(1, steps + 1):
        rows.append({"step": s, "reward/mean": s / steps, "reward/math/mean": s / steps / 2, "train/kl": 0.01 * s,
                     "train/entropy": 2.0 - 0.05 * s, "train/pg_loss": 0.1 / s, "response_length/mean": 5 + s % 3,
                     "time/step_s": 0.5, "time/rollout_s": 0.3, "rollout/staleness_mean": 0.5,
                     "train/infer_log_prob_gap": 2e-7, "time/nan_s": float("nan")})
    rows[-1].update({"eval/accuracy": 0.9, "eval/math/accuracy": 0.8})
    return _run(path, rows, summary={"steps": steps, "before": {"eval/accuracy": 0.3}, "after": {"eval/accuracy": 0.9},
                                     "restarts": 0},
                config={"seed": 1, "output_dir": str(path), "algorithm": {"lr": 1e-3}})


def test_a_run_is_read_by_metric_and_runs_differ_by_their_config_keys(tmp_path):
    run = load_run(_synthetic_run(tmp_path / "a"))
    assert run.series["eval/accuracy"] == ([0, 20], [0.3, 0.9])
    assert "time/nan_s" not in run.series  # NaN is not a point
    other = _synthetic_run(tmp_path / "b")
    (other / "config.json").write_text(json.dumps({"seed": 2, "output_dir": "x", "algorithm": {"lr": 1e-3}}))
    assert config_differences([run, load_run(other)]) == {"seed": [1, 2]}


def test_report_of_nothing_plottable_or_no_run_is_an_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "custom/x": 1}\n')
    assert main(["report", str(tmp_path)]) == 2
    assert "no plottable metrics" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "metrics.jsonl").mkdir()  # a folder of that name is not a run either
    assert main(["report", str(tmp_path)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


def test_report_overlays_a_real_run_and_another_and_the_page_renders(tiny_config, tmp_path, capsys):
    from roll_core.pipelines.rlvr import RLVRPipeline
    from roll_core.runtime.executor import LocalExecutor

    cfg = tiny_config("trainer.max_steps=4")
    RLVRPipeline(cfg, LocalExecutor()).run()
    synthetic = _synthetic_run(tmp_path / "other")
    out = tmp_path / "compare"
    assert main(["report", cfg.output_dir, str(synthetic), "--out", str(out)]) == 0
    assert "report.html" in capsys.readouterr().out
    pngs = {p.stem for p in out.glob("*.png")}
    assert {"reward", "accuracy", "kl", "entropy", "loss", "response_length", "time", "staleness",
            "mismatch"} <= pngs
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(pngs)  # self-contained: every plot embedded
    assert "Config differences" in page and "<td>seed</td>" in page and page.index("Plots") < page.index("Summary")

    if _BROWSER is None:
        pytest.skip("no Chromium installed (apt-get install chromium); .ci/run installs it")
    from PIL import Image

    shot = tmp_path / "shot.png"
    subprocess.run([_BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1500,4000", (out / "report.html").as_uri()],
                   check=True, capture_output=True, timeout=120)
    image = Image.open(shot).convert("RGB")
    pixels = [image.getpixel((x, y)) for x in range(0, image.width, 2) for y in range(0, image.height, 2)]
    blank = sum(1 for p in pixels if p == (255, 255, 255)) / len(pixels)
    assert blank < 0.97, f"the page rendered {blank:.1%} white"
    # the plotted lines are the page's only coloured pixels (text, axes and grids are grey); a
    # single-run quickstart page of 7 plots has about 8,000 of them at this sampling
    coloured = sum(1 for p in pixels if max(p) - min(p) > 60)
    assert coloured > 3000, coloured


def test_a_reused_folder_keeps_only_this_reports_plots_and_the_count_says_so(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["report", str(_synthetic_run(tmp_path / "full")), "--out", str(out)]) == 0
    assert (out / "staleness.png").exists()
    capsys.readouterr()
    lean = _run(tmp_path / "lean", [{"step": s, "reward/mean": s / 4} for s in range(4)])  # no staleness, KL ... panels
    assert main(["report", str(lean), "--out", str(out)]) == 0
    assert sorted(p.stem for p in out.glob("*.png")) == ["reward"]
    assert "and 1 PNG plots in" in capsys.readouterr().out


def test_without_out_one_run_s_report_goes_into_it_and_several_runs_into_roll_report_here(tmp_path, monkeypatch,
                                                                                            capsys):
    monkeypatch.chdir(tmp_path)
    one = _synthetic_run(tmp_path / "one", steps=4)
    assert main(["report", str(one)]) == 0
    assert (one / "report" / "report.html").exists() and not (tmp_path / "roll-report").exists()
    assert main(["report", str(one), str(_synthetic_run(tmp_path / "two", steps=4))]) == 0
    assert (tmp_path / "roll-report" / "report.html").exists()
    assert capsys.readouterr().out.splitlines()[-1].endswith("PNG plots in roll-report")


@pytest.fixture
def figures(monkeypatch):
    """What each plot drew, by panel name: its title, legend and lines (label, style, marker, x, y)."""
    from matplotlib.figure import Figure

    drawn, save = {}, Figure.savefig

    def record(fig, file, *args, **kwargs):
        (ax,) = fig.axes
        legend = ax.get_legend()
        drawn[Path(file).stem] = {
            "title": ax.get_title(), "legend": [t.get_text() for t in legend.get_texts()] if legend else None,
            "lines": [(line.get_label(), line.get_linestyle(), line.get_marker(), list(line.get_xdata()),
                       list(line.get_ydata())) for line in ax.lines]}
        return save(fig, file, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return drawn


def test_a_panel_draws_the_metrics_its_pattern_matches_whole_and_skips_what_is_not_a_number(tmp_path, figures):
    import matplotlib.pyplot as plt

    from roll_core.report import write_report

    rows = [{"step": s, "train/kl": 0.1 * s, "train/kl_coef": 0.5, "reward/mean": s, "reward/math/mean": 2 * s,
             "reward/mean_raw": 9, "note": "text", "flag": None} for s in range(3)]
    run = _run(tmp_path / "run", rows[:2] + [{}] + rows[2:])  # a blank line in between, as an append may leave
    (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text().replace("{}\n", "\n"))
    write_report([run], tmp_path / "out")
    assert figures["kl"] == {"title": "KL to the reference", "legend": ["train/kl"],
                             "lines": [("train/kl", "-", "o", [0, 1, 2], [0.0, 0.1, 0.2])]}
    assert [line[0] for line in figures["reward"]["lines"]] == ["reward/math/mean", "reward/mean"]
    assert plt.get_fignums() == []  # every figure closed: a report of many runs does not pile them up


def test_several_runs_are_told_apart_by_label_and_line_style_and_long_curves_have_no_markers(tmp_path, figures):
    from roll_core.report import write_report

    long = [{"step": s, "reward/mean": s / 20} for s in range(20)]
    runs = [_run(tmp_path / "a" / "run", long), _run(tmp_path / "b" / "run", long[:3]),
            _run(tmp_path / "c", long[:2])]
    write_report(runs, tmp_path / "out")
    assert [(label, style, marker) for label, style, marker, _, _ in figures["reward"]["lines"]] == [
        ("run (a): reward/mean", "-", "None"), ("run (b): reward/mean", "--", "o"), ("c: reward/mean", ":", "o")]


def test_the_page_embeds_each_plot_and_summarises_each_run(tmp_path):
    import base64
    import re

    from roll_core.report import write_report

    rows = [{"step": s, "reward/mean": s / 3} for s in range(4)]
    full = _run(tmp_path / "full", rows, summary={"restarts": 2, "steps": 3, "before": {"eval/accuracy": 0.123456,
                                                                                        "eval/x<y": 1},
                                                   "converged": True, "note": "x"})
    lean = _run(tmp_path / "le<a>n", rows)  # no summary.json: the steps are the metrics' last
    page = write_report([full, lean], tmp_path / "out").read_text()
    (image,) = re.findall(r'<img alt="Reward of the trained samples" src="data:image/png;base64,([^"]+)">', page)
    assert base64.b64decode(image) == (tmp_path / "out" / "reward.png").read_bytes()
    assert page.startswith("<!doctype html><html><head><meta charset='utf-8'>")
    tables = re.findall(r"<h3>(.*?) <small>.*?</small></h3><table>(.*?)</table>", page)
    assert [(label, re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td></tr>", table)) for label, table in tables] == [
        ("full", [("steps", "3"), ("before.eval/accuracy", "0.1235"), ("before.eval/x&lt;y", "1"), ("restarts", "2")]),
        ("le&lt;a&gt;n", [("steps", "3")])]
    assert "<a>" not in page and "x<y" not in page


def test_config_differences_leave_out_the_run_names_and_show_keys_one_run_lacks(tmp_path):
    import re

    from roll_core.report import write_report

    rows = [{"step": 0, "reward/mean": 0.5}]
    a = _run(tmp_path / "a", rows, config={"seed": 1, "exp_name": "a", "output_dir": "a", "tag": "x"})
    b = _run(tmp_path / "b", rows, config={"seed": 2, "exp_name": "b", "output_dir": "b", "extra": {"k": 1}})
    page = write_report([a, b], tmp_path / "out").read_text()
    body = page[page.index("<h2>Config differences</h2>"):]
    assert body.startswith("<h2>Config differences</h2><details open><summary>3 key(s) differ</summary>")
    assert re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td></tr>", body) == [
        ("extra.k", "null", "1"), ("seed", "1", "2"), ("tag", "&quot;x&quot;", "null")]
    many = [_run(tmp_path / f"m{i}", rows, config={f"k{j}": i for j in range(21)}) for i in range(2)]
    assert "<details><summary>21 key(s) differ" in write_report(many, tmp_path / "out").read_text()
    same = [_run(tmp_path / f"s{i}", rows, config={"seed": 1, "output_dir": str(i)}) for i in range(2)]
    assert "<h2>Config differences</h2><p>none</p>" in write_report(same, tmp_path / "out").read_text()
    assert "Config differences" not in write_report([a], tmp_path / "out").read_text()  # one run: nothing to compare
