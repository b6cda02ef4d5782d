"""The run report and the export, rendered from the stored runs in tests/data/runs (no browser needed)."""

from __future__ import annotations

import base64
import hashlib
import html
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.runs import report
from harness.runs.report import (
    export_run,
    format_value,
    grade,
    load_run,
    render_run_report,
    summary_rows,
)

RUNS = Path(__file__).parent / "data" / "runs"
assert (RUNS / "baseline" / "manifest.json").is_file(), (
    f"{RUNS} is missing: regenerate it with `python tests/data/make_runs.py`, and make sure .gitignore's "
    "`runs/` does not hide it (anchor that rule as `/runs/`)")
XSS = ["<script>alert(1)</script>", '"><img src=x onerror=alert(1)>']


def load_make_runs():
    spec = importlib.util.spec_from_file_location("make_runs", Path(__file__).parent / "data" / "make_runs.py")
    sys.modules.setdefault("make_runs", importlib.util.module_from_spec(spec))  # dataclasses need the module
    spec.loader.exec_module(sys.modules["make_runs"])
    return sys.modules["make_runs"]


@pytest.fixture(scope="module")
def baseline_report(tmp_path_factory) -> Path:
    return render_run_report(RUNS / "baseline", tmp_path_factory.mktemp("report"))


def pages(report: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in report.parent.glob("*.html")}


def test_report_files(baseline_report):
    names = {p.name for p in baseline_report.parent.iterdir()}
    assert baseline_report.name == "index.html"
    assert {"divergence_vs_turn-canary-mla.png", "divergence_vs_context.png", "sensitivity_ranking.png",
            "attention_error.png"} <= names
    assert len([n for n in names if n.startswith("scenario-")]) == 3


def test_default_out_dir_is_inside_the_run(tmp_path):
    run = shutil.copytree(RUNS / "noise", tmp_path / "noise")
    assert render_run_report(run) == run / "report" / "index.html"


def test_model_text_is_escaped(baseline_report):
    chat = next(text for name, text in pages(baseline_report).items() if "chat-xss" in name)
    for raw in XSS:
        assert raw not in chat
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in chat
    assert "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;" in chat


def test_only_the_reports_own_script_may_run(baseline_report):
    for name, text in pages(baseline_report).items():
        scripts = re.findall(r"<script>(.*?)</script>", text, re.DOTALL)
        assert len(scripts) == 1, name
        digest = base64.b64encode(hashlib.sha256(scripts[0].encode()).digest()).decode()
        assert f"script-src 'sha256-{digest}'" in html.unescape(text), name
        assert re.search(r"(src|href)=\"(https?:)?//", text) is None, name  # nothing from the network


def section(index: str, start: str, end: str) -> str:
    at = index.index(start)
    return index[at:index.index(end, at)]


def test_headline_is_the_verdict_matrix_and_lists_every_failing_turn(baseline_report):
    index = pages(baseline_report)["index.html"]
    matrix = section(index, 'id="verdict-matrix"', "</table>")
    cells = dict(re.findall(r'data-path="([^"]+)" title="[^"]*"><b>(\w+)</b>', matrix))
    assert cells == {"bf16": "pass", "fp8_e4m3:per_head:calibrated": "pass", "fp8_e4m3": "fail"}
    failing = section(index, 'id="failing-turns"', "</details>")
    assert "chat-xss-0001</a>" in failing and "recall-0001</a>" in failing  # every failing turn, none cut


def test_summary_grades_with_direction():
    rows = {(r["scenario"], r["path"]): r for r in summary_rows(load_run(RUNS / "baseline"))}
    bf16 = rows[("recall-0001", "bf16")]
    assert bf16["divergence"]["text"] == "none" and bf16["worst"] == "good"
    broken = rows[("recall-0001", "fp8_e4m3")]
    assert broken["cells"]["answer_correct"]["state"] == "bad"
    assert broken["divergence"] == broken["divergence"] | {"turn": 1, "token": 7}
    assert grade("kl_max", 0.6)[0] == "bad" and grade("top1_agree", 0.6)[0] == "bad"
    assert grade("kl_max", 0.01)[0] == "good" and grade("top1_agree", 0.999)[0] == "good"
    assert grade("kl_max", 0.3, {"kl_max": 0.5})[0] == "good"  # the scenario's own threshold wins


