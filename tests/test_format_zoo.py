"""The zoo's cache-format classes (harness/zoo.py FORMAT_FAULT_CLASSES, issue 41): each fault, from a bug an engine
shipped in a block-scaled or FP4 cache, fails at the default verdicts on every canary where it applies, as its own
path and engine-wide (every healthy new-format path of the run has it, under its healthy name), while the healthy
new-format paths fail nothing. The canary runs are slow (the real canaries on the CPU); the registry checks are not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.analysis.verdicts import DEFAULT_YARDSTICK
from harness.job import CANARY_WEIGHTS, REPO_ROOT, run_job
from harness.kv_paths.format_faults import FORMAT_FAULTS
from harness.kv_paths.spec import parse_path, parse_paths
from harness.run_config import build_run_config
from harness.runs.gate import with_controls
from harness.runs.status import EXIT_VERDICT_FAILED, run_exit_code
from harness.zoo import (FORMAT_FAULT_CLASSES, FORMAT_FAULT_ENTRIES, FORMAT_MEASURED, HEALTHY_FORMAT_PATHS,
                         FormatFaultClass, under_healthy_names, zoo_entries)

SCENARIOS = REPO_ROOT / "tests" / "data" / "zoo_scenarios.yaml"  # 3 of the default canary scenarios, 6 turns
MODELS = ("gqa", "mla", "hybrid")
CASES = [(c, m) for c in FORMAT_FAULT_CLASSES for m in c.models]
# CI's sample of the engine-wide cases (the rest: --matrix, the nightly)
CI_CASES = {("v_scale_first_blocks", "gqa")}
ENGINE_WIDE_PARAMS = [pytest.param(c, m, id=f"{c.fault}-{m}",
                                   marks=() if (c.fault, m) in CI_CASES else pytest.mark.matrix) for c, m in CASES]


def test_every_format_fault_is_a_zoo_class_with_its_source():
    assert sorted(c.fault for c in FORMAT_FAULT_CLASSES) == sorted(FORMAT_FAULTS)
    assert len(FORMAT_FAULT_ENTRIES) == len(CASES) and set(FORMAT_FAULT_ENTRIES) <= set(zoo_entries("cpu"))
    docs = (REPO_ROOT / "docs" / "FORMATS.md").read_text()
    for fault_class in FORMAT_FAULT_CLASSES:
        assert fault_class.source and set(fault_class.models) <= set(MODELS), fault_class
        assert f"fault={fault_class.fault}" in docs, f"docs/FORMATS.md does not list {fault_class.fault}"
        assert set(fault_class.models) | {m for m in MODELS if m in fault_class.not_applied} == set(MODELS), \
            f"{fault_class.label}: say why a canary is left out"
        reached = [p for p in under_healthy_names(tuple(parse_paths(",".join(HEALTHY_FORMAT_PATHS))),
                                                  fault_class.engine_wide("gqa")) if p.fault]
        assert parse_path(fault_class.fmt).name in {p.name for p in reached}, fault_class.label


def test_engine_wide_keeps_names_and_leaves_the_yardstick_alone():
    """Under the healthy names: each new-format path it reaches carries the fault, the FP8 yardstick and BF16 do not
    (a cache-format fault has no FP8 static-scale cache to reach), nor a format it cannot reach (e8m0 on NVFP4)."""
    paths = tuple(parse_paths(",".join(("bf16", DEFAULT_YARDSTICK, *HEALTHY_FORMAT_PATHS))))
    bias = next(c for c in FORMAT_FAULT_CLASSES if c.fault == "e8m0_bias")
    faulty = {p.name: p.fault for p in under_healthy_names(paths, bias.engine_wide("gqa"))}
    assert faulty == {"bf16": "", DEFAULT_YARDSTICK: "", "nvfp4": "", "mxfp8": "e8m0_bias", "mxfp4": "e8m0_bias",
                      "int8_per_token_head": "", "int4_per_token_head": "", "fp8_per_token_head": "",
                      "k=fp8_e4m3/v=nvfp4": ""}


def _run(out: Path, model: str, paths: tuple) -> Path:
    paths = tuple(p for p in with_controls(paths, DEFAULT_YARDSTICK))
    config = build_run_config(command="pytest tests/test_format_zoo.py", models=(CANARY_WEIGHTS / model,),
                              scenario_paths=(SCENARIOS,), paths=paths, out=out, jobs=1, device="cpu")
    return run_job(config)


def _failing(run_dir: Path) -> dict[str, str]:
    """path -> why it fails: its failing turns, or a failing per-path check ("" passes)."""
    turns: dict[str, int] = {}
    for row in map(json.loads, (run_dir / "verdicts.jsonl").read_text().splitlines()):
        turns[row["path"]] = turns.get(row["path"], 0) + (row["verdict"] == "fail")
    out = {}
    for row in map(json.loads, (run_dir / "path_verdicts.jsonl").read_text().splitlines()):
        checks = [r["check"] for r in row.get("reasons", []) if r["severity"] == "fail"]
        out[row["path"]] = (f"{turns.get(row['path'], 0)} failing turns " if turns.get(row["path"]) else "") + \
            " ".join(checks)
    return out


@pytest.mark.slow
@pytest.mark.matrix  # CI: the zoo (tests/test_zoo.py) runs the format faults beside the healthy formats
@pytest.mark.parametrize("model", MODELS)
def test_format_faults_fail_beside_healthy_new_formats(model, tmp_path):
    """On one canary: every class that applies there, as its own path, fails; every healthy new-format path passes
    (no failing turn, no failing per-path check), but those measured for their own loss (FORMAT_MEASURED)."""
    presets = [c.path for c in FORMAT_FAULT_CLASSES if model in c.models]
    run_dir = _run(tmp_path / "run", model, tuple(parse_paths(",".join(("bf16", *HEALTHY_FORMAT_PATHS, *presets)))))
    failing = _failing(run_dir)
    print(json.dumps(failing, indent=1))
    assert all(failing[p] for p in presets), f"{model}: missed: {[p for p in presets if not failing[p]]}"
    healthy = [p for p in HEALTHY_FORMAT_PATHS if (model, p) not in FORMAT_MEASURED]
    assert not any(failing[p] for p in healthy), f"{model}: false alarm: {failing}"


@pytest.mark.slow
@pytest.mark.parametrize("fault_class, model", ENGINE_WIDE_PARAMS)
def test_format_fault_engine_wide_fails_the_run(fault_class: FormatFaultClass, model, tmp_path):
    """Every new-format path of the run has the fault under its healthy name: the run exits 1 and the class's own
    format fails; the yardstick is untouched (its twin ratio stays 1)."""
    paths = under_healthy_names(tuple(parse_paths(",".join(("bf16", *HEALTHY_FORMAT_PATHS)))),
                                fault_class.engine_wide(model))
    run_dir = _run(tmp_path / "run", model, paths)
    failing = _failing(run_dir)
    print(fault_class.fault, model, json.dumps(failing, indent=1))
    assert run_exit_code(run_dir) == EXIT_VERDICT_FAILED, f"{fault_class.label} on {model}: the run passed"
    assert failing[fault_class.fmt], f"{fault_class.label} on {model}: {fault_class.fmt} passed with the fault"
    assert not failing[DEFAULT_YARDSTICK]
