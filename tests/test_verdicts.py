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
    DEFAULT_YARDSTICK,
    KL_RATIO_FLOOR,
    binomial_tail,
    compute_path_verdicts,
    compute_verdicts,
    default_threshold,
    diagnosis,
    failing_paths,
    RECOVERY_ALPHA,
    sign_test,
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


YARD = DEFAULT_YARDSTICK  # fp8_e4m3:calibrated


def healthy(path="fp8_e4m3", turn=0, scenario="s1", yard_kl=1e-2, **extra) -> list[dict]:
    """One turn of `path` and of the yardstick beside it (kl_mean `yard_kl`), and the reference's task row."""
    values = {"kl_max": 1e-4, "kl_mean": 1e-5, "kl_p99": 1e-4, "answer_correct": 1.0} | extra
    rows = [rec(m, v, path, turn, scenario) for m, v in values.items()]
    rows += [rec("answer_correct", 1.0, "reference", turn, scenario), rec("reply_tokens", 20, "reference", turn, scenario)]
    if path != YARD and yard_kl is not None:
        rows += [rec("kl_mean", yard_kl, YARD, turn, scenario), rec("answer_correct", 1.0, YARD, turn, scenario)]
    return rows


def of(rows: list[dict], path="fp8_e4m3") -> list[dict]:
    return [r for r in rows if r["path"] == path]


def only(rows: list[dict]) -> dict:
    assert len(rows) == 1, rows
    return rows[0]


def test_healthy_turn_passes_both_questions_with_no_reasons():
    row = only(of(compute_verdicts(healthy())))
    assert (row["verdict"], row["reasons"]) == ("pass", [])
    assert row["questions"] == {"implementation": "pass", "acceptable": "pass"}
    assert row["kl_ratio_yardstick"] == pytest.approx(1e-5 / 1e-2)


def test_a_lost_answer_is_no_finding_per_turn_the_paired_test_decides_per_path():
    """One lost answer is what a healthy path loses on free text: no test can tell it from chance, so no warning
    (issue 40); the per-path McNemar test below decides."""
    row = only(of(compute_verdicts(healthy(answer_correct=0.0))))
    assert row["verdict"] == "pass" and row["reasons"] == []
    both_wrong = [r for r in healthy(answer_correct=0.0) if not (r["path"] == "reference" and r["metric"] ==
                                                                 "answer_correct")] + [rec("answer_correct", 0.0, "reference")]
    assert only(of(compute_verdicts(both_wrong)))["verdict"] == "pass"


@pytest.mark.parametrize("lost, verdict, words", [
    (0, "pass", None),
    (2, "pass", None),  # p = 0.25: two losses out of 20 could be chance: numbers, no finding
    (5, "pass", None),  # p = 1/32 = 0.031: not below RECOVERY_ALPHA = 0.01 (a run makes ~45 such tests)
    (7, "fail", "exact McNemar p = 0.0078"),  # 7 of 7 discordant pairs one way: p = 1/128 < 0.01
])
def test_paired_recovery_finds_a_loss_only_when_the_test_can_tell(lost, verdict, words):
    rows = [r for t in range(20) for r in healthy(turn=t, answer_correct=0.0 if t < lost else 1.0)]
    row = only(of(compute_path_verdicts(rows)))
    assert row["verdict"] == verdict
    numbers = row["numbers"]["answer_correct_recovery"]
    assert (numbers["lost"], numbers["items"], numbers["recovery"]) == (lost, 20, pytest.approx((20 - lost) / 20))
    if words:
        assert words in only(row["reasons"])["message"] and row["questions"]["acceptable"] == verdict


def test_exact_binomial_tail_and_the_smallest_set_that_can_fail():
    assert binomial_tail(5, 5) == 1 / 32 and binomial_tail(4, 4) == 1 / 16
    assert binomial_tail(0, 3) == 1.0 and binomial_tail(2, 3) == pytest.approx(4 / 8)
    assert min(n for n in range(1, 20) if binomial_tail(n, n) < RECOVERY_ALPHA) == 7


