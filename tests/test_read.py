"""The one run reader (harness/runs/read.py): what report, compare, summary, gate, the attention views and the
nightly trend read, on the stored runs in tests/data/runs and broken copies of them."""

from __future__ import annotations

import ast
import json
import math
import shutil
from pathlib import Path

import pytest

from harness.cli import main
from harness.kv_paths.spec import parse_path
from harness.runs.compare import compare_runs
from harness.runs.read import RunReadError, path_entry, read_run
from harness.runs.summary import format_summary, summary_table

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "tests" / "data" / "runs"


@pytest.fixture
def baseline(tmp_path) -> Path:
    """A copy of the baseline run to break."""
    return Path(shutil.copytree(RUNS / "baseline", tmp_path / "baseline"))


def break_line(path: Path, number: int) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines[number - 1] = lines[number - 1][: len(lines[number - 1]) // 2] + "\n"
    path.write_text("".join(lines))


def test_a_corrupt_line_is_named_by_file_and_line(baseline):
    break_line(baseline / "records.jsonl", 3)
    with pytest.raises(RunReadError, match=r"records\.jsonl:3: not JSON"):
        read_run(baseline).records  # noqa: B018


def test_a_torn_last_line_is_skipped_as_resume_drops_it(baseline):
    whole = len(read_run(baseline).records)
    with (baseline / "records.jsonl").open("a") as handle:
        handle.write('{"model": "canary-mla", "scen')  # a kill mid-write
    assert len(read_run(baseline).records) == whole


def test_a_line_that_is_not_an_object_is_named(baseline):
    with (baseline / "checks.jsonl").open("r+") as handle:
        rows = handle.read()
        handle.seek(0)
        handle.write("[1, 2]\n" + rows)
    with pytest.raises(RunReadError, match=r"checks\.jsonl:1: a list, not a JSON object"):
        read_run(baseline).checks  # noqa: B018


def test_parts_load_when_asked(baseline):
    """A summary never parses texts.jsonl: a broken texts table leaves it readable."""
    break_line(baseline / "texts.jsonl", 1)
    assert "canary-mla" in format_summary(baseline)
    with pytest.raises(RunReadError, match=r"texts\.jsonl:1"):
        read_run(baseline).texts  # noqa: B018


@pytest.mark.parametrize("command", [["report", "{run}", "--out", "{out}"], ["compare", "{base}", "{run}", "--out", "{out}"],
                                     ["export", "{run}", "--format", "csv", "--out", "{out}"]])
def test_the_cli_names_the_broken_file_without_a_traceback(baseline, tmp_path, capsys, command):
    break_line(baseline / "records.jsonl", 5)
    argv = [a.format(run=baseline, base=RUNS / "baseline", out=tmp_path / "out") for a in command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {baseline / 'records.jsonl'}:5: not JSON" in err
    assert "Traceback" not in err


def test_a_directory_without_a_manifest_is_not_a_run(tmp_path, capsys):
    (tmp_path / "records.jsonl").write_text("")
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert f"{tmp_path} is not a stored run: no manifest.json" in capsys.readouterr().err
    (tmp_path / "manifest.json").write_text('{"run_id": "x",\n "paths": [}\n')
    with pytest.raises(RunReadError, match=r"manifest\.json:2: not JSON"):
        read_run(tmp_path)


def test_paths_have_one_shape_in_every_stored_run():
    """Every stored run reads as name, canonical, kind and a one-line description (the shape since session 7)."""
    for run in sorted(RUNS.iterdir()):
        for path in read_run(run).manifest["paths"]:
            assert isinstance(path["description"], str) and "\n" not in path["description"], (run, path)
            assert path["kind"] == "kv_path" and path["canonical"], (run, path)


def test_an_old_endpoint_path_entry_is_normalised():
    """Runs stored before session 7 kept what a server was found to do as a dict under `description`."""
    detected = {"url": "http://gpu:8000/v1", "model": "llama", "capabilities": {"logprobs": True}}
    entry = path_entry({"name": "vllm-fp8", "canonical": "vllm-fp8", "description": detected})
    assert entry == {"name": "vllm-fp8", "canonical": "vllm-fp8", "kind": "endpoint", "endpoint": detected,
                     "description": "endpoint http://gpu:8000/v1 serving llama (KV cache as the server keeps it)"}
    assert path_entry({"name": "fp8", "description": "x"})["canonical"] == "fp8_e4m3:per_tensor:default:sat"


def relabel(run: Path, old: str, new: str) -> None:
    """The same run as if `--paths` had spelled the path `new`."""
    manifest = json.loads((run / "manifest.json").read_text())
    for path in manifest["paths"]:
        if path["name"] == old:
            path.update(name=new, canonical=parse_path(new).canonical)
    manifest.pop("verdicts", None)
    (run / "manifest.json").write_text(json.dumps(manifest))
    for table in run.glob("*.jsonl"):
        rows = [json.loads(line) for line in table.read_text().splitlines() if line.strip()]
        table.write_text("".join(json.dumps(r | ({"path": new} if r.get("path") == old else {})) + "\n" for r in rows))


def test_compare_pairs_paths_by_canonical_spec(baseline):
    """`fp8:` in B is A's `fp8_e4m3:`: the same path, paired record by record, not one removed and one new."""
    relabel(baseline, "fp8_e4m3:per_head:calibrated", "fp8:per_head:calibrated")
    same = compare_runs(RUNS / "baseline", RUNS / "baseline", n_boot=100)
    spelled = compare_runs(RUNS / "baseline", baseline, n_boot=100)
    assert spelled.missing_paths == [] and spelled.new_paths == [] and len(spelled.unpaired) == 0
    assert len(spelled.pairs) == len(same.pairs) and not spelled.regressed
    assert spelled.renamed == {"fp8:per_head:calibrated": "fp8_e4m3:per_head:calibrated"}
    assert "paired by canonical spec: B fp8:per_head:calibrated = A fp8_e4m3:per_head:calibrated" in spelled.summary_line


def test_compare_keeps_different_paths_apart(baseline):
    relabel(baseline, "fp8_e4m3", "fp8_e5m2")  # another format: another path
    result = compare_runs(RUNS / "baseline", baseline, n_boot=100)
    assert result.missing_paths == ["fp8_e4m3"] and result.new_paths == ["fp8_e5m2"] and result.regressed


def test_an_untimed_kernel_is_shown_unmeasured_not_zero(baseline):
    """A decode kernel replayed inside a CUDA graph is never timed alone; its writer stored 0.0 ms/step."""
    rows = [json.loads(line) for line in (baseline / "records.jsonl").read_text().splitlines()]
    key = {k: rows[0][k] for k in ("model", "scenario", "scenario_hash", "kind", "tags", "turn")}
    timed = [key | {"path": "fp8_e4m3", "metric": "kernel_ms_per_step", "value": 0.0},
             key | {"path": "fp8_e4m3:per_head:calibrated", "metric": "kernel_ms_per_step", "value": 0.21}]
    with (baseline / "records.jsonl").open("a") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in timed))
    column = summary_table(baseline)["kernel ms/step"]
    assert math.isnan(column[("canary-mla", "fp8_e4m3")])
    assert column[("canary-mla", "fp8_e4m3:per_head:calibrated")] == pytest.approx(0.21)
    numbers = format_summary(baseline).split("\n\n")[-1]  # after the verdict matrix
    cells = {line.split()[0]: line.split() for line in numbers.splitlines()[2:] if "fp8" in line}
    assert cells["fp8_e4m3"][-2] == "—" and cells["fp8_e4m3:per_head:calibrated"][-2] == "0.21"  # kernel ms/step
    assert "— = not measured" in numbers


