"""`pytest harness` end to end with pytester: items per model x scenario x path, verdicts as outcomes, a
diagnosis on failure, one stored run with its report, --baseline, -n 2 merged into one run, --gpu refused
without CUDA. Each session replays the real gqa/mla canaries on one two-token arithmetic scenario."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CANARY = ROOT / "harness" / "canary" / "weights"
pytestmark = pytest.mark.skipif(not (CANARY / "gqa" / "config.json").exists(), reason="trained canaries not bundled")


@pytest.fixture
def scenario_file(tmp_path: Path) -> Path:
    """canary-arith-3 alone: the gqa canary answers it in bf16, and warm-up scales break that answer."""
    source = yaml.safe_load((ROOT / "scenarios" / "canary" / "default.yaml").read_text())
    target = tmp_path / "arith.yaml"
    target.write_text(yaml.safe_dump({"scenarios": [s for s in source["scenarios"] if s["id"] == "canary-arith-3"]}))
    return target


def harness_session(pytester: pytest.Pytester, scenario_file: Path, *args: str, models=("gqa",)):
    argv = ["-p", "harness.pytest_plugin", "--noconftest", "harness", "-v", "--scenarios", str(scenario_file),
            "--report-dir", str(pytester.path / "runs")]
    for model in models:
        argv += ["--model", str(CANARY / model)]
    return pytester.runpytest_subprocess(*argv, *args)


def stored_runs(pytester: pytest.Pytester) -> list[Path]:
    return sorted(p for p in (pytester.path / "runs").glob("pytest-*") if not p.name.endswith(".parts"))


@pytest.mark.slow
def test_healthy_paths_pass_the_run_is_stored_and_the_yardstick_is_chosen_like_harness_runs(pytester,
                                                                                            scenario_file):
    """One session (each costs a pytest process and a replay): healthy items pass, the run and its report are
    stored, and --yardstick picks the verdicts' yardstick as `harness run` does (a bad one exits 2)."""
    result = harness_session(pytester, scenario_file, "--paths", "fp8_e4m3", "--yardstick", "fp8_e4m3:per_head:calibrated")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*gqa::canary-arith-3::bf16 PASSED*", "*gqa::canary-arith-3::fp8_e4m3 PASSED*",
                                 "*stored run: *", "*report: *index.html"])
    (run,) = stored_runs(pytester)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["verdicts"]["gqa"]["fp8_e4m3"]["pass"] == 1
    assert (run / "verdicts.jsonl").exists() and (run / "report" / "index.html").exists()
    assert manifest["yardstick"] == "fp8_e4m3:per_head:calibrated"
    texts = {json.loads(line)["path"] for line in (run / "texts.jsonl").read_text().splitlines()}
    assert "fp8_e4m3:per_head:calibrated" in texts and "fp8_e4m3:calibrated" not in texts
    bad = harness_session(pytester, scenario_file, "--yardstick", "fp9_nope")
    assert bad.ret == 2 and "fp8-harness:" in str(bad.stdout) + str(bad.stderr)


@pytest.mark.slow
def test_a_broken_path_fails_with_a_diagnosis_and_a_per_path_only_failure_fails_the_session(pytester,
                                                                                             scenario_file):
    """One session: warm-up scales fail their item with a diagnosis against the default yardstick; fp8_e5m2's items
    all pass, but a per-path check fails (a --threshold on the pooled KL ratio, a metric no turn has): the session
    exits 1 and names the path (issue 40: per-path failures belong to no item)."""
    result = harness_session(pytester, scenario_file, "--paths", "fp8_e5m2,fp8_e4m3:warmup",
                             "--threshold", "kl_mean_ratio:0")
    result.assert_outcomes(passed=2, failed=1)
    assert result.ret == 1
    result.stdout.fnmatch_lines([
        "*gqa::canary-arith-3::fp8_e4m3:warmup turn 0: FAIL",
        "*[[]fail] divergence: kl_mean * the yardstick fp8_e4m3:calibrated*",
        "*first divergent token 0: reference * vs path *",
        "*reference reply: '96'*",
    ])
    result.stdout.fnmatch_lines(["*VERDICT FAIL (per-path check): gqa fp8_e5m2: pooled kl_mean * the yardstick*"])