def test_divergence_is_judged_against_the_yardstick_measured_in_the_run():
    limit = default_threshold("kl_ratio_yardstick")
    stick = 0.02  # above KL_RATIO_FLOOR, so the ratio divides by it
    assert stick > KL_RATIO_FLOOR and limit.warn is None  # a turn's ratio is no test: it fails or says nothing
    for times, verdict in ((limit.fail * 0.9, "pass"), (limit.fail * 1.1, "fail")):
        row = only(of(compute_verdicts(healthy(kl_mean=stick * times, yard_kl=stick))))
        assert row["verdict"] == verdict, (times, row)
        if verdict != "pass":
            reason = only(row["reasons"])
            assert (reason["metric"], reason["question"]) == ("kl_ratio_yardstick", "acceptable")
            assert f"x the yardstick {YARD} (0.02 nats on this turn; divided by 0.02)" in reason["message"]


def test_ratio_floor_keeps_rounding_noise_from_reading_as_a_large_multiple():
    # the yardstick reproduced the reference (1e-9 nats): 1e-5 nats would be 10,000x it, but is below the floor
    row = only(of(compute_verdicts(healthy(kl_mean=1e-5, yard_kl=1e-9))))
    assert row["verdict"] == "pass" and row["kl_ratio_yardstick"] == pytest.approx(1e-5 / KL_RATIO_FLOOR)


def test_without_a_yardstick_absolute_limits_apply_and_the_question_is_named_unanswered():
    limit = default_threshold("kl_p99")
    row = only(compute_verdicts(healthy(kl_p99=limit.fail * 2, yard_kl=None)))
    assert row["verdict"] == "fail" and row["reasons"][0]["metric"] == "kl_p99"
    whole = only(compute_path_verdicts(healthy(yard_kl=None)))
    assert any(u.startswith("acceptable: no yardstick path") for u in whole["unanswered"])
    endpoint = only(compute_path_verdicts(healthy(path="candidate", yard_kl=None)))
    assert any(u.startswith("implementation:") and "endpoint" in u for u in endpoint["unanswered"])


def test_a_bf16_cache_path_must_reproduce_the_reference_implementation_question():
    row = only(of(compute_verdicts(healthy("bf16:calibrated:k_scale_on_scores", kl_mean=0.5)),
                  "bf16:calibrated:k_scale_on_scores"))
    assert row["questions"]["implementation"] == "fail"
    assert any(r["source"] == "default (BF16 cache)" and r["question"] == "implementation" for r in row["reasons"])
    assert only(of(compute_verdicts(healthy("bf16", kl_mean=0.0)), "bf16"))["verdict"] == "pass"


def test_attention_implementation_error_answers_the_implementation_question():
    limit = default_threshold("attn_impl_err_ratio")
    assert limit.question == "implementation"
    row = only(of(compute_verdicts(healthy(attn_impl_err_ratio=limit.fail * 2))))
    assert row["questions"] == {"implementation": "fail", "acceptable": "pass"}
    # 1.13: the largest healthy value measured (gqa, fp8_q:fp8_p calibrated; the threshold's measured text)
    assert only(of(compute_verdicts(healthy(attn_impl_err_ratio=1.13))))["verdict"] == "pass"


def test_pooled_divergence_uses_every_token_of_the_path_against_the_yardstick():
    rows = [r for t in range(4) for r in healthy(turn=t, kl_mean=0.01, yard_kl=0.01)]
    series = [{"model": "m", "scenario": "s1", "path": p, "turn": t, "series": "kl", "values": [kl] * 20}
              for t in range(4) for p, kl in (("fp8_e4m3", 0.01), (YARD, 0.01))]
    row = only(of(compute_path_verdicts(rows, kl_series=series)))
    assert row["verdict"] == "pass"
    assert row["numbers"]["kl_mean_ratio"] == pytest.approx(1.0) and row["numbers"]["kl_p999_ratio"] == pytest.approx(1.0)
    fail = default_threshold("kl_p999_ratio").fail
    series[0]["values"] = [0.01] * 19 + [0.01 * fail * 40]  # one token far out: the pooled p99.9 sees it
    row = only(of(compute_path_verdicts(rows, kl_series=series)))
    assert row["verdict"] == "fail" and row["reasons"][0]["metric"] == "kl_p999_ratio"
    assert "x the yardstick" in row["reasons"][0]["message"]


