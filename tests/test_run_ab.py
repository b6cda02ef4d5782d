"""benchmarks/run_ab.py: how two trees' default runs are compared (records and verdict labels), and a run that is
no measurement stops the comparison by name."""

from __future__ import annotations

import json
import sys

from benchmarks import run_ab


def _run(directory, records, verdicts=()):
    directory.mkdir()
    (directory / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (directory / "verdicts.jsonl").write_text("".join(json.dumps(v) + "\n" for v in verdicts))
    return directory


def _record(metric, value, path="fp8_e4m3"):
    return {"model": "gqa", "scenario": "s", "path": path, "turn": 0, "metric": metric, "value": value}


def test_compare_leaves_timings_out_and_names_what_differs(tmp_path):
    same = [_record("kl_mean", 0.1), _record("reply_tokens", 4.0, "reference")]
    verdict = {"model": "gqa", "path": "fp8_e4m3", "scenario": "s", "turn": 0, "verdict": "pass"}
    mine = _run(tmp_path / "a", [*same, _record("decode_seconds", 1.0)], [verdict])
    other = _run(tmp_path / "b", [*same, _record("decode_seconds", 2.0)], [verdict])
    assert run_ab.compare(mine, other) == "records identical (2 rows); verdict labels identical"
    moved = _run(tmp_path / "c", [_record("kl_mean", 0.2), same[1]], [verdict | {"verdict": "fail"}])
    assert run_ab.compare(mine, moved) == ("records differ in 2 of 2 rows: kl_mean on fp8_e4m3 (2); "
                                           "verdict labels DIFFER")


def test_a_run_that_is_no_measurement_stops_the_comparison(tmp_path, monkeypatch, capsys):
    """An unknown path spec: `harness run` exits 2 at its inputs; the script says which tree and where its output is,
    and exits 2 without a table."""
    monkeypatch.setattr(sys, "argv", ["run_ab.py", "--baseline", "HEAD", "--device", "cpu", "--work", str(tmp_path),
                                      "--", "--paths", "not_a_format"])
    monkeypatch.setattr(run_ab, "unpack", lambda rev, work: run_ab.HERE)  # this tree twice: no archive needed
    assert run_ab.main() == 2
    captured = capsys.readouterr()
    assert "error: this tree exited 2" in captured.err and "| round |" not in captured.out
    log = tmp_path / "runs" / "this-tree-0.log"
    assert "not_a_format" in log.read_text()
