"""The fused FP8 cache write over K and V in one launch, and into static storage's columns (`kernels.store_kv`), under
Triton's CPU interpreter: tests/store_kv_interpreted.py in a subprocess (the interpreter is chosen when a kernel is
defined). The GPU's rounding is checked against torch in tests/test_fused_write_gpu.py."""

from __future__ import annotations

import pytest

from interpreted import run_script
CASES = [f"chunk{chunk}-{launch}-{scale}" for chunk in (1, 3) for launch in ("pair", "single")
         for scale in ("per_tensor", "per_head")]


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_script("store_kv_interpreted.py")


@pytest.mark.parametrize("case", CASES)
def test_fused_write_puts_every_byte_and_value_where_it_belongs(interpreted, case):
    """Static storage gets the read-back at the pass's columns and nothing elsewhere; the paged caches get the codes
    at the step's slots (pads skipped) and nothing elsewhere; the statistics count both sides once. A launch over K
    and V must leave exactly what two launches leave (mutants that keep V's pointers on K's, or write every token at
    column 0, fail every pair case / every case)."""
    assert case in interpreted and interpreted[case] is None, interpreted.get(case, "missing")


def test_fused_write_counts_clipped_values_per_row(interpreted):
    """The statistics' clipped and nonfinite counts, summed in a program as one packed int32, land in their own
    columns of their own rows (pads not counted); a mutant that swaps the unpacking fails."""
    assert interpreted.get("clipped-counts", "missing") is None, interpreted.get("clipped-counts", "missing")


@pytest.mark.parametrize("scale", ["per_tensor", "per_head", "per_token"])
def test_write_check_sums_read_the_definitions_codes_back_as_torch_does(interpreted, scale):
    """The write check hands the fused sums the format definition's FP8 codes and scale rather than their widened
    read-back (no copy of it): the kernel's read-back must give the same sums, bit for bit (a mutant reading the
    scale at head 0 fails per_head and per_token; one reading the codes as values fails all three)."""
    case = f"sums-codes-{scale}"
    assert case in interpreted and interpreted[case] is None, interpreted.get(case, "missing")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("saturate", [True, False], ids=["saturate", "overflow"])
def test_the_write_checks_own_rounding_gives_torchs_values(interpreted, fmt, saturate):
    """`kernels.write_check.fp8_value`, the write check's rounding of x / scale (integer ops on the bits, not the fp8
    cast the cache write it judges uses): every code's value, its neighbours, every tie and the overflow rule's
    edges, as torch's cast gives them (a mutant rounding ties up, or dropping the subnormal path, fails)."""
    case = f"fp8-value-{fmt}-{saturate}"
    assert case in interpreted and interpreted[case] is None, interpreted.get(case, "missing")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("saturate", [True, False], ids=["saturate", "overflow"])
@pytest.mark.parametrize("scale", ["per_tensor", "per_head", "per_token"])
def test_write_check_sums_write_x_by_the_definition_as_torch_does(interpreted, fmt, saturate, scale):
    """The write check's sums computing the definition's read-back of x themselves must equal, bit for bit, the sums
    given torch's codes of x (values not exact in the format, some past its range; pads not counted)."""
    case = f"sums-encoding-{scale}-{fmt}-{saturate}"
    assert case in interpreted and interpreted[case] is None, interpreted.get(case, "missing")


def test_a_pair_that_cannot_share_a_launch_says_why():
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from kernels.store_kv import pair_refusal

    key = torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16)
    assert pair_refusal(key, key.clone(), torch.ones(()), torch.ones(())) is None
    assert "differ" in pair_refusal(key, torch.zeros(2, 4, 1, 16, dtype=torch.bfloat16), None, None)
    assert "scale" in pair_refusal(key, key, torch.ones(()), None)
    assert "scale" in pair_refusal(key, key, torch.ones(()), torch.ones(4))
    assert "layout" in pair_refusal(key, key, None, None, torch.zeros(2, 16, 4, 64, dtype=torch.uint8),
                                    torch.zeros(2, 16, 4, 32, dtype=torch.uint8))