def test_the_float32_reference_is_measured_beside_the_yardstick_and_never_judged():
    rows = healthy(kl_mean=4e-3, yard_kl=1e-2)
    # fp32 diverging far beyond every limit: a measurement of the reference's own noise, not a path under test
    rows += [rec("kl_mean", 2e-3, "fp32"), rec("kl_p99", 50.0, "fp32"), rec("answer_correct", 0.0, "fp32")]
    turn = only(of(compute_verdicts(rows), "fp32"))
    assert turn["verdict"] == "pass" and turn["reasons"] == []
    whole = {r["path"]: r for r in compute_path_verdicts(rows)}
    assert whole["fp32"]["role"].startswith("reference noise") and whole["fp32"]["numbers"]["kl_mean"] == 2e-3
    assert whole["fp8_e4m3"]["numbers"]["noise_kl_mean"] == 2e-3
    assert whole["fp8_e4m3"]["numbers"]["kl_mean_over_noise"] == pytest.approx(2.0)
    assert whole[YARD]["numbers"]["kl_mean_over_noise"] == pytest.approx(5.0)
    rows += [rec("kl_mean", math.nan, "fp32", turn=1), rec("reply_tokens", 20, "reference", turn=1)]
    assert only([r for r in compute_verdicts(rows) if r["path"] == "fp32" and r["turn"] == 1])["verdict"] == "fail"
    from harness.runs.report_views import times_yardstick

    assert "2x the fp32 reference noise" in times_yardstick(whole["fp8_e4m3"]["numbers"])
    assert "noise_kl_mean" not in only(of(compute_path_verdicts(healthy(kl_mean=4e-3))))["numbers"]


def test_non_finite_values_fail_the_implementation_question():
    rows = [r for r in healthy() if not (r["metric"] == "kl_mean" and r["path"] == "fp8_e4m3")]
    rows.append(rec("kl_mean", None, text="nan"))
    reason = only(only(of(compute_verdicts(rows)))["reasons"])
    assert (reason["check"], reason["metric"], reason["severity"], reason["question"]) == \
        ("nonfinite", "kl_mean", "fail", "implementation")
    assert only(of(compute_verdicts(healthy(kv_nonfinite=3.0))))["verdict"] == "fail"


def judgement(findings, path="fp8_e4m3", turn=0) -> dict:
    return {"model": "m", "scenario": "s1", "path": path, "turn": turn, "metric": "judge_rule",
            "detail": {"findings": findings}}


LOOP = "repetition loop: 'ab' x9 (18 chars from 3)"


def test_degeneration_is_judged_against_the_reference_rate_on_the_same_prompts():
    assert only(of(compute_verdicts(healthy(), judgements=[judgement([LOOP])])))["verdict"] == "pass"  # one turn: no test
    rows = [r for t in range(10) for r in healthy(turn=t)]
    few = [judgement([LOOP] if p == "fp8_e4m3" and t < 2 else [], p, t) for t in range(10)
           for p in ("reference", "fp8_e4m3")]
    row = only(of(compute_path_verdicts(rows, few)))  # 2 of 10: could be chance (p = 0.25), a number, not a finding
    assert row["verdict"] == "pass" and row["numbers"]["degeneration repetition loop"]["p_value"] == 0.25
    many = [judgement([LOOP] if p == "fp8_e4m3" and t < 7 else [], p, t) for t in range(10)
            for p in ("reference", "fp8_e4m3")]
    row = only(of(compute_path_verdicts(rows, many)))  # 7 of 10 one way: p = 1/128 < RECOVERY_ALPHA
    assert row["verdict"] == "fail" and "repetition loop on 7 of 10 replies vs the reference's 0" in \
        row["reasons"][0]["message"]


