"""benchmarks/run_ab.py: how two trees' default runs are compared (records and verdict labels), and a run that is
no measurement stops the comparison by name."""

from __future__ import annotations

import json
import re
import sys

import pytest

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


def _stand_in_tree(tree):
    """A tree whose `python -m harness.cli run` prints the cache folders it was given and its "run complete" line."""
    (tree / "harness").mkdir(parents=True)
    (tree / "harness" / "__init__.py").write_text("")
    (tree / "harness" / "cli.py").write_text(
        "import json, os\n"
        f"print(json.dumps({{name: os.environ.get(name) for name in {run_ab.COLD_CACHES!r}}}))\n"
        "print('run complete in 1.5 s: out')\n")
    return tree


def test_a_cold_run_starts_from_empty_caches_of_its_own(tmp_path, monkeypatch):
    """`--cold`: the run's Triton cache, compiled kernels and ledgers are new empty folders under the work folder
    (the user's own caches untouched); a warm run keeps the environment's."""
    tree = _stand_in_tree(tmp_path / "tree")
    for name in run_ab.COLD_CACHES:
        monkeypatch.setenv(name, str(tmp_path / "mine" / name))
    wall, inside, code = run_ab.one_run(tree, tmp_path / "warm", "cpu", [])
    assert (inside, code) == (1.5, 0) and wall > 0
    warm = json.loads((tmp_path / "warm.log").read_text().splitlines()[0])
    assert warm == {name: str(tmp_path / "mine" / name) for name in run_ab.COLD_CACHES}
    run_ab.one_run(tree, tmp_path / "cold", "cpu", [], cold=tmp_path / "fresh")
    cold = json.loads((tmp_path / "cold.log").read_text().splitlines()[0])
    assert cold == {name: str(tmp_path / "fresh" / name) for name in run_ab.COLD_CACHES}
    assert all(not any((tmp_path / "fresh" / name).iterdir()) for name in run_ab.COLD_CACHES)


def test_cold_adds_a_row_of_each_tree_after_the_warm_rounds(tmp_path, monkeypatch, capsys):
    """The table's rows: warm-up, the rounds, then "cold"; each tree's cold run gets its own fresh folder, and the
    records compared are the last warm round's."""
    calls = []

    def one_run(tree, out, device, extra, cold=None, env_extra=None):
        calls.append((out.name, cold))
        # this tree: 10 s warm, 20 cold; HEAD: 20 s warm, 40 cold; every warm-up 99 s (left out of the means)
        wall = 99.0 if out.name.endswith("-0") else (1 if out.name.startswith("this") else 2) * (
            20.0 if out.name.endswith("cold") else 10.0)
        return wall, 1.0, 0
    monkeypatch.setattr(run_ab, "one_run", one_run)
    monkeypatch.setattr(run_ab, "unpack", lambda rev, work: run_ab.HERE)
    monkeypatch.setattr(run_ab, "compare", lambda mine, other: f"{mine.name} against {other.name}")
    monkeypatch.setattr(sys, "argv", ["run_ab.py", "--baseline", "HEAD", "--rounds", "1", "--cold", "--device", "cpu",
                                      "--work", str(tmp_path)])
    assert run_ab.main() == 0
    out = capsys.readouterr().out
    assert [line.split(" |")[0] for line in out.splitlines() if line.startswith("| ")][1:] == \
        ["| warm-up", "| 1", "| cold"]
    assert sorted(c for c in calls if c[1] is not None) == [
        ("HEAD-cold", tmp_path / "cold" / "HEAD-cold"), ("this-tree-cold", tmp_path / "cold" / "this-tree-cold")]
    assert "HEAD against this-tree-1" not in out and "this-tree-1 against HEAD-1" in out
    assert ("- this tree against HEAD, means: warm 10.00 s against 20.00 s (0.50x); cold 20.00 s against 40.00 s "
            "(0.50x)") in out


def test_the_means_are_of_the_warm_rounds_and_the_cold_run_only_where_both_ran():
    walls = {"this tree": {"warm": [10.0, 12.0], "cold": []}, "3a67195": {"warm": [30.0, 36.0], "cold": [44.0]}}
    assert run_ab.ratios(walls, ["this tree", "3a67195"]) == [
        "- this tree against 3a67195, means: warm 11.00 s against 33.00 s (0.33x)"]


def test_a_variant_is_this_tree_with_its_own_variables_and_arguments(tmp_path, monkeypatch, capsys):
    """`--variant "NAME: ENV=VALUE ... ARGS"`: this tree again, its words NAME=VALUE set in its environment and the
    rest given to harness run after the common arguments; this tree's own runs get neither."""
    calls = {}

    def one_run(tree, out, device, extra, cold=None, env_extra=None):
        calls[out.name] = (tree, extra, env_extra)
        return 10.0, 1.0, 0
    monkeypatch.setattr(run_ab, "one_run", one_run)
    monkeypatch.setattr(run_ab, "compare", lambda mine, other: "compared")
    monkeypatch.setattr(sys, "argv", ["run_ab.py", "--variant", "check64: HARNESS_IMPL_CHECK=0 --kernel-check-every 64",
                                      "--rounds", "1", "--device", "cpu", "--work", str(tmp_path), "--", "--jobs", "1"])
    assert run_ab.main() == 0
    assert calls["this-tree-1"] == (run_ab.HERE, ["--jobs", "1"], {})
    assert calls["check64-1"] == (run_ab.HERE, ["--jobs", "1", "--kernel-check-every", "64"],
                                  {"HARNESS_IMPL_CHECK": "0"})
    out = capsys.readouterr().out
    assert "| round | this tree | check64 |" in out and "- check64 against this tree: compared" in out


def test_a_variant_splits_its_words_into_variables_and_arguments():
    assert run_ab.parse_variant("noimpl: HARNESS_IMPL_CHECK=0 --paths 'bf16,fp8_e4m3'") == (
        "noimpl", {"HARNESS_IMPL_CHECK": "0"}, ["--paths", "bf16,fp8_e4m3"])


@pytest.mark.parametrize("text", ["HARNESS_IMPL_CHECK=0", ": --jobs 1", "empty:", "this tree: --jobs 1"])
def test_a_variant_without_a_name_of_its_own_or_a_setting_is_refused_by_its_text(text):
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        run_ab.parse_variant(text)
