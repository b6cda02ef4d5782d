"""Compare logic on stored runs (tests/data/runs) and on runs constructed with tests/data/make_runs.py."""

from __future__ import annotations

import html
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest

from harness.runs.compare import compare_runs, parse_threshold, parse_thresholds

DATA = Path(__file__).parent / "data"
RUNS = DATA / "runs"
assert (RUNS / "baseline" / "manifest.json").is_file(), (
    f"{RUNS} is missing: regenerate it with `python tests/data/make_runs.py`, and make sure .gitignore's "
    "`runs/` does not hide it (anchor that rule as `/runs/`)")
N_BOOT = 1000  # enough for stable percentile bounds on these small runs, and fast


def load_make_runs():
    spec = importlib.util.spec_from_file_location("make_runs", DATA / "make_runs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_runs", module)  # dataclasses look their module up while being built
    spec.loader.exec_module(sys.modules["make_runs"])
    return sys.modules["make_runs"]


@pytest.fixture(scope="module")
def make_runs():
    return load_make_runs()


@pytest.fixture(scope="module")
def wide_runs(tmp_path_factory, make_runs):
    """12 one-turn scenarios: a baseline, a noisy copy, and a copy whose calibrated path got 60% worse."""
    root = tmp_path_factory.mktemp("wide")
    scenarios = make_runs.many_arithmetic(12)
    cal = "fp8_e4m3:per_head:calibrated"
    return {
        "a": make_runs.write_run(root / "a", "a", scenarios, divergences={}),
        "noise": make_runs.write_run(root / "noise", "noise", scenarios, divergences={}, jitter=0.3, seed=3),
        "shifted": make_runs.write_run(root / "shifted", "shifted", scenarios, divergences={},
                                       base_kl={cal: make_runs.PATHS[cal][2] * 8}),
        "nudged": make_runs.write_run(root / "nudged", "nudged", scenarios, divergences={},
                                      base_kl={cal: make_runs.PATHS[cal][2] * 1.6}),
    }


def test_identical_runs_do_not_regress():
    result = compare_runs(RUNS / "baseline", RUNS / "baseline", n_boot=N_BOOT)
    assert not result.regressed, result.summary_line
    assert result.summary_line.startswith("OK")
    assert (result.pairs["delta"].fillna(0) == 0).all()
    assert result.unpaired.empty
    assert len(result.with_status("unchanged failure")) == 4  # fp8_e4m3 (default scale) fails in both


def test_planted_regression_in_one_scenario_is_flagged():
    result = compare_runs(RUNS / "baseline", RUNS / "regressed", n_boot=N_BOOT)
    assert result.regressed
    assert result.summary_line.startswith("REGRESSION")
    new = result.with_status("new failure")
    assert set(zip(new.scenario, new.path, new.turn)) >= {("recall-0001", "fp8_e4m3:per_head:calibrated", 2)}
    assert "answer_correct 0" in new.set_index("turn").loc[2, "fail_b"]
    cases = result.regressed_cases()
    case = next(c for c in cases if c["turn"] == 2)
    assert case["diverged_at"] == 0  # "Your name ..." against "I'm sorry ..."
    assert [t["text"] for t in case["tokens_b"] if t["mark"] == "first-div"] == ["I"]


def test_delta_threshold_flags_the_metric():
    result = compare_runs(RUNS / "baseline", RUNS / "regressed", thresholds=["kl_max:+0.02"], n_boot=N_BOOT)
    flagged = result.regressed_metrics
    assert ("fp8_e4m3:per_head:calibrated", "kl_max") in set(zip(flagged.path, flagged.metric))
    assert "kl_max:+0.02" in flagged.set_index("metric").loc["kl_max", "threshold_crossed"]


def test_noise_within_the_interval_is_not_flagged():
    result = compare_runs(RUNS / "baseline", RUNS / "noise", n_boot=N_BOOT)
    assert not result.regressed, result.summary_line
    assert (result.pairs.loc[result.pairs.metric == "kl_mean", "delta"].abs() > 0).any()  # there is noise


def test_bootstrap_keeps_symmetric_noise_unflagged(wide_runs):
    # rel_tol=0: only the interval stands between 30% per-token noise and a false alarm
    result = compare_runs(wide_runs["a"], wide_runs["noise"], n_boot=N_BOOT, rel_tol=0.0)
    assert not result.regressed, result.summary_line
    kl = result.metrics.set_index(["path", "metric"]).loc[("fp8_e4m3:per_head:calibrated", "kl_mean")]
    assert kl["ci_low"] <= 0 <= kl["ci_high"]


def test_bootstrap_flags_a_systematic_shift(wide_runs):
    result = compare_runs(wide_runs["a"], wide_runs["shifted"], n_boot=N_BOOT)
    assert result.regressed
    flagged = result.metrics[result.metrics.ci_regressed]
    assert set(flagged.path) == {"fp8_e4m3:per_head:calibrated"}
    assert {"kl_mean", "kl_max"} <= set(flagged.metric)
    assert result.with_status("new failure").empty  # the interval alone caught it