def test_length_warns_only_where_the_sign_test_rejects():
    """Shorter replies on 4 of 4 turns is p = 0.125 (two-sided): no evidence, however far from the MLPerf band;
    8 of 8 is p = 0.0078 < 0.01: a warning. The control arm shifting as much makes it the engine's own."""
    rows = [r for t in range(4) for r in healthy(turn=t, reply_tokens=20)]
    assert only(of(compute_path_verdicts(rows)))["numbers"]["length_ratio"] == 1.0
    short = [r for t in range(4) for r in healthy(turn=t, reply_tokens=10)]
    row = only(of(compute_path_verdicts(short)))
    assert row["reasons"] == [] and row["numbers"]["length_sign_test"]["p_value"] == sign_test(4, 0) == 0.125
    short = [r for t in range(8) for r in healthy(turn=t, reply_tokens=10)]
    reason = only(only(of(compute_path_verdicts(short)))["reasons"])
    assert (reason["metric"], reason["severity"]) == ("length_ratio", "warn")
    assert "shorter than the reference's on 8 of 8 turns" in reason["message"] and "p = 0.0078" in reason["message"]
    control = [rec("reply_tokens", 10, "bf16:chunked_prefill", t) for t in range(8)]
    row = only(of(compute_path_verdicts(short + control)))
    assert row["reasons"] == [] and "control arm" in row["numbers"]["length_sign_test"]["note"]


def test_random_weight_models_get_no_task_or_degeneration_verdicts():
    rows = healthy(answer_correct=0.0)
    loop = judgement([LOOP])
    assert only(of(compute_verdicts(rows, judgements=[loop], random_weight_models=["m"])))["verdict"] == "pass"
    fail = default_threshold("kl_ratio_yardstick").fail
    assert only(of(compute_verdicts(healthy(kl_mean=0.02 * fail * 2, yard_kl=0.02),
                                    random_weight_models=["m"])))["verdict"] == "fail"


def test_unmeasured_turn_warns_and_an_errored_unit_is_listed():
    rows = [rec("answer_correct", 1.0), rec("answer_correct", 1.0, "reference")]
    assert only(compute_verdicts(rows))["reasons"][0]["check"] == "unmeasured"
    error = {"model": "m", "scenario": "s2", "path": "fp8_e4m3", "turn": 1, "error": "RuntimeError: boom"}
    errored = [r for r in compute_verdicts(healthy(), errors=[error]) if r["scenario"] == "s2"]
    assert only(errored)["verdict"] == "warn" and "boom" in errored[0]["reasons"][0]["message"]


def test_scenario_threshold_replaces_the_default_and_cli_beats_both():
    fail = default_threshold("kl_ratio_yardstick").fail
    high = 0.02 * fail * 2  # fails the default ratio limit
    check = {"model": "m", "scenario": "s1", "path": "fp8_e4m3", "turn": 0, "metric": "kl_ratio_yardstick",
             "value": fail * 2, "limit": fail * 3, "passed": True, "message": None}
    assert only(of(compute_verdicts(healthy(kl_mean=high, yard_kl=0.02), checks=[check])))["verdict"] == "pass"
    failed = {"model": "m", "scenario": "s1", "path": "fp8_e4m3", "turn": 0, "metric": "kl_max", "value": 0.1,
              "limit": 0.05, "passed": False, "message": "turn 0: kl_max 0.1 > 0.05 (threshold from s.yaml)"}
    reason = only(only(of(compute_verdicts(healthy(kl_max=0.1), checks=[failed],
                                           scenario_sources={"s1": "s.yaml"})))["reasons"])
    assert (reason["check"], reason["source"]) == ("threshold", "s.yaml")
    cli = parse_threshold_overrides(["kl_max:0.2"])
    assert only(of(compute_verdicts(healthy(kl_max=0.1), checks=[failed], overrides=cli)))["verdict"] == "pass"
    reason = only(only(of(compute_verdicts(healthy(kl_max=0.3), overrides=cli)))["reasons"])
    assert (reason["source"], reason["limit"], reason["severity"]) == ("--threshold", 0.2, "fail")
    strict = parse_threshold_overrides(["kl_mean_ratio:0.5"])  # a per-path bar the user sets
    assert only(of(compute_path_verdicts(healthy(kl_mean=0.02, yard_kl=0.02), overrides=strict)))["verdict"] == "fail"


