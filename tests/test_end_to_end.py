"""`harness run` end to end on tiny random models of all three families, and resume after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from harness.cli import main
from harness.replay.route import ONE_AT_A_TIME, ROWS, onednn_bf16
from harness.runs.summary import records_frame

SCENARIOS = Path(__file__).parent / "data" / "scenarios" / "smoke.yaml"
PATHS = "bf16,fp8_e4m3,fp8_e5m2:per_token,fp8_e4m3:per_head:calibrated"


def _table(run_dir: Path) -> pd.DataFrame:
    frame = records_frame(run_dir)
    return frame.sort_values(["model", "scenario", "path", "turn", "metric"]).reset_index(drop=True)


@pytest.fixture(scope="module")
def full_run(tiny_models, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "full"
    argv = ["run", "--out", str(out), "--scenarios", str(SCENARIOS), "--paths", PATHS, "--no-progress"]
    for arch in ("gqa", "mla", "hybrid"):
        argv += ["--model", str(tiny_models[arch])]
    assert main(argv) == 0
    return out


def test_every_model_path_and_turn_has_records(full_run):
    frame = _table(full_run)
    assert set(frame["model"]) == {"gqa", "mla", "hybrid"}
    # the verdicts' yardstick path (fp8_e4m3:calibrated, docs/VERDICTS.md) joins the named paths
    assert set(frame["path"]) == {"reference", *PATHS.split(","), "fp8_e4m3:calibrated", "fp8_e4m3:calibrated:emulated", "bf16:chunked_prefill"}
    kl = frame[frame["metric"] == "kl_max"]
    # 4 scenarios; the chat's fixed middle turn generates nothing: 2 + 1 + 2 + 1 generated turns; 7 paths (5, the
    # yardstick's twin, the control arm).
    assert len(kl) == 3 * 6 * 7
    manifest = json.loads((full_run / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert {m["label"] for m in manifest["models"]} == {"gqa", "mla", "hybrid"}
    assert set(manifest["families"]) == {"gqa", "mla", "hybrid"}  # noted by the CPU tasks too (the report shows it)
    assert all(m["random_weights"] for m in manifest["models"])
    assert manifest["versions"]["torch"] and manifest["scenario_files"][0]["sha256"]
    for entry in manifest["paths"]:  # each path's route, per model (harness.replay.route)
        assert set(entry["routes"]) == {"gqa", "mla", "hybrid"}, entry
        for route in entry["routes"].values():
            assert route["decode_kernel"] == "kernels off (CPU, or HARNESS_KERNELS=off)"
            # the CPU replay in rows where the GEMMs give a row the same bits in any batch (route._rows)
            rows = ROWS if not onednn_bf16() else ONE_AT_A_TIME + "; rows refused: oneDNN has bf16 GEMMs"
            assert route["decode"].startswith(rows) and route["batched"] is False


def test_bf16_noise_floor_is_exactly_zero(full_run):
    frame = _table(full_run)
    bf16 = frame[frame["path"] == "bf16"].set_index("metric")["value"]
    assert (bf16.loc["kl_max"] == 0).all() and (bf16.loc["exact_match"] == 1).all()
    assert (bf16.loc["top1_agree"] >= 0).all()
    manifest = json.loads((full_run / "manifest.json").read_text())
    assert all(max(floor.values()) == 0 for floor in manifest["noise_floor"].values())


def test_fp8_paths_measure_some_divergence(full_run):
    frame = _table(full_run)
    fp8 = frame[(frame["path"] != "bf16") & (frame["path"] != "reference") & (frame["metric"] == "kl_max")]
    assert (fp8["value"] > 0).any() and (fp8["value"] >= 0).all()


def test_texts_series_and_checks_are_stored(full_run):
    texts = [json.loads(line) for line in (full_run / "texts.jsonl").read_text().splitlines()]
    fixed = [t for t in texts if t["scenario"] == "smoke-chat" and t["turn"] == 1]
    assert fixed and all(t["text"] == "Ten dollars. Thanks" and t["fixed"] for t in fixed)
    series = [json.loads(line) for line in (full_run / "series.jsonl").read_text().splitlines()]
    # per token: divergence, and the reference's entropy, top-1 margin and flips the verdict statistics stratify by
    assert {s["series"] for s in series} == {"kl", "top1_agree", "ref_logprob_delta", "ref_rank", "ref_entropy",
                                             "ref_margin", "flip"}
    checks = [json.loads(line) for line in (full_run / "checks.jsonl").read_text().splitlines()]
    assert checks and all(c["metric"] == "kl_max" and c["scenario"] == "smoke-arith" for c in checks)
    assert (full_run / "report" / "index.html").is_file()


def test_own_history_differs_only_in_history(tiny_models, tmp_path):
    out = tmp_path / "own"
    argv = ["run", "--out", str(out), "--scenarios", str(SCENARIOS), "--paths", "bf16", "--no-progress",
            "--model", str(tiny_models["gqa"]), "--history-mode", "own-history"]
    assert main(argv) == 0
    frame = _table(out)
    assert (frame[(frame["path"] == "bf16") & (frame["metric"] == "exact_match")]["value"] == 1).all()


def test_calibration_scenarios_set_the_scales(tiny_models, tmp_path):
    out = tmp_path / "calibrated"
    assert main(["run", "--out", str(out), "--scenarios", str(SCENARIOS), "--paths", "fp8_e4m3:calibrated",
                 "--calibration", str(SCENARIOS), "--model", str(tiny_models["gqa"]), "--no-progress"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    scales = manifest["scales"]["gqa"]["fp8_e4m3:calibrated"]
    assert scales["source"] == "calibrated" and "4 calibration chats" in scales["provenance"]
    assert 0 < scales["k_scale"]["min"] <= scales["k_scale"]["max"]
    assert manifest["calibration_files"] == [str(SCENARIOS)]


def test_bad_inputs_fail_before_running(tiny_models, tmp_path, capsys):
    assert main(["run", "--paths", "fp8:per_chanel", "--model", str(tiny_models["gqa"]),
                 "--out", str(tmp_path / "a"), "--scenarios", str(SCENARIOS)]) == 2
    assert "unknown option 'per_chanel'" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("scenarios:\n  - id: x\n    kind: chat\n    turns: []\n")
    assert main(["run", "--scenarios", str(broken), "--model", str(tiny_models["gqa"]),
                 "--out", str(tmp_path / "b")]) == 2
    assert "broken.yaml" in capsys.readouterr().err and not (tmp_path / "b").exists()


def _harness(*args: str, ignore_sigint: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None)


@pytest.mark.slow
@pytest.mark.parametrize("how, jobs", [(signal.SIGKILL, "2"), pytest.param(signal.SIGINT, "2", marks=pytest.mark.matrix),
                                       pytest.param(signal.SIGTERM, "1", marks=pytest.mark.matrix)])
def test_resume_after_kill_gives_the_same_table(tiny_models, full_run, tmp_path, how, jobs):
    # Two of the three families keep this test short; the models are independent within a run. SIGTERM goes
    # to a one-process run (the replay's event loop is in the main process) started, as a shell's background
    # job is, with SIGINT ignored: it must still stop cleanly.
    out = tmp_path / "killed"
    args = ["run", "--out", str(out), "--scenarios", str(SCENARIOS), "--paths", PATHS, "--no-progress", "--jobs", jobs]
    for arch in ("gqa", "mla"):
        args += ["--model", str(tiny_models[arch])]
    process = _harness(*args, ignore_sigint=how == signal.SIGTERM)
    done = out / "done.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not done.exists() or len(done.read_text().splitlines()) < 12):
        time.sleep(0.05)
    os.kill(process.pid, how)
    _, stderr = process.communicate(timeout=60)
    finished_before = len(done.read_text().splitlines())
    assert 12 <= finished_before < 2 * 4 * 6, "the kill must land mid-run"
    if how != signal.SIGKILL:
        assert process.returncode == 130 and "interrupted: finished work is stored" in stderr
        assert "Traceback" not in stderr and "Task was destroyed" not in stderr, stderr
        assert json.loads((out / "manifest.json").read_text())["status"] == "interrupted"
    resumed = _harness(*args, "--resume")
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    done_rows = [json.loads(line) for line in done.read_text().splitlines()]
    assert len(done_rows) == len({tuple(r.values()) for r in done_rows}) == 2 * 4 * 8  # nothing done twice (5 paths, the yardstick, its twin, the control arm)
    expected = _table(full_run)
    expected = expected[expected["model"].isin(["gqa", "mla"])].reset_index(drop=True)
    pd.testing.assert_frame_equal(_table(out), expected)


def test_run_against_live_servers(tiny_models, tmp_path):
    """`harness run --reference URL --candidate LABEL=URL` against two `harness serve` apps on loopback:
    the stored run has the same shape as an in-process one, judged by the rule and agreement judges."""
    import contextlib

    from harness.serve import build_app, load_served_model, running_server

    with contextlib.ExitStack() as stack:
        urls = {spec: stack.enter_context(running_server(build_app(load_served_model(tiny_models["gqa"], spec))))
                for spec in ("reference", "fp8_e4m3")}
        out = tmp_path / "live"
        assert main(["run", "--out", str(out), "--scenarios", str(SCENARIOS), "--no-progress",
                     "--reference", urls["reference"], "--candidate", f"fp8={urls['fp8_e4m3']}"]) == 0
    frame = _table(out)
    assert set(frame["model"]) == {"endpoint"} and set(frame["path"]) == {"reference", "fp8"}
    assert {"kl_max", "exact_match", "judge_rule", "judge_agreement"} <= set(frame["metric"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["paths"][0]["name"] == "fp8"
    assert (out / "report" / "index.html").is_file()


def test_dead_endpoint_is_refused_before_any_work(tmp_path, capsys):
    """Endpoint pre-flight (exit 2): one error naming each dead server, instead of per-unit retries."""
    out = tmp_path / "dead"
    dead = "http://127.0.0.1:9"  # discard port: nothing listens, the connection is refused
    assert main(["run", "--out", str(out), "--scenarios", str(SCENARIOS), "--no-progress",
                 "--reference", dead, "--candidate", dead]) == 2
    err = capsys.readouterr().err
    assert "endpoint pre-flight failed" in err and f"reference {dead}: " in err and f"candidate {dead}: " in err
    assert "Traceback" not in err and not out.exists()