def test_a_broken_night_is_named_on_the_trend_and_left_off(tmp_path):
    from harness.nightly import render_trend, trend_nights

    for night in ("20260101-000000", "20260102-000000"):
        shutil.copytree(RUNS / "baseline", tmp_path / "nights" / night)
    break_line(tmp_path / "nights" / "20260102-000000" / "records.jsonl", 2)
    table, unreadable = trend_nights(tmp_path)
    assert set(table["night"]) == {"20260101-000000"}
    broken = tmp_path / "nights" / "20260102-000000" / "records.jsonl"
    assert len(unreadable) == 1 and unreadable[0].startswith(f"20260102-000000: {broken}:2: not JSON")
    page = render_trend(tmp_path).read_text()
    assert "night not read" in page and "records.jsonl:2" in page


def test_a_broken_attention_table_leaves_the_run_and_names_the_line(baseline, capsys):
    from harness.attention_cli import show_attention

    (baseline / "attention.jsonl").write_text('{"model": "canary-mla"}\n{"layer": \n{"layer": 1}\n')
    show_attention(baseline)
    err = capsys.readouterr().err
    assert f"attention summary skipped: {baseline / 'attention.jsonl'}:2: not JSON" in err
    assert (baseline / "records.jsonl").exists()


def matplotlib_imports(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(root.parent)}:{node.lineno}" for n in names if n.split(".")[0] == "matplotlib"]
    return found