def test_a_shift_within_the_healthy_spread_is_not_a_regression(wide_runs):
    """KL 0.004 -> 0.0064 per token: consistent, but smaller than healthy paths already differ by
    (HEALTHY_SPREAD), so the tolerance keeps it from flagging."""
    result = compare_runs(wide_runs["a"], wide_runs["nudged"], n_boot=N_BOOT)
    kl = result.metrics.set_index(["path", "metric"]).loc[("fp8_e4m3:per_head:calibrated", "kl_mean")]
    assert kl["delta"] > 0 and kl["tolerance"] >= 0.0108 and not kl["regressed"]


def _only_paths(source: Path, target: Path, keep: set[str]) -> Path:
    """A copy of a stored run holding only the reference and the `keep` paths (as a bf16-only baseline would)."""
    target.mkdir()
    for table in source.iterdir():
        if table.suffix != ".jsonl":
            (target / table.name).write_bytes(table.read_bytes())
            continue
        rows = [json.loads(line) for line in table.read_text().splitlines() if line.strip()]
        kept = [r for r in rows if r.get("path") in keep | {"reference", None}]
        (target / table.name).write_text("".join(json.dumps(r) + "\n" for r in kept))
    return target


def test_a_path_new_in_b_is_judged_by_its_own_verdicts(tmp_path):
    """A bf16-only baseline cannot hide a broken new path: B's fp8_e4m3 fails its verdicts -> regression."""
    bf16_only = _only_paths(RUNS / "baseline", tmp_path / "bf16", {"bf16"})
    result = compare_runs(bf16_only, RUNS / "baseline", n_boot=N_BOOT)
    assert result.regressed and "fp8_e4m3" in result.new_paths
    new = result.with_status("new failure")
    assert set(new.path) == {"fp8_e4m3"}  # the healthy calibrated path is new too, and passes
    assert "new in B (judged by its own verdicts)" in result.summary_line
    healthy_only = _only_paths(RUNS / "baseline", tmp_path / "healthy", {"bf16", "fp8_e4m3:per_head:calibrated"})
    assert not compare_runs(bf16_only, healthy_only, n_boot=N_BOOT).regressed


def test_a_path_missing_from_b_is_a_regression(tmp_path):
    bf16_only = _only_paths(RUNS / "baseline", tmp_path / "bf16", {"bf16"})
    result = compare_runs(RUNS / "baseline", bf16_only, n_boot=N_BOOT)
    assert result.regressed and set(result.missing_paths) == {"fp8_e4m3", "fp8_e4m3:per_head:calibrated"}
    assert "not run in B" in result.summary_line


def test_renamed_scenario_pairs_by_hash_and_missing_ones_are_listed(tmp_path, make_runs):
    scenarios = make_runs.base_scenarios()
    renamed = [make_runs.Scenario("arith-renamed", s.kind, s.turns, s.system, s.ends_with, s.tags)
               if s.id == "arith-0001" else s for s in scenarios if s.id != "recall-0001"]
    a = make_runs.write_run(tmp_path / "a", "a", scenarios)
    b = make_runs.write_run(tmp_path / "b", "b", renamed)
    result = compare_runs(a, b, n_boot=N_BOOT)
    assert "arith-renamed" in set(result.pairs.scenario_b)
    assert set(result.unpaired.scenario) == {"recall-0001"}
    assert set(result.unpaired.side) == {"only in A"}
    assert not result.regressed


def test_regressed_model_text_is_escaped_in_the_compare_page(tmp_path, make_runs):
    # the turn's KL is inf: a new failure (one lost rule alone is no finding since issue 40), so its text is shown
    chat = {("chat-xss-0001", "fp8_e4m3:per_head:calibrated", 2): make_runs.Divergence(9, " <b>Worce</b>!!!", math.inf)}
    run = make_runs.write_run(tmp_path / "chat", "chat", divergences=make_runs.baseline_divergences() | chat)
    result = compare_runs(RUNS / "baseline", run, out_dir=tmp_path / "out", n_boot=N_BOOT)
    page = (tmp_path / "out" / "compare.html").read_text()
    assert result.regressed
    shown = html.unescape(re.sub(r"<[^>]+>", "", page))  # the text a reader sees, tokens joined
    assert "<b>Worce" not in page and " <b>Worce</b>!!!" in shown
    assert "<script>alert" not in page and "<script>alert(1)</script>" in shown


def test_render_writes_a_page_with_the_summary(tmp_path):
    result = compare_runs(RUNS / "baseline", RUNS / "regressed", out_dir=tmp_path, n_boot=N_BOOT)
    page = (tmp_path / "compare.html").read_text()
    assert result.report_path == tmp_path / "compare.html"
    assert "REGRESSION" in page and "new failure" in page
    assert "<script>alert(1)</script>" not in page
    assert (tmp_path / "compare_by_turn.png").stat().st_size > 1000


