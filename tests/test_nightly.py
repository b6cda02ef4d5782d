"""`harness nightly` (the nightly job's local twin) on a two-night history: one canary, one two-token scenario,
one FP8 path, so CI pays seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from harness.cli import main
from harness.nightly import trend_table

ROOT = Path(__file__).resolve().parents[1]
GQA = ROOT / "harness" / "canary" / "weights" / "gqa"


@pytest.mark.slow
@pytest.mark.skipif(not (GQA / "config.json").exists(), reason="trained gqa canary not bundled")
def test_two_nights_compare_and_render_the_trend(tmp_path, capsys):
    source = yaml.safe_load((ROOT / "scenarios" / "canary" / "default.yaml").read_text())
    scenarios = tmp_path / "arith.yaml"
    scenarios.write_text(yaml.safe_dump({"scenarios": [s for s in source["scenarios"] if s["id"] == "canary-arith-3"]}))
    history = tmp_path / "history"
    argv = ["nightly", "--history", str(history), "--model", str(GQA), "--scenarios", str(scenarios),
            "--paths", "fp8_e4m3"]
    assert main(argv + ["--night", "2026-01-01"]) == 0
    assert "first night: nothing to compare with" in capsys.readouterr().out
    assert main(argv + ["--night", "2026-01-02"]) == 0
    printed = capsys.readouterr().out
    assert "OK: no regression beyond noise" in printed
    assert (history / "nights" / "2026-01-02" / "compare" / "compare.html").is_file()
    table = trend_table(history)
    assert list(dict.fromkeys(table["night"])) == ["2026-01-01", "2026-01-02"]
    assert set(table["path"]) == {"bf16", "fp8_e4m3", "fp8_e4m3:calibrated", "fp8_e4m3:calibrated:emulated",
                                  "bf16:chunked_prefill"} and (table["fail"] == 0).all()  # the twin, the control arm
    page = (history / "trend" / "index.html").read_text()
    assert "Nightly trend (2 nights)" in page and "trend-gqa.png" in page
    assert (history / "trend" / "trend-gqa.png").stat().st_size > 5000
    # a broken path tonight: exit 1, named, and the compare against last night regresses (a path A lacked fails)
    assert main(argv[:-1] + ["fp8_e4m3,fp8_e4m3:warmup", "--night", "2026-01-03"]) == 1
    printed = capsys.readouterr().out
    assert "VERDICT FAIL: gqa fp8_e4m3:warmup" in printed and "REGRESSION" in printed


@pytest.mark.slow
@pytest.mark.skipif(not (GQA / "config.json").exists(), reason="trained gqa canary not bundled")
def test_a_per_path_only_failure_fails_the_night(tmp_path, capsys):
    """No turn fails, a per-path check does (the pooled KL ratio under a --threshold no turn carries): exit 1."""
    from harness.nightly import run_night
    from harness.job import parse_kv_paths

    source = yaml.safe_load((ROOT / "scenarios" / "canary" / "default.yaml").read_text())
    scenarios = tmp_path / "arith.yaml"
    scenarios.write_text(yaml.safe_dump({"scenarios": [s for s in source["scenarios"] if s["id"] == "canary-arith-3"]}))
    night = run_night(tmp_path / "history", dict(models=(GQA,), scenario_paths=(scenarios,), jobs=1,
                                                   paths=parse_kv_paths("fp8_e5m2"), thresholds=("kl_mean_ratio:0",),
                                                   command="pytest tests/test_nightly.py"), night="n1")
    matrix = json.loads((night.run_dir / "manifest.json").read_text())["verdicts"]["gqa"]["fp8_e5m2"]
    assert matrix["fail"] == 0 and matrix["path"]["verdict"] == "fail"
    assert night.failing == [("gqa", "fp8_e5m2")] and night.exit_code == 1


def test_stress_suite_nights_get_their_own_histories(tmp_path, monkeypatch):
    """--suite stress: one night per stress suite under HISTORY/stress/<suite>, with the suite's models,
    scenarios and paths (not --model/--paths), one night name for all, the 16k set cut to one needle on the
    CPU only; --suite all runs the default night too."""
    from harness import nightly
    from harness.zoo import STRESS_SUITES

    calls = []
    monkeypatch.setattr(nightly, "run_night", lambda history, fields, night: calls.append((history, fields, night))
                        or nightly.NightResult(history / "nights" / night, [], None, False, history / "trend"))
    default = {"models": (GQA,), "scenario_paths": (ROOT / "scenarios" / "canary" / "default.yaml",),
               "paths": (), "device": "cpu", "command": "harness nightly --suite stress"}
    results = nightly.run_nights(tmp_path, default, "stress", "n1")
    assert [name for name, _ in results] == ["stress/variants", "stress/long-context"]
    assert [c[0] for c in calls] == [tmp_path / "stress" / s.name for s in STRESS_SUITES]
    assert {c[2] for c in calls} == {"n1"}
    variants, long_context = calls[0][1], calls[1][1]
    assert GQA not in variants["models"] and len(variants["models"]) == 3 and variants["select"] == ()
    assert [p.canonical for p in long_context["paths"]][0] == "bf16" and len(long_context["paths"]) == 4
    assert long_context["select"] == ("id:canary-stress-needle16k-01",)
    calls.clear()
    nightly.run_nights(tmp_path, default | {"device": "cuda"}, "all", "n2")
    assert calls[0][0] == tmp_path and calls[0][1]["models"] == (GQA,)  # the default night: --model and --paths
    assert calls[2][1]["select"] == ()  # every needle on CUDA
    with pytest.raises(ValueError, match="--suite 'nightly'"):
        nightly.run_nights(tmp_path, default, "nightly")


def test_the_default_night_measures_the_reference_noise(tmp_path, monkeypatch):
    """Without --paths a night replays the default paths, the yardstick and the fp32 reference (its precision
    noise, shown beside the yardstick); --paths replaces the defaults (the yardstick is still added)."""
    from harness import nightly

    seen = []
    done = nightly.NightResult(tmp_path / "n", [], None, False, tmp_path / "trend")
    monkeypatch.setattr(nightly, "run_nights",
                        lambda history, fields, suite, night: seen.append(fields) or [("default", done)])
    assert main(["nightly", "--history", str(tmp_path)]) == 0
    assert main(["nightly", "--history", str(tmp_path), "--paths", "fp8_e4m3"]) == 0
    default, chosen = ([p.canonical for p in fields["paths"]] for fields in seen)
    assert "fp32" in default and "fp8_e4m3:per_tensor:calibrated:sat" in default
    assert "fp32" not in chosen


def _night_from(source: Path, units_done: int | None = None):
    """A stand-in for `job.run_job` that stores `source` (killed after `units_done` units when given) as tonight."""
    import shutil

    from test_compare import killed_copy

    def run_job(config):
        if units_done is None:
            shutil.copytree(source, config.out)
        else:
            killed_copy(source, config.out, units_done)
        return config.out
    return run_job


@pytest.mark.parametrize("killed", ["last night", "tonight"])
def test_a_night_is_not_compared_with_an_incomplete_run(tmp_path, monkeypatch, killed):
    """A night killed after 3 of 12 units (or one with no records at all) says nothing about a regression:
    exit 3, naming that night and its units."""
    from types import SimpleNamespace

    from harness import job, nightly, run_config
    from test_compare import RUNS, killed_copy

    history = tmp_path / "history"
    (history / "nights").mkdir(parents=True)
    monkeypatch.setattr(run_config, "build_run_config", lambda out, **fields: SimpleNamespace(out=out))
    if killed == "last night":
        killed_copy(RUNS / "baseline", history / "nights" / "n1", units_done=0)
    else:
        monkeypatch.setattr(job, "run_job", _night_from(RUNS / "baseline"))
        nightly.run_night(history, {}, "n1")
    monkeypatch.setattr(job, "run_job", _night_from(RUNS / "baseline", 3 if killed == "tonight" else None))
    night = nightly.run_night(history, {}, "n2")
    assert night.exit_code == 3 and not night.regressed
    unfinished = history / "nights" / ("n1" if killed == "last night" else "n2")
    units = "0 of 12 units" if killed == "last night" else "3 of 12 units"
    assert "NOT COMPARED" in night.compare_line and str(unfinished) in night.compare_line and units in night.compare_line


@pytest.mark.parametrize("night", ["../x", "a/b", "..", ".", "/tmp/abs", ""])
def test_a_night_name_that_leaves_the_history_is_refused(tmp_path, capsys, night):
    """Issue 45: `--night ../x` wrote its run outside HISTORY/nights. A night is one plain directory name:
    anything else exits 2 naming --night and the value, before any run, nothing written."""
    history = tmp_path / "history"
    assert main(["nightly", "--history", str(history), "--night", night]) == 2
    err = capsys.readouterr().err
    assert f"--night {night!r}" in err and "Traceback" not in err, err
    assert not history.exists() and not (tmp_path / "x").exists()


@pytest.mark.parametrize("planted", ["nights", "trend", "trend/index.html", "."])
def test_a_history_part_of_the_wrong_type_is_refused_before_work(tmp_path, capsys, planted):
    """Issue 45: a history whose nights/ or trend/ is a file, or trend/index.html a directory, traced back (exit
    1), after the night's run. Now exit 2 before any run, naming the part."""
    history = tmp_path / "history"
    part = history / planted  # "." is the history itself
    part.parent.mkdir(parents=True, exist_ok=True)
    part.mkdir() if planted == "trend/index.html" else part.write_text("x")
    assert main(["nightly", "--history", str(history), "--night", "n1"]) == 2
    err = capsys.readouterr().err
    assert f"{part} is not a" in err and "Traceback" not in err, err
    assert not (history / "nights" / "n1").exists() or not history.is_dir()