def test_all_plotting_lives_in_reports(tmp_path):
    assert matplotlib_imports(ROOT / "harness") == []
    assert matplotlib_imports(ROOT / "reports")  # the check sees an import where there is one
    planted = tmp_path / "harness" / "nightly.py"
    planted.parent.mkdir()
    planted.write_text("def f():\n    import matplotlib.pyplot as plt\n")
    assert matplotlib_imports(tmp_path / "harness") == ["harness/nightly.py:2"]


@pytest.mark.parametrize("manifest, named", [
    ({}, "not a stored run's manifest"),
    ({"run_id": "r", "status": "complete", "paths": "fp8"}, "field 'paths' is a str, not a list"),
    ({"run_id": "r", "status": 3}, "field 'status' is a int, not a str"),
])
@pytest.mark.parametrize("command", ["report", "compare"])
def test_a_manifest_of_the_wrong_shape_is_named_exit_2(tmp_path, capsys, manifest, named, command):
    """Issue 45: `manifest.json` holding `{}` made report and compare trace back (exit 1)."""
    import shutil

    from harness.cli import main

    run = tmp_path / "run"
    shutil.copytree(RUNS / "baseline", run)
    (run / "manifest.json").write_text(json.dumps(manifest))
    argv = ["report", str(run), "--out", str(tmp_path / "report")] if command == "report" else \
        ["compare", str(RUNS / "baseline"), str(run), "--out", str(tmp_path / "cmp")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{run / 'manifest.json'}" in err and named in err and "Traceback" not in err, err


def test_a_run_file_that_is_not_a_regular_file_is_named_not_waited_on(tmp_path):
    """Issue 45: every file reader refuses what is not a regular file: a FIFO as records.jsonl blocked the run
    reader for a writer that never came."""
    import os
    import shutil
    import subprocess
    import sys

    run = tmp_path / "run"
    shutil.copytree(RUNS / "baseline", run)
    (run / "records.jsonl").unlink()
    os.mkfifo(run / "records.jsonl")
    code = ("from harness.runs.read import read_run, RunReadError\n"
            f"try:\n    read_run({str(run)!r}).records\nexcept RunReadError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert f"{run / 'records.jsonl'}: not a regular file (a FIFO)" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("command", [["report", "{run}", "--out", "{out}"], ["compare", "{base}", "{run}", "--out", "{out}"],
                                     ["export", "{run}", "--format", "csv", "--out", "{out}"]])
def test_a_unit_that_errored_whole_has_a_verdict_row_every_reader_takes(baseline, tmp_path, capsys, command):
    """A unit that errored before any turn gets a warn row with turn null (`verdicts._error_rows`, as the run writes
    it); report, compare and export read it (the reader once refused its own writer's row: found on CUDA, session
    19, where an MLA format's units all errored and the run's report was not written)."""
    from harness.analysis.verdicts import _error_rows

    first = json.loads((baseline / "verdicts.jsonl").read_text().splitlines()[0])
    error = {"model": first["model"], "scenario": "never-ran", "path": first["path"], "turn": None, "error": "boom"}
    (row,) = _error_rows([error], set())
    assert row["turn"] is None
    with (baseline / "verdicts.jsonl").open("a") as handle:
        handle.write(json.dumps(row) + "\n")
    argv = [a.format(run=baseline, base=RUNS / "baseline", out=tmp_path / "out") for a in command]
    assert main(argv) in (0, 1)  # 1: compare reads the new warn as a change
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "error:" not in captured.err


def test_readers_share_a_table_by_its_content_each_with_rows_of_its_own(baseline):
    """Readers in one process share the parsed, checked rows of records and series (`harness run` reads its run back
    for its verdicts, its report and its summary): each reader gets rows of its own, and a table changed in place,
    to the same size within the file system's timestamp tick too, is read again."""
    from harness.runs.read import RunView

    first, second = RunView(baseline).table("records"), RunView(baseline).table("records")
    assert first == second and first is not second and first[0] is not second[0]
    first[0]["value"] = "changed by one reader"
    assert RunView(baseline).table("records")[0]["value"] == second[0]["value"] != "changed by one reader"
    records = baseline / "records.jsonl"
    text = records.read_text()
    row = json.loads(text.splitlines()[0])
    changed = json.dumps(row | {"turn": row["turn"] + 1 if row["turn"] < 9 else row["turn"] - 1})
    assert len(changed) == len(text.splitlines()[0])  # the same size: only the digest tells the files apart
    records.write_text(text.replace(text.splitlines()[0], changed, 1))
    assert RunView(baseline).table("records")[0]["turn"] == json.loads(changed)["turn"] != row["turn"]
    break_line(records, 2)
    with pytest.raises(RunReadError, match=r"records\.jsonl:2: not JSON"):
        RunView(baseline).table("records")