@pytest.mark.parametrize("spec, metric, value, relative", [
    ("kl_max:+0.02", "kl_max", 0.02, True),
    ("top1_agree:-0.05", "top1_agree", -0.05, True),
    ("kl_mean:0.05", "kl_mean", 0.05, False),
    ("judge_rule:4", "judge_rule", 4.0, False),
])
def test_parse_threshold(spec, metric, value, relative):
    parsed = parse_threshold(spec)
    assert (parsed.metric, parsed.value, parsed.relative) == (metric, value, relative)


@pytest.mark.parametrize("spec, message", [
    ("kl_max", "expected METRIC:VALUE"),
    ("kl_max:lots", "not a number"),
    ("kl_maxx:+0.1", "unknown metric 'kl_maxx'"),
    ("kl_max:nan", "finite"),
])
def test_parse_threshold_errors_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_threshold(spec)


def test_thresholds_direction_and_kind():
    kl, top1, absolute = parse_thresholds({"kl_max": "+0.02", "top1_agree": "+0.05", "kl_mean": 0.05})
    assert kl.crossed(0.10, 0.13) and not kl.crossed(0.10, 0.11)
    assert top1.crossed(0.99, 0.90) and not top1.crossed(0.90, 0.99)  # the sign marks a delta; bad way is down
    assert absolute.crossed(math.nan, 0.06) and not absolute.crossed(math.nan, 0.04)


def test_inf_and_torn_lines_load(tmp_path, make_runs):
    run = make_runs.write_run(tmp_path / "inf", "inf")
    records = (run / "records.jsonl").read_text().splitlines()
    row = json.loads(records[-1]) | {"metric": "kl_max", "value": None, "value_text": "inf"}
    (run / "records.jsonl").write_text("\n".join(records + [json.dumps(row)]) + '\n{"model": "cut')
    result = compare_runs(RUNS / "baseline", run, n_boot=N_BOOT)
    assert math.isinf(result.run_b.records.value.max())


def test_a_question_newly_failed_in_b_is_a_regression_named_by_question(tmp_path):
    """B's verdict rows fail the implementation question on one turn of a path A passed: compare lists both
    questions A -> B per path and counts the newly failed one as a regression, whatever the intervals say."""
    import shutil

    b = tmp_path / "b"
    shutil.copytree(RUNS / "baseline", b)
    rows = [json.loads(line) for line in (b / "verdicts.jsonl").read_text().splitlines()]
    hit = next(r for r in rows if r["path"] == "fp8_e4m3:per_head:calibrated")
    hit.update(verdict="fail", questions={"implementation": "fail", "acceptable": "pass"},
               reasons=[{"check": "nonfinite", "metric": "kl_mean", "value": None, "limit": None, "source": "default",
                         "severity": "fail", "message": "kl_mean is nan", "question": "implementation"}])
    (b / "verdicts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = compare_runs(RUNS / "baseline", b, out_dir=tmp_path / "out", n_boot=N_BOOT)
    assert [(q["path"], q["new_failures"]) for q in result.new_question_failures] == \
        [("fp8_e4m3:per_head:calibrated", ["implementation right?"])]
    assert result.regressed and "newly fail a verdict question" in result.summary_line
    table = (tmp_path / "out" / "compare.html").read_text()
    assert 'id="question-table"' in table and "pass → <b>fail</b>" in table
    unchanged = compare_runs(RUNS / "baseline", RUNS / "baseline", n_boot=N_BOOT)
    assert not unchanged.new_question_failures


def killed_copy(source: Path, run: Path, units_done: int) -> Path:
    """`source` as a run killed (SIGKILL) after `units_done` units: status still `running`, the rest missing."""
    import shutil

    shutil.copytree(source, run)
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps(manifest | {"status": "running", "finished_at": None}))
    done = [json.loads(line) for line in (run / "done.jsonl").read_text().splitlines()][:units_done]
    kept = {(d["model"], d["scenario"], d["path"]) for d in done}
    for table in ("done", "records", "series", "texts", "checks", "verdicts"):
        if (run / f"{table}.jsonl").exists():
            rows = [json.loads(line) for line in (run / f"{table}.jsonl").read_text().splitlines() if line.strip()]
            rows = [r for r in rows if (r.get("model"), r.get("scenario"), r.get("path")) in kept]
            (run / f"{table}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


@pytest.mark.parametrize("killed_side", ["b", "a"])
def test_compare_refuses_an_incomplete_run_with_exit_3(tmp_path, capsys, killed_side):
    """A run killed after 3 of its 12 units is no evidence of "no regression": exit 3, naming the run and the
    units it has."""
    from harness.cli import main

    killed = killed_copy(RUNS / "baseline", tmp_path / "killed", units_done=3)
    runs = [RUNS / "baseline", killed] if killed_side == "b" else [killed, RUNS / "baseline"]
    assert main(["compare", *map(str, runs), "--out", str(tmp_path / "out")]) == 3
    printed = capsys.readouterr()
    assert "OK" not in printed.out and "Traceback" not in printed.err
    assert str(killed) in printed.err and "3 of 12 units" in printed.err and "running" in printed.err