def test_a_task_threshold_the_reference_fails_too_is_the_models_not_the_paths():
    check = {"model": "m", "scenario": "s1", "path": "fp8_e4m3", "turn": 0, "metric": "answer_correct", "value": 0.0,
             "limit": 1.0, "passed": False, "message": "turn 0: answer_correct 0 < 1 (threshold from g.yaml)"}
    rows = [r for r in healthy(answer_correct=0.0) if not (r["path"] == "reference" and r["metric"] == "answer_correct")]
    shared = only(of(compute_verdicts(rows + [rec("answer_correct", 0.0, "reference")], checks=[check])))
    assert shared["verdict"] == "pass" and shared["reasons"] == []  # the reference's own records keep the miss
    alone = only(of(compute_verdicts(healthy(answer_correct=0.0), checks=[check])))
    assert alone["verdict"] == "fail"  # the reference answered: the file's bar holds


def test_override_on_a_higher_is_better_metric_adds_a_check():
    rows = healthy(top1_agree=0.9)
    assert only(of(compute_verdicts(rows)))["verdict"] == "pass"
    assert only(of(compute_verdicts(rows, overrides=parse_threshold_overrides(["top1_agree:0.99"]))))["verdict"] == "fail"


@pytest.mark.parametrize("spec", ["kl_max", "kl_max:", "kl_max:abc", "kl_max:nan", "nope:1", "context_tokens:5"])
def test_bad_threshold_specs_are_refused(spec):
    with pytest.raises(ValueError, match="threshold"):
        parse_threshold_overrides([spec])


def test_matrix_joins_turns_and_per_path_checks_per_question():
    fail = default_threshold("kl_ratio_yardstick").fail
    rows = healthy() + healthy(turn=1, kl_mean=0.02 * fail * 2, yard_kl=0.02) + healthy("bf16", kl_mean=0.0)
    verdicts = compute_verdicts(rows)
    matrix = verdict_matrix(verdicts, compute_path_verdicts(rows))
    cell = matrix["m"]["fp8_e4m3"]
    assert (cell["pass"], cell["warn"], cell["fail"]) == (1, 0, 1)
    assert cell["worst_turn"]["turn"] == 1 and "x the yardstick" in cell["worst_turn"]["reason"]
    assert cell["questions"] == {"implementation": "pass", "acceptable": "fail"}
    assert cell["path"]["numbers"]["kl_mean_ratio"] > 1 and cell["path"]["yardstick"] == YARD
    assert failing_paths(matrix) == [("m", "fp8_e4m3")]
    lost = [r for t in range(8) for r in healthy(turn=t, answer_correct=0.0)]  # no turn fails; the path does (p = 1/256)
    matrix = verdict_matrix(compute_verdicts(lost), compute_path_verdicts(lost))
    assert matrix["m"]["fp8_e4m3"]["fail"] == 0 and failing_paths(matrix) == [("m", "fp8_e4m3")]


def test_diagnosis_shows_the_first_divergent_token_and_where_kl_max_sits():
    fail = default_threshold("kl_ratio_yardstick").fail
    rows = of(compute_verdicts(healthy(kl_mean=0.02 * fail * 2, yard_kl=0.02)))
    texts = {("m", "s1", "reference", 0): {"tokens": ["The", " answer", " is", " 9", "6"], "token_ids": [1, 2, 3, 4, 5],
                                           "text": "The answer is 96"},
             ("m", "s1", "fp8_e4m3", 0): {"tokens": ["The", " answer", " is", " 4", "2"], "token_ids": [1, 2, 3, 6, 7],
                                          "text": "The answer is 42"}}
    metrics = {("m", "s1", "fp8_e4m3", 0): {"kl_max": 3.0, "kl_max_pos": 3.0, "kl_max_ref_entropy": 0.2,
                                             "kl_max_ref_margin": 4.0, "confident_flips": 1.0, "near_tie_flips": 0.0,
                                             "first_flip_topk_ok": 0.0}}
    text = diagnosis(only(rows), texts, metrics)
    assert "m::s1::fp8_e4m3 turn 0: FAIL" in text and "x the yardstick" in text
    assert "kl_max 3 nats at reply token 3: reference entropy 0.2 nats, top-1/top-2 margin 4 nats (the reference " \
           "was sure); flips: 1 confident, 0 near-tie; first flip OUTSIDE each other's top-5" in text
    assert "first divergent token 3: reference 'The answer is[ 9]6' vs path 'The answer is[ 4]2'" in text


