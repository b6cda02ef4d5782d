"""The fused FP8 cache write's launch over K and V at once and its write into static storage's columns, under Triton's
CPU interpreter (TRITON_INTERPRET=1, set before triton is imported): run by tests/test_store_kv_pair.py in a
subprocess. The interpreter mis-rounds fp32 -> fp8 and truncates fp32 -> bf16, so the inputs are fp16 values that
x / scale holds exactly in e4m3 (no rounding to get wrong); this checks where every byte and value goes, not a GPU's
rounding (tests/test_fused_write_gpu.py does that). Prints one JSON object: {case: null (passed) or what failed}."""

from __future__ import annotations

import json
import os
import traceback

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from kernels import reference as ref  # noqa: E402
from kernels.store_kv import quantize_store, quantize_store_pair  # noqa: E402

ROWS, HEADS, DIM, PAGE, MAX_LEN = 3, 2, 32, 16, 12
POISON = -777.0


def exact_inputs(chunk: int, scale: float, seed: int) -> torch.Tensor:
    """[ROWS, HEADS, chunk, DIM] fp16, laid out as transformers hands K/V over (a transposed view), every value an
    e4m3 value times `scale` (a power of two), so the cast has nothing to round."""
    g = torch.Generator().manual_seed(seed)
    mantissa = torch.randint(8, 16, (ROWS, chunk, HEADS, DIM), generator=g).float()
    exponent = torch.randint(-5, 5, (ROWS, chunk, HEADS, DIM), generator=g).float()
    sign = torch.randint(0, 2, (ROWS, chunk, HEADS, DIM), generator=g).float() * 2 - 1
    return (sign * mantissa * 2 ** exponent / 8 * scale).half().transpose(1, 2)