def test_a_diverging_bf16_path_is_a_failure(tmp_path):
    make_runs = load_make_runs()
    divergences = make_runs.baseline_divergences() | {("arith-0001", "bf16", 0): make_runs.Divergence(5, " 7.", 0.0)}
    run = make_runs.write_run(tmp_path / "bf16bug", "bf16bug", divergences=divergences)
    row = next(r for r in summary_rows(load_run(run)) if (r["scenario"], r["path"]) == ("arith-0001", "bf16"))
    assert row["worst"] == "bad" and row["divergence"]["state"] == "bad"


def test_interrupted_run_renders_what_is_stored(tmp_path):
    run = shutil.copytree(RUNS / "baseline", tmp_path / "cut")
    manifest = (run / "manifest.json").read_text().replace('"complete"', '"interrupted"')
    (run / "manifest.json").write_text(manifest)
    with open(run / "records.jsonl", "a") as handle:
        handle.write('{"model": "canary-mla", "scen')  # killed mid-line
    index = render_run_report(run, tmp_path / "out").read_text()
    assert "This run is interrupted" in index


def test_export_csv(tmp_path):
    out = export_run(RUNS / "baseline", "csv", tmp_path)
    table = pd.read_csv(out)
    assert out == tmp_path / "records.csv"
    assert list(table.columns[:4]) == ["run_id", "model", "scenario", "scenario_hash"]
    assert len(table) == len(load_run(RUNS / "baseline").records)


def test_export_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "pyarrow_available", lambda: False)
    with pytest.raises(RuntimeError, match="pip install pyarrow"):
        export_run(RUNS / "baseline", "parquet", tmp_path / "r.parquet")


def test_export_parquet_round_trip(tmp_path):
    pytest.importorskip("pyarrow", reason="parquet export needs pyarrow (pip install pyarrow)")
    out = export_run(RUNS / "baseline", "parquet", tmp_path / "r.parquet")
    assert len(pd.read_parquet(out)) == len(load_run(RUNS / "baseline").records)


def test_export_rejects_unknown_format(tmp_path):
    with pytest.raises(ValueError, match="'xlsx'"):
        export_run(RUNS / "baseline", "xlsx", tmp_path)


@pytest.mark.parametrize("value, text", [(None, "—"), (float("nan"), "—"), (float("inf"), "inf"), (3.0, "3"),
                                         (0.01234, "0.012"), (2.5e-5, "2.5e-05")])
def test_format_value(value, text):
    assert format_value(value) == text


# ---------------------------------------------------------------- issue 16

import json
import math

import matplotlib.pyplot as plt

from harness.runs.compare import compare_runs, metric_rows
from harness.runs.report import readable
from reports import plots


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_test_runs_use_the_files_and_fields_a_real_run_writes():
    """tests/data/runs/real comes from an actual `harness run` (tests/data/make_real_run.py); the synthetic
    runs must not name a file or a field the real writer does not, or the reader is tested on a fiction."""
    real = {p.name for p in (RUNS / "real").iterdir()}
    # written only when there is something to write (no scenario thresholds, no errors in the real run):
    # their fields are checked against docs/CONTRACTS.md instead
    contract = (Path(__file__).parents[1] / "docs" / "CONTRACTS.md").read_text()
    documented = {name: set(re.findall(r'"(\w+)"', re.search(rf"`{name}`: [^\n]*", contract).group(0)))
                  for name in ("checks.jsonl", "errors.jsonl")}
    for run in ("baseline", "noise", "regressed"):
        files = {p.name for p in (RUNS / run).iterdir()}
        assert files - real <= set(documented), files - real
        for name in files - {"manifest.json"}:
            real_keys = (set().union(*[row.keys() for row in jsonl(RUNS / "real" / name)] or [set()])
                         if name in real else documented[name])
            keys = set().union(*[row.keys() for row in jsonl(RUNS / run / name)] or [set()])
            assert keys <= real_keys, (run, name, keys - real_keys)
    assert len(load_run(RUNS / "real").judges) == len(jsonl(RUNS / "real" / "judgements.jsonl")) > 0


def test_judge_reasons_of_a_real_run_reach_its_scenario_pages(tmp_path):
    index = render_run_report(RUNS / "real", tmp_path)
    text = "\n".join(html.unescape(p.read_text()) for p in index.parent.glob("scenario-*.html"))
    reasons = {r["reason"] for r in jsonl(RUNS / "real" / "judgements.jsonl") if r.get("reason")}
    assert reasons and all(reason in text for reason in reasons)