@pytest.mark.slow
@pytest.mark.matrix
def test_xdist_workers_merge_into_one_run_and_baseline_compares(pytester, scenario_file):
    first = harness_session(pytester, scenario_file, "--paths", "fp8_e4m3", models=("gqa", "mla"))
    first.assert_outcomes(passed=4)
    (baseline,) = stored_runs(pytester)
    second = harness_session(pytester, scenario_file, "--paths", "fp8_e4m3", "-n", "2", "--baseline", str(baseline),
                             models=("gqa", "mla"))
    second.assert_outcomes(passed=4)
    second.stdout.fnmatch_lines(["*compare with *: OK: no regression beyond noise*", "*compare report: *compare.html"])
    merged = [r for r in stored_runs(pytester) if r != baseline]
    assert len(merged) == 1  # both workers' parts in one stored run
    manifest = json.loads((merged[0] / "manifest.json").read_text())
    assert set(manifest["verdicts"]) == {"gqa", "mla"}
    parts = sorted(p.name.split("-", 1)[1] for p in merged[0].with_name(merged[0].name + ".parts").iterdir())
    assert parts == ["gqa", "mla"]  # the plugin's scheduler: each model on one worker, replayed once
    texts = [json.loads(line) for line in (merged[0] / "texts.jsonl").read_text().splitlines()]
    keys = [(t["model"], t["scenario"], t["path"], t["turn"]) for t in texts]
    # 2 models x (reference, bf16, fp8_e4m3, the verdicts' yardstick fp8_e4m3:calibrated): merged without duplicates
    assert len(keys) == len(set(keys)) == 12  # with the yardstick's twin and the control arm


def test_gpu_without_cuda_is_an_error_not_skips(pytester):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "harness.pytest_plugin", "--gpu")
    assert result.ret == 2
    assert "--gpu given but torch" in str(result.stdout) + str(result.stderr)


def test_ordinary_sessions_collect_no_scenario_items(pytester):
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "harness.pytest_plugin", "--collect-only", "-q")
    result.stdout.fnmatch_lines(["test_x.py::test_x", "1 test collected*"])


def test_a_bad_path_spec_is_a_usage_error(pytester, scenario_file):
    result = harness_session(pytester, scenario_file, "--paths", "fp8:per_chanel")
    assert result.ret == 2  # input refused before anything ran (docs/CONTRACTS.md exit codes)
    assert "fp8-harness: " in str(result.stdout) + str(result.stderr) and "per_chanel" in str(result.stdout)


@pytest.mark.slow
@pytest.mark.matrix
def test_endpoint_sessions_take_a_request_timeout_recorded_in_the_manifest(pytester, scenario_file):
    """Issue 28: `--request-timeout` for endpoint sessions, as for `harness run`; a bad value is a usage error."""
    from harness.serve import running_server
    from test_endpoint_validation import QUIET, fault_app

    with running_server(fault_app(set()), log_level=QUIET) as url:
        endpoints = ("--reference-endpoint", url, "--candidate-endpoint", f"fake={url}")
        result = harness_session(pytester, scenario_file, *endpoints, "--request-timeout", "7.5", models=())
        refused = harness_session(pytester, scenario_file, *endpoints, "--request-timeout", "0", models=())
    result.assert_outcomes(passed=1)
    (run,) = stored_runs(pytester)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["request_timeout_s"] == 7.5
    assert manifest["paths"][0]["endpoint"]["policy"]["timeout_s"] == 7.5
    assert refused.ret == 4 and "--request-timeout: must be a positive, finite number of seconds" in refused.stderr.str()


def test_pytest_harness_from_outside_the_checkout_collects(tmp_path, scenario_file):
    """Issue 45: with the README's editable install, `pytest harness` from any other directory exited 4
    ("Defining 'pytest_plugins' in a non-top-level conftest": the checkout's conftest.py, loaded late as the
    package's parent). The plugin's own tests pass --noconftest, which hid it; this one runs as a user does."""
    import os
    import subprocess
    import sys

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = os.environ | {"PYTHONPATH": str(ROOT)}  # the package of this checkout, as the editable install maps it
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "harness.pytest_plugin", "harness", "--collect-only",
                           "-q", "-p", "no:cacheprovider", "--model", str(CANARY / "gqa"), "--scenarios",
                           str(scenario_file), "--paths", "fp8_e4m3"],
                          cwd=outside, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "gqa::canary-arith-3::fp8_e4m3" in done.stdout
