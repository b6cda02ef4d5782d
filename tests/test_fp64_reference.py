"""kernels/fp64_reference.py: the kernel check's fp64 truth read from FP8 codes (no fp64 copy of the cache) against
torch's fp64 GEMMs over `codes.double()`, under Triton's CPU interpreter and compiled on a GPU
(tests/fp64_reference_cases.py has the cases and the bound: both sides fp64, so the difference is the order of the
sums, at most ~n u sum|terms|; measured 0.004-0.06 of 2 n u sum|terms| under the interpreter)."""

from __future__ import annotations

import pytest

from fp64_reference_cases import CASES, GPU_CASES, measure
from interpreted import run_script


def _judge(found: dict) -> None:
    assert found["scores_over_bound"] <= 1.0 and found["out_over_bound"] <= 1.0, found
    # a stale NaN code reaches what a GEMM's would
    assert found["nan_where_torch_nan"] and found["nan_scores"] > 0, found


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_script("fp64_reference_interpreted.py")


@pytest.mark.parametrize("case", list(CASES))
def test_fp64_reference_under_the_interpreter(interpreted, case):
    _judge(interpreted[case])


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_fp64_reference_on_cuda(case):
    _judge(measure(device="cuda", **GPU_CASES[case]))
