"""The CLI's report, compare and export commands on the stored runs in tests/data/runs."""

from pathlib import Path

import pandas as pd

from harness.cli import main

RUNS = Path(__file__).parent / "data" / "runs"


def test_compare_exit_code_is_the_ci_signal(tmp_path, capsys):
    assert main(["compare", str(RUNS / "baseline"), str(RUNS / "noise"), "--out", str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out.startswith("OK: no regression")
    assert main(["compare", str(RUNS / "baseline"), str(RUNS / "regressed"), "--out", str(tmp_path / "b")]) == 1
    line = capsys.readouterr().out.strip()
    assert line.startswith("REGRESSION") and "\n" not in line  # one line for the CI log


def test_export_and_report(tmp_path, capsys):
    assert main(["export", str(RUNS / "baseline"), "--out", str(tmp_path / "records.csv")]) == 0
    table = pd.read_csv(tmp_path / "records.csv")
    assert {"model", "scenario", "path", "turn", "metric", "value"} <= set(table.columns)
    assert main(["report", str(RUNS / "baseline"), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "index.html").is_file()


def test_missing_run_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "not a stored run" in capsys.readouterr().err