def write(chunk: int, columns: list[int], paired: bool, per_head: bool) -> dict:
    """Everything one write leaves: static K/V buffers, paged K/V codes, statistics."""
    k_scale = torch.tensor([0.5, 0.25]) if per_head else torch.tensor(0.5)
    v_scale = torch.tensor([2.0, 0.125]) if per_head else torch.tensor(2.0)
    key, value = exact_inputs(chunk, 0.5, seed=chunk), exact_inputs(chunk, 2.0, seed=chunk + 1)
    if per_head:  # head 1 under its own scale
        key[:, 1] *= 0.5
        value[:, 1] /= 16
    out = {side: torch.full((ROWS, HEADS, MAX_LEN, DIM), POISON, dtype=torch.float16) for side in "kv"}
    pages_per_row = -(-MAX_LEN // PAGE)
    cache = {side: torch.full((ROWS * pages_per_row, PAGE, HEADS, DIM), 0xAB, dtype=torch.uint8) for side in "kv"}
    cols = torch.tensor(columns, dtype=torch.int64)
    valid = torch.ones(ROWS, chunk, dtype=torch.long)
    valid[1, 0] = 0  # a pad: not stored in the paged cache, not counted
    slots = torch.arange(ROWS)[:, None] * pages_per_row * PAGE + cols[None, :]
    slots = torch.where(valid.bool(), slots, -1).reshape(-1)
    counts, amax = torch.zeros(ROWS, 3, dtype=torch.int64), torch.zeros(ROWS)
    stats = dict(counts=counts, amax=amax, live=torch.arange(ROWS), valid=valid)
    strides = cache["k"].stride()[:3]
    if paired:
        quantize_store_pair(key, value, k_scale, v_scale, "e4m3", k_out=out["k"], v_out=out["v"], out_columns=cols,
                            k_cache=cache["k"], v_cache=cache["v"], slots=slots, cache_strides=strides, **stats)
    else:
        for side, x, scale in (("k", key, k_scale), ("v", value, v_scale)):
            quantize_store(x, scale, "e4m3", out=out[side], out_columns=cols, cache=cache[side], slots=slots,
                           cache_strides=strides, **stats)
    return dict(key=key, value=value, k_scale=k_scale, v_scale=v_scale, out=out, cache=cache, cols=cols,
                slots=slots, counts=counts, amax=amax, valid=valid)


def check(chunk: int, columns: list[int], paired: bool, per_head: bool) -> None:
    got = write(chunk, columns, paired, per_head)
    for side, x, scale in (("k", got["key"], got["k_scale"]), ("v", got["value"], got["v_scale"])):
        s = scale.view(-1, 1, 1) if scale.dim() else scale
        codes = ref.quantize(x, s, "e4m3")
        back = ref.dequantize(codes, s, out_dtype=x.dtype)
        assert torch.equal(back.float(), x.float()), "inputs not exact in e4m3"
        static = got["out"][side]
        assert torch.equal(static[:, :, got["cols"]], back), f"{side}: read-back at its columns"
        others = torch.ones(MAX_LEN, dtype=torch.bool)
        others[got["cols"]] = False
        assert bool((static[:, :, others] == POISON).all()), f"{side}: a column outside the pass was written"
        stored = got["cache"][side].view(-1, HEADS, DIM)
        want = codes.view(torch.uint8).transpose(1, 2).reshape(-1, HEADS, DIM)
        kept = got["slots"] >= 0
        assert torch.equal(stored[got["slots"][kept]], want[kept]), f"{side}: paged codes"
        untouched = torch.ones(stored.shape[0], dtype=torch.bool)
        untouched[got["slots"][kept]] = False
        assert bool((stored[untouched] == 0xAB).all()), f"{side}: a slot outside the pass was written"
    real = got["valid"].sum(1) * HEADS * DIM * 2  # both sides' values into one statistics row
    assert got["counts"][:, 0].tolist() == real.tolist(), f"counts {got['counts'].tolist()} != {real.tolist()}"
    assert got["counts"][:, 1:].abs().sum() == 0


def sums_from_codes(scale_kind: str) -> None:
    """The write check's sums given the definition's FP8 codes and scale (`square_error_sums(..., b_scale)`, the
    kernel reads them back) against the same sums given the codes read back by torch (`reference.dequantize`): the
    same terms in the same order, so the same bits. fp16 values exact in e4m3 under power-of-two scales keep the
    interpreter's roundings out; a scale that differs per head, per token or per row shows a scale read from the
    wrong place. x itself is not exact in e4m3 (the codes come from torch's cast on the CPU): the codes' error is
    what the sums count. The NaN code is the GPU test's (the interpreter widens e4m3's NaN to a number)."""
    from kernels.write_check import square_error_sums

    chunk = 5
    x = exact_inputs(chunk, 1.0, seed=11)
    scale = {"per_tensor": torch.tensor(0.5), "per_head": torch.tensor([0.5, 4.0]).view(-1, 1, 1),
             "per_token": 2.0 ** torch.randint(-3, 3, (ROWS, HEADS, chunk, 1)).float()}[scale_kind]
    x = (x.float() * scale * 1.1).half()
    codes = ref.quantize(x, scale, "e4m3")
    a = (x.float() * 1.25).half()
    valid = torch.ones(ROWS, chunk, dtype=torch.uint8)
    valid[2, :2] = 0
    want = square_error_sums(x, a, ref.dequantize(codes, scale, out_dtype=x.dtype), valid)
    got = square_error_sums(x, a, codes, valid, scale)
    assert torch.equal(got, want), f"{got.tolist()} != {want.tolist()}"
    assert bool((want[:, 1] > 0).all()), "the codes' error must count"


def boundary_values(fmt: str) -> torch.Tensor:
    """fp32 values where a cast to `fmt` decides: every finite code's value and its neighbours one fp32 ulp away, the
    midpoints between codes (ties) and theirs, the overflow rule's edges, NaN, +-inf, fp32 subnormals and +-0, and
    random values over 14 decades."""
    codes = torch.arange(256, dtype=torch.uint8).view(ref.fp8_dtype(fmt)).float()
    codes = torch.unique(codes[codes.isfinite()])
    mids = (codes[1:] + codes[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    edges = torch.tensor([448.0, 460.0, 464.0, 465.0, 479.0, 480.0, 481.0, 57344.0, 61439.0, 61440.0, 61441.0, 1e6,
                          float("nan"), float("inf"), float("-inf"), 1e-40, -1e-40, 0.0, -0.0])
    g = torch.Generator().manual_seed(3)
    spread = torch.randn(4000, generator=g) * 10.0 ** torch.randint(-9, 5, (4000,), generator=g).float()
    return torch.cat([codes, codes.nextafter(up), codes.nextafter(down), mids, mids.nextafter(up),
                      mids.nextafter(down), edges, -edges, spread])


def fp8_values(fmt: str, saturate: bool) -> None:
    """`kernels.write_check.fp8_value` (the write check's own rounding, integer ops on the bits) against torch's cast
    as `reference.quantize` makes it, value for value, NaN where torch's is NaN. Integer ops and fp32 sums run in the
    interpreter as on a GPU (numpy), unlike its fp8 cast, so this judges the rounding itself."""
    from kernels.write_check import fp8_values as values

    y = boundary_values(fmt)
    got = values(y, fmt, saturate)
    want = ref.quantize(y, torch.tensor(1.0), fmt, saturate=saturate).float()
    wrong = ~((got == want) | (got.isnan() & want.isnan())) | (got.signbit() != want.signbit())
    assert not bool(wrong.any()), [(y[i].item(), got[i].item(), want[i].item()) for i in wrong.nonzero()[:5, 0]]


def sums_encoding(scale_kind: str, fmt: str, saturate: bool) -> None:
    """The write check's sums writing x by the definition themselves (`square_error_sums(x, a, None, ..., b_format)`)
    against the same sums given torch's codes of x read back (`reference.quantize`, then `reference.dequantize`):
    the same terms in the same order, so the same bits. x in fp16 (the interpreter truncates fp32 -> bf16) and not
    exact in the format, with values past its range (clipped, or NaN / inf without saturation), so the rounding,
    the clamp and the overflow rule all count; a scale that differs per head, per token or per row shows one read
    from the wrong place."""
    from kernels.write_check import square_error_sums

    chunk = 7
    g = torch.Generator().manual_seed(17)
    x = torch.randn(ROWS, HEADS, chunk, DIM, generator=g) * 10.0 ** torch.randint(-4, 3, (ROWS, HEADS, chunk, 1),
                                                                                   generator=g).float()
    scale = {"per_tensor": torch.tensor(0.37), "per_head": torch.tensor([0.5, 3.1]).view(-1, 1, 1),
             "per_token": torch.rand(ROWS, HEADS, chunk, 1, generator=g) + 0.01}[scale_kind]
    top = ref.FP8_MAX[fmt]
    x[0, 1, 2, :4] = torch.tensor([1.2, -3.0, 0.98, 5.0]) * top * scale.reshape(-1)[0]   # past the range
    x = x.half()
    a = (x.float() * 1.25).half()
    valid = torch.ones(ROWS, chunk, dtype=torch.uint8)
    valid[2, :2] = 0
    want = square_error_sums(x, a, ref.dequantize(ref.quantize(x, scale, fmt, saturate), scale, out_dtype=x.dtype),
                             valid)
    got = square_error_sums(x, a, None, valid, scale.float(), b_format=fmt, saturate=saturate)
    assert torch.equal(got, want), f"{got.tolist()} != {want.tolist()}"
    assert bool((want[:, 1] > 0).all()), "the definition's error must count"


def clipped_counts() -> None:
    """The write's clipped count per statistics row, K and V in one launch: values past the e4m3 max (x / s > 448)
    on real tokens count, on a pad they do not; the flags' packed sum (clipped + 2^16 x nonfinite) must unpack to
    them, and nonfinite stays 0 (no NaN or inf here: the interpreter widens e4m3's NaN to a number)."""
    chunk = 3
    key, value = exact_inputs(chunk, 0.5, seed=5), exact_inputs(chunk, 2.0, seed=6)
    key[0, 0, 1, :5] = 1000.0                    # row 0: 5 values over 448 x 0.5
    value[2, 1, 2, :7] = -5000.0                 # row 2: 7 over 448 x 2
    value[1, 0, 0, :3] = 5000.0                  # row 1's token 0 is a pad: not counted
    valid = torch.ones(ROWS, chunk, dtype=torch.long)
    valid[1, 0] = 0
    counts, amax = torch.zeros(ROWS, 3, dtype=torch.int64), torch.zeros(ROWS)
    quantize_store_pair(key, value, torch.tensor(0.5), torch.tensor(2.0), "e4m3", counts=counts, amax=amax,
                        live=torch.arange(ROWS), valid=valid)
    assert counts[:, 1].tolist() == [5, 0, 7], f"clipped {counts[:, 1].tolist()}"
    assert counts[:, 2].tolist() == [0, 0, 0], f"nonfinite {counts[:, 2].tolist()}"
    assert counts[:, 0].tolist() == (valid.sum(1) * HEADS * DIM * 2).tolist(), f"values {counts[:, 0].tolist()}"


def main() -> None:
    found = {}
    try:
        clipped_counts()
        found["clipped-counts"] = None
    except Exception:  # noqa: BLE001 - reported per case
        found["clipped-counts"] = traceback.format_exc()[-1500:]
    for scale_kind in ("per_tensor", "per_head", "per_token"):
        try:
            sums_from_codes(scale_kind)
            found[f"sums-codes-{scale_kind}"] = None
        except Exception:  # noqa: BLE001 - reported per case
            found[f"sums-codes-{scale_kind}"] = traceback.format_exc()[-1500:]
    for fmt in ("e4m3", "e5m2"):
        for saturate in (True, False):
            cases = [(f"fp8-value-{fmt}-{saturate}", fp8_values, (fmt, saturate))]
            cases += [(f"sums-encoding-{kind}-{fmt}-{saturate}", sums_encoding, (kind, fmt, saturate))
                      for kind in ("per_tensor", "per_head", "per_token")]
            for name, case, args in cases:
                try:
                    case(*args)
                    found[name] = None
                except Exception:  # noqa: BLE001 - reported per case
                    found[name] = traceback.format_exc()[-1500:]
    for chunk, columns in ((1, [7]), (3, [4, 5, 6])):
        for paired in (True, False):
            for per_head in (False, True):
                name = f"chunk{chunk}-{'pair' if paired else 'single'}-{'per_head' if per_head else 'per_tensor'}"
                try:
                    check(chunk, columns, paired, per_head)
                    found[name] = None
                except Exception:  # noqa: BLE001 - reported per case
                    found[name] = traceback.format_exc()[-1500:]
    print(json.dumps(found))


if __name__ == "__main__":
    main()
