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
from harness.runs.report import export_run, format_value, grade, load_run, render_run_report, summary_rows

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
    assert {"divergence_vs_turn.png", "divergence_vs_context.png", "sensitivity_ranking.png",
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
        scripts = re.findall(r"<script>(.*?)</script>", text, re.S)
        assert len(scripts) == 1, name
        digest = base64.b64encode(hashlib.sha256(scripts[0].encode()).digest()).decode()
        assert f"script-src 'sha256-{digest}'" in html.unescape(text), name
        assert re.search(r"(src|href)=\"(https?:)?//", text) is None, name  # nothing from the network


def test_headline_names_the_failing_cells(baseline_report):
    index = pages(baseline_report)["index.html"]
    headline = index[index.index('id="headline"'):index.index("</div>", index.index('id="headline"'))]
    assert "chat-xss-0001</a> on <b>fp8_e4m3</b>" in headline
    assert "recall-0001</a> on <b>fp8_e4m3</b>" in headline
    assert "fp8_e4m3:per_head:calibrated" not in headline


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
