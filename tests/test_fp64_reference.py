"""kernels/fp64_reference.py: the kernel check's fp64 truth read from FP8 codes (no fp64 copy of the cache) against
torch's fp64 GEMMs over `codes.double()`, under Triton's CPU interpreter and compiled on a GPU
(tests/fp64_reference_cases.py has the cases and the bound: both sides fp64, so the difference is the order of the
sums, at most ~n u sum|terms|; measured 0.004-0.06 of 2 n u sum|terms| under the interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp64_reference_cases import CASES, GPU_CASES, measure

HERE = Path(__file__).parent


def _judge(found: dict) -> None:
    assert found["scores_over_bound"] <= 1.0 and found["out_over_bound"] <= 1.0, found
    # a stale NaN code reaches what a GEMM's would
    assert found["nan_where_torch_nan"] and found["nan_scores"] > 0, found


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(HERE / "fp64_reference_interpreted.py")], capture_output=True,
                          text=True, env=env, timeout=600)
    if done.returncode != 0 and "only 0-dimensional arrays can be converted to Python scalars" in done.stderr:
        import numpy
        import triton
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot loop over a loaded bound under numpy "
                    f"{numpy.__version__} (tests/test_kernels_reference.py: the GPU machines' Triton 3.6)")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_fp64_reference_under_the_interpreter(interpreted, case):
    _judge(interpreted[case])


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_fp64_reference_on_cuda(case):
    _judge(measure(device="cuda", **GPU_CASES[case]))
