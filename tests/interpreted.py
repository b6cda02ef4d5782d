"""One of the tests' scripts under Triton's CPU interpreter, in a subprocess: TRITON_INTERPRET must be set before
triton is imported (the interpreter is chosen when a kernel is defined), and the test process has imported it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def run_script(name: str) -> dict:
    """The JSON object the last line of tests/`name`'s output holds, run under the interpreter; skips where Triton is
    missing, or where Triton 3.6's interpreter (the GPU machines') cannot run a loop over a loaded bound: it holds a
    scalar as a 1-element array and takes int() of it in range(), which numpy 2.x refuses (session 30, H200). The
    compiled kernels' cases run in the GPU suite; Triton 3.9 (the CPU machines') runs these."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(HERE / name)], capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0 and "only 0-dimensional arrays can be converted to Python scalars" in done.stderr:
        import numpy
        import triton
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot loop over a loaded bound under numpy "
                    f"{numpy.__version__}: {done.stderr.strip().splitlines()[-1][:160]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
