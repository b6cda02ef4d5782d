"""Default verdicts: each check on plain rows, the precedence of limits, the stored table, and the exit code of
`harness run` on the real canaries with a healthy and a known-bad path."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from harness.analysis.verdicts import (
    DEFAULT_THRESHOLDS,
    compute_verdicts,
    diagnosis,
    failing_paths,
    parse_threshold_overrides,
    verdict_matrix,
)
from harness.cli import main
from harness.runs.gate import run_matrix, run_verdicts

ROOT = Path(__file__).resolve().parents[1]
CANARY = ROOT / "harness" / "canary" / "weights"


def rec(metric, value, path="fp8_e4m3", turn=0, scenario="s1", model="m", text=None) -> dict:
    row = {"model": model, "scenario": scenario, "path": path, "turn": turn, "metric": metric, "value": value}
    if text is not None:
        row.update(value=None, value_text=text)
    return row


def healthy(path="fp8_e4m3", turn=0, **extra) -> list[dict]:
    values = {"kl_max": 1e-4, "kl_mean": 1e-5, "answer_correct": 1.0} | extra
    return [rec(m, v, path, turn) for m, v in values.items()] + [rec("answer_correct", 1.0, "reference", turn)]


def only(rows: list[dict]) -> dict:
    assert len(rows) == 1, rows
    return rows[0]


def test_healthy_turn_passes_with_no_reasons():
    row = only(compute_verdicts(healthy()))
    assert (row["verdict"], row["reasons"]) == ("pass", [])
    assert set(row) == {"model", "scenario", "path", "turn", "verdict", "reasons"}


def test_task_check_fails_only_when_the_reference_passed():
    assert only(compute_verdicts(healthy(answer_correct=0.0)))["verdict"] == "fail"
    both_wrong = [r for r in healthy(answer_correct=0.0) if r["path"] != "reference"] + \
        [rec("answer_correct", 0.0, "reference")]
    assert only(compute_verdicts(both_wrong))["verdict"] == "pass"


@pytest.mark.parametrize("kl_max, verdict", [(0.2, "pass"), (0.5, "warn"), (1.5, "fail")])
def test_divergence_thresholds_warn_then_fail(kl_max, verdict):
    row = only(compute_verdicts(healthy(kl_max=kl_max)))
    assert row["verdict"] == verdict
    if verdict != "pass":
        reason = only(row["reasons"])
        assert (reason["check"], reason["metric"], reason["source"]) == ("divergence", "kl_max", "default")
        assert "threshold from default" in reason["message"]


def test_every_default_names_its_measurement_and_sits_above_the_healthy_max():
    for threshold in DEFAULT_THRESHOLDS:
        assert "max" in threshold.measured and "healthy" in threshold.measured
    # the largest healthy values measured on the canaries (see the table): they must pass by default
    assert only(compute_verdicts(healthy(kl_max=0.238, kl_mean=0.190)))["verdict"] == "pass"


def test_non_finite_values_fail():
    rows = healthy() + [rec("kl_mean", None, text="nan")]
    rows = [r for r in rows if not (r["metric"] == "kl_mean" and r.get("value") == 1e-5)]
    reason = only(only(compute_verdicts(rows))["reasons"])
    assert (reason["check"], reason["metric"], reason["severity"]) == ("nonfinite", "kl_mean", "fail")
    assert only(compute_verdicts(healthy(kv_nonfinite=3.0)))["verdict"] == "fail"


def judgement(findings, path="fp8_e4m3") -> dict:
    return {"model": "m", "scenario": "s1", "path": path, "turn": 0, "metric": "judge_rule",
            "detail": {"findings": findings}}


def test_degenerate_output_against_the_reference():
    loop = judgement(["repetition loop: 'ab' x9 (18 chars from 3)"])
    assert only(compute_verdicts(healthy(), judgements=[loop]))["verdict"] == "fail"
    eos = judgement(["early EOS: EOS after 5 token(s), the reference wrote 40"])
    assert only(compute_verdicts(healthy(), judgements=[eos]))["verdict"] == "warn"
    shared = [loop, judgement(["repetition loop: 'ab' x9 (18 chars from 3)"], "reference")]
    assert only(compute_verdicts(healthy(), judgements=shared))["verdict"] == "pass"  # the reference loops too


def test_random_weight_models_get_no_task_or_degeneration_verdicts():
    loop = judgement(["repetition loop: 'ab' x9 (18 chars from 3)"])
    rows = healthy(answer_correct=0.0)
    assert only(compute_verdicts(rows, judgements=[loop], random_weight_models=["m"]))["verdict"] == "pass"
    assert only(compute_verdicts(healthy(kl_max=3.0), random_weight_models=["m"]))["verdict"] == "fail"


def test_unmeasured_turn_warns_and_an_errored_unit_is_listed():
    rows = [rec("answer_correct", 1.0), rec("answer_correct", 1.0, "reference")]
    assert only(compute_verdicts(rows))["reasons"][0]["check"] == "unmeasured"
    error = {"model": "m", "scenario": "s2", "path": "fp8_e4m3", "turn": 1, "error": "RuntimeError: boom"}
    errored = [r for r in compute_verdicts(healthy(), errors=[error]) if r["scenario"] == "s2"]
    assert only(errored)["verdict"] == "warn" and "boom" in errored[0]["reasons"][0]["message"]


def test_scenario_threshold_replaces_the_default_and_cli_beats_both():
    check = {"model": "m", "scenario": "s1", "path": "fp8_e4m3", "turn": 0, "metric": "kl_max", "value": 1.5,
             "limit": 2.0, "passed": True, "message": None}
    assert only(compute_verdicts(healthy(kl_max=1.5), checks=[check]))["verdict"] == "pass"
    failed = check | {"value": 0.1, "limit": 0.05, "passed": False,
                      "message": "turn 0: kl_max 0.1 > 0.05 (threshold from s.yaml)"}
    reason = only(only(compute_verdicts(healthy(kl_max=0.1), checks=[failed],
                                        scenario_sources={"s1": "s.yaml"}))["reasons"])
    assert (reason["check"], reason["source"]) == ("threshold", "s.yaml")
    cli = parse_threshold_overrides(["kl_max:0.2"])
    assert only(compute_verdicts(healthy(kl_max=0.1), checks=[failed], overrides=cli))["verdict"] == "pass"
    reason = only(only(compute_verdicts(healthy(kl_max=0.3), overrides=cli))["reasons"])
    assert (reason["source"], reason["limit"], reason["severity"]) == ("--threshold", 0.2, "fail")


def test_override_on_a_higher_is_better_metric_adds_a_check():
    rows = healthy(top1_agree=0.9)
    assert only(compute_verdicts(rows))["verdict"] == "pass"
    assert only(compute_verdicts(rows, overrides=parse_threshold_overrides(["top1_agree:0.99"])))["verdict"] == "fail"


@pytest.mark.parametrize("spec", ["kl_max", "kl_max:", "kl_max:abc", "kl_max:nan", "nope:1", "context_tokens:5"])
def test_bad_threshold_specs_are_refused(spec):
    with pytest.raises(ValueError, match="threshold"):
        parse_threshold_overrides([spec])


def test_matrix_counts_and_worst_turn():
    rows = compute_verdicts(healthy() + healthy(turn=1, kl_max=0.5) + healthy(turn=2, kl_max=3.0)
                            + healthy("bf16", turn=0, kl_max=0.0))
    matrix = verdict_matrix(rows)
    cell = matrix["m"]["fp8_e4m3"]
    assert (cell["pass"], cell["warn"], cell["fail"]) == (1, 1, 1)
    assert cell["worst_turn"]["turn"] == 2 and "kl_max 3" in cell["worst_turn"]["reason"]
    assert failing_paths(matrix) == [("m", "fp8_e4m3")]


def test_diagnosis_shows_the_first_divergent_token_in_both_texts():
    rows = compute_verdicts(healthy(kl_max=3.0))
    texts = {("m", "s1", "reference", 0): {"tokens": ["The", " answer", " is", " 9", "6"], "token_ids": [1, 2, 3, 4, 5],
                                           "text": "The answer is 96"},
             ("m", "s1", "fp8_e4m3", 0): {"tokens": ["The", " answer", " is", " 4", "2"], "token_ids": [1, 2, 3, 6, 7],
                                          "text": "The answer is 42"}}
    text = diagnosis(only(rows), texts)
    assert "m::s1::fp8_e4m3 turn 0: FAIL" in text
    assert "kl_max 3 > 1 (fail threshold from default)" in text
    assert "first divergent token 3: reference 'The answer is[ 9]6' vs path 'The answer is[ 4]2'" in text


def test_diagnosis_names_the_worst_attention_layer_and_head_when_captured():
    row = only(compute_verdicts(healthy(kl_max=3.0)))
    captured = {("m", "s1", "fp8_e4m3", 0): {"attn_worst_layer": 3.0, "attn_worst_head": 6.0,
                                              "attn_worst_head_layer": 3.0, "attn_out_rel_err_max": 0.591}}
    assert "worst attention error: layer 3, head 6 of layer 3 (attn_out_rel_err_max 0.591)" in diagnosis(row, {}, captured)
    assert "worst attention" not in diagnosis(row, {})  # no capture, no claim


def test_stored_run_without_verdicts_gets_them_on_the_fly(tmp_path):
    run = tmp_path / "baseline"  # a run stored before verdicts existed: no verdicts.jsonl
    shutil.copytree(ROOT / "tests" / "data" / "runs" / "baseline", run)
    (run / "verdicts.jsonl").unlink(missing_ok=True)
    rows = run_verdicts(run)
    assert rows and {r["verdict"] for r in rows} <= {"pass", "warn", "fail"}
    assert set(run_matrix(run)) == {r["model"] for r in rows}


def _canary_scenarios(tmp_path: Path) -> Path:
    """Two arithmetic canary scenarios the hybrid answers in bf16 (short replies: seconds on a CPU)."""
    import yaml

    source = yaml.safe_load((ROOT / "scenarios" / "canary" / "default.yaml").read_text())
    kept = [s for s in source["scenarios"] if s["id"] in ("canary-arith-1", "canary-arith-2")]
    target = tmp_path / "two.yaml"
    target.write_text(yaml.safe_dump({k: v for k, v in source.items() if k != "scenarios"} | {"scenarios": kept}))
    return target


@pytest.mark.slow
@pytest.mark.skipif(not (CANARY / "hybrid" / "config.json").exists(), reason="trained hybrid canary not bundled")
def test_harness_run_exit_code_names_the_failing_path(tmp_path, capsys):
    """The fault and the healthy paths in one run: warm-up scales fail, healthy FP8 paths pass; exit 1,
    then 0 with --no-fail-on-verdict; verdicts.jsonl and the manifest matrix are stored."""
    scenarios = _canary_scenarios(tmp_path)
    out = tmp_path / "run"
    argv = ["run", "--model", str(CANARY / "hybrid"), "--scenarios", str(scenarios), "--no-progress",
            "--paths", "bf16,fp8_e4m3,fp8_e4m3:per_head:calibrated,fp8_e4m3:warmup"]
    assert main(argv + ["--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert printed.index("verdicts per path") < printed.index("answer acc")  # the matrix leads the summary
    assert "VERDICT FAIL: hybrid fp8_e4m3:warmup" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    cells = manifest["verdicts"]["hybrid"]
    assert cells["fp8_e4m3:warmup"]["fail"] > 0
    assert all(cells[p]["fail"] == cells[p]["warn"] == 0 for p in ("bf16", "fp8_e4m3", "fp8_e4m3:per_head:calibrated"))
    rows = [json.loads(line) for line in (out / "verdicts.jsonl").read_text().splitlines()]
    assert {r["path"] for r in rows} == {"bf16", "fp8_e4m3", "fp8_e4m3:per_head:calibrated", "fp8_e4m3:warmup"}
    assert main(argv + ["--out", str(tmp_path / "again"), "--no-fail-on-verdict"]) == 0


def test_bad_threshold_is_refused_before_any_work(tmp_path, capsys):
    assert main(["run", "--threshold", "kl_max:lots", "--out", str(tmp_path / "r")]) == 2
    assert "--threshold 'kl_max:lots'" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_threshold_values_are_finite():
    assert all(math.isfinite(t.fail) for t in DEFAULT_THRESHOLDS)


def test_summary_leads_with_the_verdict_matrix():
    from harness.runs.summary import format_summary

    text = format_summary(ROOT / "tests" / "data" / "runs" / "baseline")
    assert text.startswith("verdicts per path")
    assert text.index("fp8_e4m3  ") < text.index("answer acc")
    assert "FAIL" in text  # the stored baseline's default-scale path breaks in later turns
