"""Task files (harness/scenarios/tasks.py): a user's JSONL items become the scenarios the same YAML would give,
every bad item is named by file, line and field, and the CLI reads them (`run --tasks`, `scenarios from-jsonl`)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from harness.cli import main
from harness.scenarios.load import ScenarioError
from harness.scenarios.sources import load_scenarios
from harness.scenarios.tasks import ARITHMETIC_SYSTEM, final_answer, load_task_file, write_yaml

GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"},
    {"question": "What is 37 * 43?", "answer": "1,591", "id": "mult", "system": "Answer with the number only.",
     "max_new_tokens": 8, "tags": ["mine"]},
]
NEEDLE = {"needle": "The secret code is 4711.", "question": "What is the secret code?", "answer": 4711,
          "chars": 600, "depth": 0.25}


def write_jsonl(path: Path, items: list, extra_lines: tuple[str, ...] = ()) -> Path:
    path.write_text("\n".join([json.dumps(i) for i in items] + list(extra_lines)) + "\n")
    return path


@pytest.mark.parametrize("answer, expected", [
    ("step one\n#### 72", "72"), ("#### 1,591", "1591"), ("#### -4", "-4"), ("#### 18.00", "18"), (72, "72"),
    ("72", "72"), (" 1,000 ", "1000"), (5.0, "5"),
    ("#### 3.5", None), ("seventy-two", None), (True, None), (None, None), (2.5, None), ("12 apples", None),
])
def test_final_answer(answer, expected):
    assert final_answer(answer) == expected


def test_gsm8k_and_needle_items_compile_like_yaml(tmp_path):
    file = write_jsonl(tmp_path / "my tasks.jsonl", [*GSM8K, NEEDLE], ("", "// a comment line"))
    first, second, needle = load_task_file(file)
    assert (first.id, first.kind, first.system, first.max_new_tokens) == ("my_tasks-1", "arithmetic",
                                                                          ARITHMETIC_SYSTEM, 256)
    assert first.turns[0].user == GSM8K[0]["question"] and first.turns[0].expect == "72"
    assert first.tags == ("tasks", "my_tasks") and first.thresholds == {"answer_correct": 1}
    assert (second.id, second.turns[0].expect, second.max_new_tokens, second.tags) == ("mult", "1591", 8,
                                                                                       ("tasks", "my_tasks", "mine"))
    assert needle.kind == "long_context" and needle.turns[0].expect == "4711"
    assert "The secret code is 4711." in needle.turns[0].user and needle.turns[0].user.endswith(NEEDLE["question"])
    # the same scenario written in YAML has the same content hash (stored runs pair across the two forms)
    yaml_file = tmp_path / "same.yaml"
    yaml_file.write_text(textwrap.dedent(f"""\
        scenarios:
          - id: other-id
            kind: arithmetic
            system: "{ARITHMETIC_SYSTEM}"
            prompt: {json.dumps(GSM8K[0]["question"])}
            answer: 72
            generation: {{max_new_tokens: 256}}
            thresholds: {{answer_correct: 1}}
        """))
    assert load_scenarios([yaml_file])[0].content_hash == first.content_hash


def test_every_bad_item_named_by_file_line_and_field(tmp_path):
    file = write_jsonl(tmp_path / "bad.jsonl", [
        {"question": "What is 2 + 2?"},                                   # line 1: no answer
        {"question": "Why?", "answer": "because #### three"},             # line 2: no integer answer
        {"question": "What is 1 + 1?", "answer": 2, "difficulty": 3},     # line 3: unknown key
        {"question": "", "answer": 2},                                    # line 4: empty question (loader's check)
        {"needle": "The code is 12.", "question": "Code?", "answer": 13},  # line 5: answer not in the needle
        {"question": "What is 1 + 1?", "answer": 2, "max_new_tokens": 0},  # line 6: loader's generation check
    ], ("{not json", "[1, 2]"))                                          # lines 7, 8
    with pytest.raises(ScenarioError) as caught:
        load_task_file(file)
    problems = caught.value.problems
    expected = [f"{file}:1: field 'answer': missing required field", f"{file}:2: field 'answer': no integer answer",
                f"{file}:3: field 'difficulty': unknown key", f"{file}:4: scenario 'bad-4': field 'prompt'",
                f"{file}:5: scenario 'bad-5': field 'answer'", f"{file}:6: scenario 'bad-6': field 'generation",
                f"{file}:7: not JSON", f"{file}:8: expected a JSON object, got list"]
    assert len(problems) == len(expected), problems
    for prefix, problem in zip(expected, problems):
        assert problem.startswith(prefix), (prefix, problem)


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ScenarioError, match="no task items"):
        load_task_file(empty)
    with pytest.raises(ScenarioError, match="no such file"):
        load_scenarios([tmp_path / "missing.jsonl"])


def test_loader_reads_task_files_beside_yaml_and_refuses_duplicate_ids(tmp_path):
    file = write_jsonl(tmp_path / "t.jsonl", [GSM8K[1]])
    other = write_jsonl(tmp_path / "u.jsonl", [GSM8K[1]])
    assert [s.id for s in load_scenarios([file])] == ["mult"]
    with pytest.raises(ScenarioError, match="duplicate id 'mult'"):
        load_scenarios([file, other])


def test_from_jsonl_writes_a_scenario_file_that_loads_to_the_same_scenarios(tmp_path, capsys):
    file = write_jsonl(tmp_path / "tasks.jsonl", [*GSM8K, NEEDLE])
    assert main(["scenarios", "from-jsonl", str(file), "--out", str(tmp_path / "out")]) == 0
    assert "wrote 3 scenarios" in capsys.readouterr().out
    written = load_scenarios([tmp_path / "out" / "tasks.yaml"])
    direct = load_task_file(file)
    assert [(s.id, s.content_hash) for s in written] == [(s.id, s.content_hash) for s in direct]
    target, count = write_yaml(file, tmp_path / "again")
    assert count == 3 and target.read_text().startswith("# Generated from")


def test_from_jsonl_bad_file_exits_2_naming_the_line(tmp_path, capsys):
    file = write_jsonl(tmp_path / "tasks.jsonl", [{"question": "x"}])
    assert main(["scenarios", "from-jsonl", str(file), "--out", str(tmp_path / "out")]) == 2
    assert f"{file}:1: field 'answer'" in capsys.readouterr().err
    assert not (tmp_path / "out" / "tasks.yaml").exists()


def test_run_tasks_flag_refuses_a_file_that_is_not_jsonl_and_a_bad_item(tmp_path, capsys):
    not_jsonl = tmp_path / "tasks.json"
    not_jsonl.write_text("[]")
    assert main(["run", "--tasks", str(not_jsonl), "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    assert "--tasks" in capsys.readouterr().err
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "x", "answer": "y"}])
    assert main(["run", "--tasks", str(bad), "--out", str(tmp_path / "run2"), "--no-progress"]) == 2
    assert f"{bad}:1: field 'answer': no integer answer" in capsys.readouterr().err


def test_a_json_line_holding_u2028_is_one_item(tmp_path):
    """Issue 45: U+2028 / U+2029 / U+0085 are line breaks to str.splitlines, not to JSON Lines: the item holding
    one was split into three broken lines. Only \\n ends a line."""
    file = tmp_path / "seps.jsonl"
    file.write_text(json.dumps({"question": "What is 2\u2028+ 2?\u2029\x85", "answer": 4}, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    (scenario,) = load_task_file(file)
    assert scenario.turns[0].user == "What is 2\u2028+ 2?\u2029\x85"


def test_a_line_nested_200000_deep_is_a_named_problem(tmp_path):
    """Issue 45: before, json.loads raised RecursionError out of the loader."""
    file = tmp_path / "deep.jsonl"
    file.write_text('{"question": "q", "answer": 1, "tags": ' + "[" * 200_000 + "]" * 200_000 + "}\n")
    with pytest.raises(ScenarioError, match=r"deep\.jsonl:1: nested too deep"):
        load_task_file(file)


def test_from_jsonl_refuses_duplicate_ids(tmp_path, capsys):
    """Issue 45: from-jsonl wrote two scenarios with one id, which `--tasks` (and the YAML loader) refuse."""
    file = tmp_path / "dup.jsonl"
    file.write_text('{"id": "a", "question": "1+1?", "answer": 2}\n{"id": "a", "question": "2+2?", "answer": 4}\n')
    assert main(["scenarios", "from-jsonl", str(file), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "dup.jsonl:2: field 'id': 'a' is also the id of line 1" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_task_file_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    """Issue 45: from-jsonl on a FIFO waited forever for a writer. A reader refuses what is not a regular file."""
    import os
    import subprocess
    import sys

    file = tmp_path / "tasks.jsonl"
    os.mkfifo(file) if kind == "fifo" else file.mkdir()
    done = subprocess.run([sys.executable, "-m", "harness.cli", "scenarios", "from-jsonl", str(file), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"{file}: not a regular file" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