def inf_records() -> pd.DataFrame:
    """Two models; one path's KL is inf on every turn (its only positive values), one metric only NaN."""
    rows = []
    for model in ("gqa", "mla"):
        for path, kl in (("bf16", 0.0), ("fp8_e4m3", math.inf), ("fp8_e5m2", 1e-5)):
            for kind, turns in (("chat", 3), ("arithmetic", 1)):
                for turn in range(turns):
                    base = {"model": model, "scenario": f"{kind}-1", "scenario_hash": kind, "kind": kind,
                            "tags": [], "path": path, "turn": turn}
                    rows += [base | {"metric": "kl_mean", "value": kl},
                             base | {"metric": "context_tokens", "value": 50.0 + 20 * turn},
                             base | {"metric": "answer_correct", "value": float(kl < 1)},
                             base | {"metric": "attn_out_rel_err", "value": math.nan if kl else 0.0}]
    return pd.DataFrame(rows)


def test_plots_survive_inf_and_nan_and_say_so(tmp_path):
    records = inf_records()
    only_inf = records[(records.metric == "kl_mean") & (records.path == "fp8_e4m3")].copy()
    figures = plots.run_plots(records, tmp_path, ["bf16", "fp8_e4m3", "fp8_e5m2"])
    figures += plots.run_plots(only_inf, tmp_path / "only-inf" if (tmp_path / "only-inf").mkdir() is None else None,
                               ["fp8_e4m3"])
    figures += plots.compare_plots(records, only_inf, tmp_path, ["bf16", "fp8_e4m3"], ("a", "b"))
    by_file = {f["file"]: f for f in figures}
    for name in ("divergence_vs_turn-gqa.png", "sensitivity_ranking.png", "compare_by_turn.png",
                 "compare_sensitivity.png"):
        assert "inf" in by_file[name]["texts"], name  # drawn and labelled, never dropped
    assert all(f["outside"] == [] for f in figures), [f["outside"] for f in figures]
    assert all((tmp_path / f["file"]).is_file() or (tmp_path / "only-inf" / f["file"]).is_file() for f in figures)


def test_outside_boxes_sees_a_legend_cut_off():
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1], label="a long legend entry that will not fit")
    ax.legend(loc="center right", bbox_to_anchor=(-0.2, 0.5))
    assert plots.outside_boxes(fig)
    ax.legend(loc="upper left")
    assert plots.outside_boxes(fig) == []
    plt.close(fig)


def test_log_axes_label_their_ticks_in_plain_text(monkeypatch):
    """`plots.log_scale`: the labels matplotlib's log and symlog axes choose, in plain text (no mathtext to parse
    at every layout), the decades, coefficients and negative values among them; a label plain
    text cannot write (a fractional exponent) stays mathtext."""
    import matplotlib.ticker

    fig, (sym, narrow) = plt.subplots(1, 2)
    plots.log_scale(sym.yaxis, "symlog", linthresh=1e-4)
    sym.set_ylim(-1, 1)
    plots.log_scale(narrow.xaxis, "log")
    narrow.set_xlim(2e-3, 8e-3)   # under a decade: the minor ticks are labelled too
    fig.canvas.draw()
    labels = {t.get_text() for axis in (sym.yaxis, narrow.xaxis) for t in axis.get_ticklabels(which="both")} - {""}
    assert {"0", "10⁻⁴", "10⁻²", "10⁰", "−10⁻¹", "2×10⁻³", "6×10⁻³"} <= labels, labels
    assert not any("$" in label for label in labels), labels
    plt.close(fig)
    assert plots.PlainLogFormatter(base=10)(10 ** 0.5) == "3.16228×10⁰"
    fractional = r"$\mathdefault{10^{0.50}}$"
    monkeypatch.setattr(matplotlib.ticker.LogFormatterSciNotation, "__call__", lambda self, x, pos=None: fractional)
    assert plots.PlainLogFormatter(base=10)(10 ** 0.5) == fractional


def test_kl_bars_show_small_values_at_their_size_and_colour_by_verdict(tmp_path):
    records = inf_records()
    verdicts = [{"model": m, "scenario": "chat-1", "path": p, "turn": 0, "reasons": [],
                 "verdict": {"bf16": "pass", "fp8_e4m3": "fail", "fp8_e5m2": "pass"}[p]}
                for m in ("gqa", "mla") for p in ("bf16", "fp8_e4m3", "fp8_e5m2")]
    table = plots.sensitivity_table(records, verdicts)
    assert list(table["verdict"].iloc[-2:]) == ["fail", "fail"]  # the most sensitive on top, failing
    figure = plots.sensitivity_ranking(records, tmp_path, verdicts)
    assert "1e-05" in figure["texts"] and "0" in figure["texts"] and "inf" in figure["texts"]