def test_diagnosis_names_the_worst_attention_layer_and_head_when_captured():
    row = only(of(compute_verdicts(healthy())))
    captured = {("m", "s1", "fp8_e4m3", 0): {"attn_worst_layer": 3.0, "attn_worst_head": 6.0,
                                              "attn_worst_head_layer": 3.0, "attn_out_rel_err_max": 0.591,
                                              "attn_impl_err_ratio": 7.5, "attn_impl_worst_layer": 2.0,
                                              "attn_impl_worst_head": 1.0}}
    text = diagnosis(row, {}, captured)
    assert "worst attention error: layer 3, head 6 of layer 3 (attn_out_rel_err_max 0.591)" in text
    assert "attention implementation error 7.5x torch's own at the attention dtype (worst: layer 2, head 1)" in text
    assert "worst attention" not in diagnosis(row, {})  # no capture, no claim


def test_stored_run_without_verdicts_gets_them_on_the_fly(tmp_path):
    run = tmp_path / "baseline"  # a run stored before verdicts existed: no verdicts.jsonl
    shutil.copytree(ROOT / "tests" / "data" / "runs" / "baseline", run)
    (run / "verdicts.jsonl").unlink(missing_ok=True)
    rows = run_verdicts(run)
    assert rows and {r["verdict"] for r in rows} <= {"pass", "warn", "fail"}
    matrix = run_matrix(run)
    assert set(matrix) == {r["model"] for r in rows}
    assert all(set(cell["questions"]) == {"implementation", "acceptable"} for cell in matrix["canary-mla"].values())


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
    argv = ["run", "--model", str(CANARY / "hybrid"), "--scenarios", str(scenarios), "--no-progress", "--jobs", "1",
            "--paths", "bf16,fp8_e4m3,fp8_e4m3:per_head:calibrated,fp8_e4m3:warmup"]  # --jobs 1: no worker pool
    assert main(argv + ["--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert printed.index("verdicts per path") < printed.index("answer acc")  # the matrix leads the summary
    assert "VERDICT FAIL: hybrid fp8_e4m3:warmup" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    cells = manifest["verdicts"]["hybrid"]
    assert cells["fp8_e4m3:warmup"]["fail"] > 0
    assert all(cells[p]["fail"] == cells[p]["warn"] == 0 and cells[p]["path"]["verdict"] != "fail"
               for p in ("bf16", "fp8_e4m3", "fp8_e4m3:per_head:calibrated", "fp8_e4m3:calibrated"))
    assert cells["fp8_e4m3:warmup"]["questions"]["acceptable"] == "fail"
    assert manifest["yardstick"] == "fp8_e4m3:calibrated"  # added to --paths: measured in the same run
    rows = [json.loads(line) for line in (out / "verdicts.jsonl").read_text().splitlines()]
    assert {r["path"] for r in rows} == {"bf16", "fp8_e4m3", "fp8_e4m3:per_head:calibrated", "fp8_e4m3:warmup",
                                         "fp8_e4m3:calibrated", "fp8_e4m3:calibrated:emulated", "bf16:chunked_prefill"}
    assert (out / "path_verdicts.jsonl").exists()
    # the same run's verdicts, exit 0 under --no-fail-on-verdict: resumed (every unit done, none replayed)
    assert main(argv + ["--out", str(out), "--resume", "--no-fail-on-verdict"]) == 0
    assert [json.loads(line) for line in (out / "verdicts.jsonl").read_text().splitlines()] == rows


def test_bad_threshold_is_refused_before_any_work(tmp_path, capsys):
    assert main(["run", "--threshold", "kl_max:lots", "--out", str(tmp_path / "r")]) == 2
    assert "--threshold 'kl_max:lots'" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_every_default_is_finite_and_names_its_measurement():
    for threshold in DEFAULT_THRESHOLDS:
        assert math.isfinite(threshold.fail)
        assert "healthy" in threshold.measured and "PROVISIONAL" not in threshold.measured, threshold


def test_summary_leads_with_the_verdict_matrix():
    from harness.runs.summary import format_summary

    text = format_summary(ROOT / "tests" / "data" / "runs" / "baseline")
    assert text.startswith("verdicts per path")
    assert text.index("fp8_e4m3  ") < text.index("answer acc")
    assert "FAIL" in text  # the stored baseline's default-scale path breaks in later turns


@pytest.mark.slow
def test_fp32_path_measures_the_reference_noise_end_to_end(tmp_path, capsys):
    """The `fp32` path on a trained canary: the model in float32 beside the BF16 reference, its KL is the
    reference's own precision noise (nonzero: BF16 and FP32 arithmetic part), shown per path, never judged."""
    out = tmp_path / "run"
    code = main(["run", "--models", "gqa", "--paths", "fp8_e4m3,fp32", "--select", "id:canary-arith-1",
                 "--out", str(out), "--jobs", "1"])
    assert code == 0
    whole = {r["path"]: r for r in (json.loads(line) for line in (out / "path_verdicts.jsonl").read_text().splitlines())}
    assert 0 < whole["fp32"]["numbers"]["kl_mean"] < whole[YARD]["numbers"]["kl_mean"]
    assert whole["fp8_e4m3"]["numbers"]["kl_mean_over_noise"] > 0
    assert "(reference noise: KL mean" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert any(p["name"] == "fp32" and "float32" in p["description"] for p in manifest["paths"])


def test_the_yardstick_is_judged_by_its_twin_and_a_broken_one_names_itself():
    """A fault every FP8 path shares moves the yardstick and not its twin (its numerics outside the engine): the
    yardstick's own row fails on the implementation question, naming it, and the other paths' ratios to it are
    listed as no evidence. Healthy, the two are equal."""
    twin = f"{YARD}:emulated"
    rows = [r for t in range(4) for r in healthy(turn=t, kl_mean=0.02, yard_kl=0.02)]
    rows += [rec("kl_mean", 0.02, twin, t) for t in range(4)] + [rec("kl_mean", 0.0, "bf16:chunked_prefill", t)
                                                                  for t in range(4)]
    whole = {r["path"]: r for r in compute_path_verdicts(rows)}
    assert whole[YARD]["numbers"]["yardstick_twin_ratio"] == 1.0 and whole[YARD]["verdict"] == "pass"
    assert whole[twin]["role"].startswith("the yardstick's twin") and whole["bf16:chunked_prefill"]["role"].startswith(
        "control arm")
    assert whole["fp8_e4m3"]["numbers"]["control"]["path"] == "bf16:chunked_prefill"
    broken = [r | {"value": 10.0} if r["path"] in (YARD, "fp8_e4m3") and r["metric"] == "kl_mean" else r for r in rows]
    whole = {r["path"]: r for r in compute_path_verdicts(broken)}
    reason = only([r for r in whole[YARD]["reasons"] if r["check"] == "yardstick"])
    assert (whole[YARD]["verdict"], reason["question"]) == ("fail", "implementation")
    assert f"the yardstick {YARD} itself" in reason["message"] and "500x its twin" in reason["message"]
    assert whole["fp8_e4m3"]["numbers"]["kl_mean_ratio"] == 1.0  # 1x a broken yardstick ...
    assert any("failed its own check" in u for u in whole["fp8_e4m3"]["unanswered"])  # ... is no evidence
    turn = only([r for r in compute_verdicts(broken) if r["path"] == "bf16:chunked_prefill" and r["turn"] == 0])
    assert turn["verdict"] == "pass"  # the control arm is measured, never judged


def test_a_per_path_only_failure_exits_1(tmp_path):
    """Every turn passes, the per-path recovery test fails: harness run's exit code is 1 (it counted turns only)."""
    from harness.runs.gate import write_verdicts
    from harness.runs.status import EXIT_VERDICT_FAILED, run_exit_code
    from harness.runs.store import RunStore

    store = RunStore(tmp_path / "run")
    store.directory.mkdir()
    store.write_manifest({"status": "complete", "paths": [], "yardstick": YARD})
    store.append("records", [r for t in range(8) for r in healthy(turn=t, answer_correct=0.0)])
    matrix = write_verdicts(store)
    assert matrix["m"]["fp8_e4m3"]["fail"] == 0 and matrix["m"]["fp8_e4m3"]["path"]["verdict"] == "fail"
    assert run_exit_code(store.directory) == EXIT_VERDICT_FAILED
