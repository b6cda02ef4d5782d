"""The failure-class zoo: its stress variants are the same BF16 model, its fault presets are caught by the
default verdicts and its healthy paths are not (the detection matrix), its path-spec cases answer truly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.analysis.detection import MatrixEntry, detection_matrix, format_matrix
from harness.job import CANARY_WEIGHTS
from harness.kv_paths.spec import PathSpecError, parse_path
from harness.types import Message

ROOT = Path(__file__).resolve().parents[1]
ZOO_SCENARIOS = ROOT / "tests" / "data" / "zoo_scenarios.yaml"  # 3 of the 12 default canary scenarios
VARIANTS = ("stress/mla-latent-2048", "stress/mla-latent-div1024", "stress/gqa-kout-1024")
CHATS = [[Message("system", "Answer with the number only."), Message("user", "What is 6 * 7 + 9 * 6?")],
         [Message("user", "My favourite colour is violet."), Message("assistant", "Noted."),
          Message("user", "What is my favourite colour?")]]


@pytest.mark.parametrize("variant", VARIANTS)
def test_stress_variant_is_the_same_bf16_model(variant):
    """A power-of-two reparametrisation: logits bit-identical to the base canary's (no tolerance: bf16
    scaling by 2^k is exact, so any difference is a wrong transform), while the cached tensor grows."""
    from harness.replay.inprocess import InProcessModel

    model = InProcessModel.load(CANARY_WEIGHTS / variant)
    base = InProcessModel.load(model.variant.base)
    for chat in CHATS:
        ids = base.encode_chat(chat)
        assert torch.equal(model._forward(ids, model.backend(None).new_cache()),
                           base._forward(ids, base.backend(None).new_cache()))
    assert model.describe()["variant"]["alpha"] == model.variant.alpha


def test_k_scale_on_scores_spec():
    path = parse_path("bf16:calibrated:k_scale_on_scores")
    assert path.k_scale_on_scores and not path.is_fp8 and path.canonical == "bf16:calibrated:k_scale_on_scores"
    assert not parse_path("bf16:calibrated").k_scale_on_scores  # correct behaviour stays the default
    with pytest.raises(PathSpecError, match="applies only to a bf16 cache"):
        parse_path("fp8_e4m3:calibrated:k_scale_on_scores")
    with pytest.raises(PathSpecError, match="needs scales"):
        parse_path("bf16:k_scale_on_scores")


def test_detection_matrix_counts_failing_families():
    def row(path, turn, verdict, *reasons):
        return {"model": "m", "scenario": "s", "path": path, "turn": turn, "verdict": verdict,
                "reasons": [{"check": c, "metric": metric, "severity": sev} for c, metric, sev in reasons]}

    rows = [row("bad", 0, "fail", ("task", "answer_correct", "fail"), ("divergence", "kl_max", "fail")),
            row("bad", 1, "fail", ("degenerate", None, "fail")),
            row("good", 0, "warn", ("divergence", "kl_max", "warn")),
            row("loud", 0, "fail", ("divergence", "kl_mean", "fail"))]
    entries = [MatrixEntry("fault", "m", "bad", "fail"), MatrixEntry("healthy", "m", "good", "pass"),
               MatrixEntry("healthy", "m", "loud", "pass"), MatrixEntry("fault", "m", "absent", "fail")]
    bad, good, loud, absent = detection_matrix(rows, entries)
    assert bad.ok and bad.families == {"task checks": 1, "teacher-forced KL": 1, "rule judge": 1}
    assert good.ok and good.failed_turns == 0  # a warn is not a failure
    assert not loud.ok and not absent.ok  # a false alarm; a preset that never ran is no detection
    text = format_matrix([bad, good, loud, absent])
    assert "caught" in text and "quiet" in text and "FALSE ALARM" in text and "NOT RUN" in text


def zoo_sample(entries):
    """CI's zoo: every fault once (on the first canary it is listed for: a format fault's repeats on the other
    canaries are in the full zoo, `--matrix`), every healthy path on gqa, and bf16, calibrated fp8_e4m3 and FP8
    attention on each canary a fault runs on (the healthy paths beside which the faults are judged)."""
    seen, sample = set(), []
    for entry in entries:
        if entry.expect == "fail" and entry.label not in seen:
            seen.add(entry.label)
            sample.append(entry)
    models = {e.model for e in sample}
    return sample + [e for e in entries if e.expect != "fail" and (
        e.model == "gqa" or (e.model in models and not e.label.startswith(("healthy new", "new format"))))]


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["sample", pytest.param("full", marks=pytest.mark.matrix)])
def test_zoo_detection_matrix_on_cpu(tmp_path, scope):
    """Every fault preset fails at least one check family at the default thresholds; bf16 and calibrated
    fp8_e4m3 fail none on any canary (stress variant included); every class-5 spec case answers truly. CI runs
    `zoo_sample` (every fault once: 33 of the 54 entries), the nightly the whole zoo."""
    from harness.job import run_job
    from harness.zoo import (FORMAT_MEASURED, SPEC_CASES, check_spec_case, write_detection, zoo_config,
                             zoo_entries)

    if scope == "full":
        from harness.zoo import run_zoo

        detection = run_zoo(tmp_path / "zoo", (ZOO_SCENARIOS,), jobs=2)
        entries = zoo_entries("cpu")
    else:
        entries = zoo_sample(zoo_entries("cpu"))
        loaded: dict = {}
        spec_results = [check_spec_case(case, loaded) for case in SPEC_CASES]
        loaded.clear()
        run_dir = run_job(zoo_config(tmp_path / "zoo", (ZOO_SCENARIOS,), entries, jobs=2))
        detection = write_detection(run_dir, entries, spec_results)
    print(detection["markdown"])
    faults = [r for r in detection["rows"] if r["expect"] == "fail"]
    healthy = [r for r in detection["rows"] if r["expect"] == "pass"]
    assert {r["label"][:7] for r in faults} == {"class 1", "class 2", "class 3", "attenti", "scales ", "format:"}
    for row in faults:
        assert (row["failed_turns"] > 0 or row["path_failed"]) and row["families"] and row["questions"], \
            f"missed: {row}"
    # the attention-arithmetic faults are caught by the implementation check (the "attention error" family)
    arithmetic = [r for r in faults if r["label"].startswith("attention arithmetic")]
    assert len(arithmetic) == 6
    for row in arithmetic:
        assert row["families"].get("attention error", 0) > 0, f"not through the attention error: {row}"
    for row in healthy:
        assert row["turns"] > 0 and row["failed_turns"] == 0 and not row["path_failed"], f"false alarm: {row}"
    # full: bf16 and calibrated fp8_e4m3 on gqa, mla, hybrid and the latent variant; FP8 attention (q/prob
    # scales) on gqa, mla and hybrid; the seven healthy new-format paths on gqa, mla and hybrid (but those
    # FORMAT_MEASURED)
    assert len(healthy) == len([e for e in entries if e.expect == "pass"])
    if scope == "full":
        assert len(healthy) == 11 + 21 - len(FORMAT_MEASURED)
    assert all(case["ok"] for case in detection["spec_cases"]), detection["spec_cases"]
    assert detection["ok"]
    stored = json.loads((tmp_path / "zoo" / "detection.json").read_text())
    assert stored["rows"] == detection["rows"]
    from harness.job import write_report

    assert "Detection matrix" in Path(write_report(tmp_path / "zoo")).read_text()


def test_the_zoo_sample_runs_every_fault_once_beside_the_healthy_paths():
    from harness.zoo import zoo_entries

    entries = zoo_entries("cpu")
    sample = zoo_sample(entries)
    faults = [e for e in sample if e.expect == "fail"]
    assert {e.label for e in faults} == {e.label for e in entries if e.expect == "fail"}
    assert len(faults) == len({e.label for e in faults})
    for model in {e.model for e in faults}:
        assert {"bf16", "fp8_e4m3:calibrated"} <= {e.path for e in sample if e.model == model and e.expect == "pass"}
    assert {e.path for e in sample if e.model == "gqa" and e.expect != "fail"} == \
        {e.path for e in entries if e.model == "gqa" and e.expect != "fail"}


@pytest.mark.gpu
def test_zoo_class4_kernel_and_workaround_on_gpu(tmp_path):
    """Class 4: our MLA FP8 kernel and the dequantise-everything workaround give replies that pass the same
    checks; both are timed per decode step (kernel_ms_per_step; the cost comparison is a benchmark)."""
    from harness.zoo import run_zoo

    detection = run_zoo(tmp_path / "zoo", (ZOO_SCENARIOS,), device="cuda", jobs=1)
    print(detection["markdown"])
    class4 = [r for r in detection["rows"] if r["label"].startswith("class 4")]
    assert len(class4) == 2 and all(r["ok"] for r in class4)
    assert all(r["signals"]["kernel_ms_per_step"] for r in class4)
    assert detection["ok"]


def test_judge_score_table_means_over_multi_turn_scenarios(tmp_path):
    from harness.runs.judge_scores import format_judge_scores, judge_score_rows

    texts = [{"model": "m", "scenario": s, "path": p, "turn": t} for s, turns in (("chat", 2), ("sum", 1))
             for p in ("reference", "bf16", "fp8") for t in range(turns)]
    scores = {"reference": 5.0, "bf16": 5.0, "fp8": 1.0}
    records = [{"model": "m", "scenario": r["scenario"], "path": r["path"], "turn": r["turn"], "metric": metric,
                "value": scores[r["path"]] if r["turn"] == 0 else 4.0}
               for r in texts for metric in ("judge_rule", "judge_agreement") if r["path"] != "reference"
               or metric == "judge_rule"]
    for name, rows in (("texts", texts), ("records", records)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    rows = {r["path"]: r for r in judge_score_rows(tmp_path)}
    assert [r["path"] for r in judge_score_rows(tmp_path)] == ["reference", "bf16", "fp8"]
    assert rows["fp8"]["judge_rule"] == 2.5 and rows["fp8"]["turns"] == 2  # the one-turn "sum" is left out
    assert rows["reference"]["judge_agreement"] is None and rows["bf16"]["judge_agreement"] == 4.5
    assert judge_score_rows(tmp_path, multi_turn_only=False)[2]["turns"] == 3
    assert "| m | `fp8` | 1 | 2 | 2.50 | 2.50 | — |" in format_judge_scores(list(rows.values()))  # no LLM judge ran


def test_zoo_entries_and_config():
    """Every preset names a valid spec and an existing canary; the run gives each model only its own paths."""
    from harness.zoo import STRESS_ENTRIES, zoo_config, zoo_entries

    from harness.zoo import ARITHMETIC_FAULTS, FORMAT_FAULT_CLASSES, HEALTHY_FORMAT_PATHS

    cpu, gpu, stress = zoo_entries("cpu"), zoo_entries("cuda"), zoo_entries("cpu", stress=True)
    assert all(e.expect == "fail" and parse_path(e.path).fault for e in ARITHMETIC_FAULTS)
    assert {parse_path(e.path).fault for e in ARITHMETIC_FAULTS} == {"scores_bf16", "scale_off", "exp_poly",
                                                                    "pv_bf16", "k_scale_swap", "p_e5m2"}
    assert len(gpu) == len(cpu) + 2 and len(stress) == len(cpu) + len(STRESS_ENTRIES)
    for entry in stress + gpu:
        assert (CANARY_WEIGHTS / entry.model / "config.json").exists() or \
            (CANARY_WEIGHTS / entry.model / "variant.json").exists()
    config = zoo_config(Path("/tmp/unused"), (ZOO_SCENARIOS,), stress)
    by_model = dict(config.paths_by_model)
    assert set(by_model[str(CANARY_WEIGHTS / "gqa")]) == {
        "bf16", "fp8_e4m3:calibrated", "fp8_e4m3:calibrated:fp8_q:fp8_p", "fp8_e4m3:calibrated:fault=scores_bf16",
        "fp8_e4m3:calibrated:fault=pv_bf16", "fp8_e4m3:per_head:calibrated:fault=k_scale_swap",
        "fp8_e4m3:calibrated:fault=scale_dropped", *HEALTHY_FORMAT_PATHS,
        *(c.path for c in FORMAT_FAULT_CLASSES if "gqa" in c.models)}
    assert "fp8_e4m3:warmup" in by_model[str(CANARY_WEIGHTS / "hybrid")]
    assert "fp8_e4m3:warmup" not in by_model[str(CANARY_WEIGHTS / "mla")]
    # the run's controls (the yardstick's twin, the control arm) are declared; each model runs its own presets
    assert {p.name for p in config.paths} == {"bf16", *(e.path for e in stress), "fp8_e4m3:calibrated:emulated",
                                              "bf16:chunked_prefill"}


def test_stress_suites_name_existing_canaries_and_bound_the_cpu(monkeypatch):
    """The long-context canary replays its own 16k-token set, all 10 needles on CUDA and the first on the CPU;
    its bf16 and calibrated e4m3 rows are asserted healthy, the others measured. (The CUDA configuration is
    built, not run: the device check is told a GPU exists.)"""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from harness.zoo import LONG_CONTEXT_ENTRIES, LONG_CONTEXT_SUITE, STRESS_SUITES, StressSuite, long_context_config
    from harness.scenarios.select import select_scenarios
    from harness.scenarios.sources import load_scenarios

    assert {s.name for s in STRESS_SUITES} == {"variants", "long-context"}
    cpu, gpu = long_context_config(Path("/tmp/unused"), "cpu"), long_context_config(Path("/tmp/unused"), "cuda")
    assert cpu.out == Path("/tmp/unused/long-context") and cpu.models == (CANARY_WEIGHTS / "stress/gqa-long16k",)
    scenarios = load_scenarios(list(gpu.scenario_paths))
    assert len(select_scenarios(scenarios, gpu.select)) == 10 and len(select_scenarios(scenarios, cpu.select)) == 1
    assert all(s.kind == "long_context" and len(s.turns[0].user) > 16000 for s in scenarios)
    assert dict(cpu.paths_by_model)[str(CANARY_WEIGHTS / "stress/gqa-long16k")] == (
        "bf16", "fp8_e4m3:calibrated", "fp8_e4m3", "fp8_e5m2")
    assert {e.path for e in LONG_CONTEXT_ENTRIES if e.expect == "pass"} == {"bf16", "fp8_e4m3:calibrated"}
    assert LONG_CONTEXT_SUITE.paths == ("fp8_e4m3:calibrated", "fp8_e4m3", "fp8_e5m2")
    with pytest.raises(ValueError, match="no canary folder"):
        StressSuite("x", ("stress/none",), ("scenarios/canary/stress",), ("bf16",))


def test_detection_joins_the_rows_of_the_zoo_s_second_run(tmp_path):
    """write_detection puts the long-context run's rows into the same matrix; one false alarm there fails it."""
    from harness.runs.store import RunStore
    from harness.zoo import DETECTION_FILE, ZooEntry, write_detection

    def run(name: str, rows: list[tuple[str, str, str]]) -> Path:
        store = RunStore.create(tmp_path / name, {"command": "harness zoo", "versions": {}})
        store.append("verdicts", [{"model": m, "scenario": "s", "path": p, "turn": 0, "verdict": v,
                                   "reasons": [{"metric": "kl_max", "severity": "fail"}] if v == "fail" else []}
                                  for m, p, v in rows])
        store.append("records", [])
        return store.directory

    main = run("zoo", [("gqa", "bf16", "pass"), ("mla", "fp8_e4m3", "fail")])
    entries = [ZooEntry("healthy", "gqa", "bf16", "pass"), ZooEntry("fault", "mla", "fp8_e4m3", "fail")]
    long_entries = [ZooEntry("healthy at 16k tokens", "stress/gqa-long16k", "fp8_e4m3:calibrated", "pass"),
                    ZooEntry("stress", "stress/gqa-long16k", "fp8_e5m2", "measure")]
    quiet = run("zoo/long-context", [("gqa-long16k", "fp8_e4m3:calibrated", "pass"),
                                     ("gqa-long16k", "fp8_e5m2", "fail")])
    detection = write_detection(main, entries, [], ((quiet, long_entries),))
    assert [r["model"] for r in detection["rows"]] == ["gqa", "mla", "gqa-long16k", "gqa-long16k"]
    assert detection["ok"] and "healthy at 16k tokens" in detection["markdown"]
    assert json.loads((main / DETECTION_FILE).read_text())["rows"] == detection["rows"]
    loud = run("loud", [("gqa-long16k", "fp8_e4m3:calibrated", "fail"), ("gqa-long16k", "fp8_e5m2", "pass")])
    assert not write_detection(main, entries, [], ((loud, long_entries),))["ok"]