def test_compare_says_inconclusive_with_the_scenarios_and_the_sample_size():
    result = compare_runs(RUNS / "baseline", RUNS / "regressed", n_boot=500)
    rows = {(r["path"], r["metric"]): r for r in metric_rows(result.metrics, result.pairs)}
    kl = rows[("fp8_e4m3:per_head:calibrated", "kl_mean")]
    assert kl["flag"] == "inconclusive (n=3)" and kl["changed"]
    assert re.fullmatch(r"about \d+ scenarios at this spread", kl["needed"])
    assert kl["evidence"][0]["scenario"] == "recall-0001" and kl["evidence"][0]["worse"]
    assert all(r["flag"] in ("within noise", "unchanged") for r in rows.values() if not r["changed"])
    quiet = compare_runs(RUNS / "baseline", RUNS / "noise", n_boot=500)
    assert not [r for r in metric_rows(quiet.metrics, quiet.pairs) if r["flag"].startswith("inconclusive")
                and r["path"] == "bf16"]


def test_manifest_values_read_as_text_not_json():
    assert readable({"source": "calibrated", "layers": [0, 1, 2, 3], "k_scale": {"max": 0.5}}) == \
        "source: calibrated; layers: 0–3 (4); k_scale: max: 0.500"
    assert readable(["a", "b"]) == "a, b" and readable(None) == "—"


def test_fp8_divergence_informs_and_only_bf16_divergence_is_red():
    rows = {(r["scenario"], r["path"]): r for r in summary_rows(load_run(RUNS / "baseline"))}
    assert rows[("recall-0001", "fp8_e4m3")]["divergence"]["state"] == "none"
    assert rows[("recall-0001", "fp8_e4m3")]["worst"] == "bad"  # the verdict colours the row


def test_matrix_cells_answer_both_questions_and_name_what_was_not_answered(baseline_report):
    """Each cell shows both questions; the baseline ran no yardstick path, so the per-path section says the
    "acceptable" question was judged on absolute defaults only, naming the yardstick it lacked."""
    index = pages(baseline_report)["index.html"]
    matrix = section(index, 'id="verdict-matrix"', "</table>")
    assert matrix.count("implementation right?") == 3 and matrix.count("precision acceptable?") == 3
    checks = section(index, 'id="path-check-table"', "</table>")
    assert "not answered" in checks and "no yardstick path fp8_e4m3:calibrated" in checks


def test_strata_table_bins_divergence_by_context_position(baseline_report):
    strata = section(pages(baseline_report)["index.html"], 'id="strata-table"', "</table>")
    assert "context position" in strata and "fp8_e4m3" in strata


def test_kl_by_reply_position_is_drawn_beside_the_strata_table_with_the_trend_test(baseline_report):
    index = pages(baseline_report)["index.html"]
    assert (baseline_report.parent / "kl_by_generation_position.png").exists()
    length = section(index, 'id="length"', "</details>")
    assert "kl_by_generation_position.png" in length and 'id="length-trend-table"' in length
    assert "canary-mla" in section(length, 'id="length-strata-table"', "</table>")
    assert index.index('id="strata-table"') < index.index('id="length"') < index.index('id="kv"')


def test_the_report_names_layers_kept_in_bf16_and_what_a_family_turns_off():
    """manifest.families (replay/families.py) becomes one row per model in the report's manifest section."""
    from harness.runs.report import families_view

    rows = families_view({"gemma": {"family": "gemma2", "attention": ["GQA", "SWA", "softcap"], "fp8_layers": [0, 1],
                                    "kept_bf16": {"2": "listed in the path's :layers= map"},
                                    "decode_kernels": "off: logit soft-capping (50.0)"}})
    assert rows == [{"model": "gemma", "family": "gemma2", "attention": "GQA, SWA, softcap", "fp8_layers": "0, 1",
                     "kept_bf16": "layer 2: listed in the path's :layers= map",
                     "off": "decode kernels: off: logit soft-capping (50.0)"}]


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_figures_drawn_by_worker_processes_are_the_ones_drawn_inline(tmp_path, monkeypatch):
    """`FigureWorkers` draw the figures in processes of their own, one figure a request dealt round the workers,
    while the pages are written here (the CLI's run and report commands, on 4 cores or more): every file of the
    report, PNGs included, is the inline rendering's, byte for byte. A worker answers several requests in turn. A
    worker that dies costs only time: its figures are drawn here instead, the same files."""
    from harness.runs import figure_worker

    seen = []  # per figure: (handed to a worker, drawn inline)
    real_drawn = figure_worker.drawn

    def spy(pending, inline):
        inline_calls = []
        figures = real_drawn(pending, lambda: inline_calls.append(1) or inline())
        seen.append((pending is not None, bool(inline_calls)))
        return figures

    monkeypatch.setattr(figure_worker, "drawn", spy)
    inline = render_run_report(RUNS / "baseline", tmp_path / "inline").parent
    calls = len(seen)
    assert calls >= 4 and seen == [(False, True)] * calls
    pool = figure_worker.FigureWorkers(2)
    try:
        seen.clear()
        drawn = render_run_report(RUNS / "baseline", tmp_path / "workers", figure_worker=pool).parent
        assert _files(drawn) == _files(inline) and any(name.endswith(".png") for name in _files(drawn))
        assert seen == [(True, False)] * calls
        pool.workers[1].process.kill()
        pool.workers[1].process.wait()
        seen.clear()
        pool.turn = 0
        half = render_run_report(RUNS / "baseline", tmp_path / "half", figure_worker=pool).parent
        assert _files(half) == _files(inline)
        assert seen == [(True, False) if i % 2 == 0 else (False, True) for i in range(calls)]  # worker 1 dead
    finally:
        pool.close()


