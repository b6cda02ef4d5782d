"""benchmarks/py_spy_table.py: a py-spy raw profile read into seconds per thread and per stage, each sample given to
the innermost stage on its stack; a file that is not py-spy's raw format is refused by line."""

from __future__ import annotations

import pytest

from benchmarks import py_spy_table

RAW = "\n".join([
    # --threads: the model thread, renamed by its pool once; its modelling file names the family
    "thread (11): model-replay-0;worker (local.py:1);BatchedEngine._prefill_static (batched.py:2);"
    "Qwen3NextModel.forward (transformers/models/qwen3_next/modeling_qwen3_next.py:3) 500",
    "thread (11): ThreadPoolExecutor-1_0;worker (local.py:1);_score_rows (batched.py:4);"
    "_prefill_static (batched.py:2) 250",  # innermost stage wins: _prefill_static, not _score_rows
    "thread (12): MainThread;main (cli.py:1);_find_and_load (<frozen importlib._bootstrap>:1) 1000",
    "thread (12): MainThread;main (cli.py:1);something_else (x.py:9) 250",
    " 25",  # a sample in native code alone: no Python frame
    "",
])


def test_threads_and_stages_in_seconds(tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text(RAW)
    table = py_spy_table.tables(py_spy_table.read_raw(raw), rate=250)
    lines = table.splitlines()
    assert lines[0] == "# 8.10 s of samples at 250 Hz"
    assert "| 12 | MainThread | 5.00 | - |" in lines
    assert "| 11 | model-replay-0 | 3.00 | qwen3_next 2.00 |" in lines  # the name sampled most
    stages = lines[lines.index("| stage (innermost) | s |") + 2:]
    assert stages == ["| _find_and_load | 4.00 |", "| _prefill_static | 3.00 |", "| (other) | 1.10 |"]
    one = py_spy_table.tables(py_spy_table.read_raw(raw), rate=250, thread="11").splitlines()
    assert one[0] == "# 3.00 s of samples at 250 Hz" and "| 12 | MainThread | 5.00 | - |" not in one


def test_a_file_of_another_format_is_refused_by_line(tmp_path):
    raw = tmp_path / "flame.svg"
    raw.write_text("main (cli.py:1) 10\n<svg xmlns='http://www.w3.org/2000/svg'>\n")
    with pytest.raises(ValueError, match=r"flame.svg:2: not py-spy's raw format"):
        py_spy_table.read_raw(raw)