def test_a_report_whose_figures_workers_draw_imports_no_matplotlib_here(tmp_path):
    """Importing matplotlib took 0.33 s of the report's process after a default CUDA run (an H200 box, session 36):
    where workers draw every figure, the process writing the pages does not import it."""
    import subprocess

    code = ("import sys\nfrom harness.runs import figure_worker\nfrom harness.runs.report import render_run_report\n"
            "pool = figure_worker.FigureWorkers(1)\n"
            f"render_run_report({str(RUNS / 'baseline')!r}, {str(tmp_path / 'report')!r}, figure_worker=pool)\n"
            "pool.close()\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
    assert _files(tmp_path / "report") == _files(render_run_report(RUNS / "baseline", tmp_path / "inline").parent)


def test_a_silent_figure_worker_is_killed_and_the_figures_drawn_inline(tmp_path, monkeypatch):
    """A worker that answers nothing within ANSWER_TIMEOUT_S (here 1 s) is killed before the figures are drawn here,
    so no figure file is written by both."""
    from harness.runs import figure_worker

    monkeypatch.setattr(figure_worker, "ANSWER_TIMEOUT_S", 1.0)
    monkeypatch.setattr(figure_worker, "SERVE", "import time; time.sleep(600)")  # reads nothing, answers nothing
    worker = figure_worker.FigureWorker()
    try:
        silent = render_run_report(RUNS / "baseline", tmp_path / "silent", figure_worker=worker).parent
        assert worker.process.poll() is not None  # killed
    finally:
        worker.close()
    assert _files(silent) == _files(render_run_report(RUNS / "baseline", tmp_path / "inline").parent)


def test_a_script_without_a_main_guard_runs_once_with_a_figure_worker(tmp_path):
    """The worker is a plain `python -c` child, not a spawned pool: a spawned child imports the parent's __main__
    again, so a user's script calling `main` without an `if __name__ == "__main__"` guard ran twice."""
    import subprocess

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from pathlib import Path\n"
        "from harness.cli import main\n"
        "from harness.runs import figure_worker\n"
        f"with open({str(tmp_path / 'ran')!r}, 'a') as f:\n"
        "    f.write('ran\\n')\n"
        "figure_worker.MIN_CORES = 1\n"
        f"assert main(['report', {str(RUNS / 'baseline')!r}, '--out', {str(tmp_path / 'report')!r}]) == 0\n")
    subprocess.run([sys.executable, str(script)], check=True, capture_output=True, timeout=300,
                   cwd=Path(__file__).parent.parent)
    assert (tmp_path / "ran").read_text() == "ran\n" and (tmp_path / "report" / "index.html").is_file()


@pytest.mark.parametrize("cores, workers", [(3, 0), (4, 1), (9, 2), (64, 4)])  # MIN_CORES 4 each, MAX_WORKERS 4
def test_figure_workers_start_only_with_cores_to_spare(monkeypatch, cores, workers):
    from harness.runs import figure_worker

    assert (figure_worker.MIN_CORES, figure_worker.MAX_WORKERS) == (4, 4)
    monkeypatch.setattr(figure_worker, "usable_cores", lambda: cores)
    pool = figure_worker.FigureWorkers.start()
    try:
        assert (len(pool.workers) if pool is not None else 0) == workers
    finally:
        if pool is not None:
            pool.close()
