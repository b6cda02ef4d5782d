"""The write check's sums (`harness.kv_paths.cache.KVWriteStats.check_write`): per row of a cache write, the squared
error of two read-backs of the same values, in one pass over the three tensors. Torch's ops
(`reference.square_error_sums`, the CPU's) made ~20 passes over fp32 copies: at 8B shape, a 16 x 8k prefill, ~0.4 s of
FP8's prefill on an H200 (session 23).

The definition's read-back can also be computed here from x itself (`square_error_sums(x, a, None, valid, scale,
b_format=...)`): fp8(x / scale) as `reference.quantize` defines it (IEEE division, the clamp, round to nearest even),
its value found by integer rounding of the quotient's bits (`fp8_value`), never by an fp8 cast: the cache write it
judges casts with Triton's (`kernels/store_kv._fp8_codes`), so the two share no rounding code. That spares the check
torch's encode, three passes over fp32 copies of x: at a 16 x 8k prompt (8B-shaped, H200) its division, clamp and
cast took 45, 17 and 14 ms of the FP8 prefill's GPU time (BENCHMARKS.md, session 43)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.decode_attention import on_tensor_device
from kernels.reference import is_fp8
from kernels.store_kv import TOKENS_PER_PROGRAM, _check_cuda, _warps


@triton.jit
def fp8_value(y, IS_E4M3: tl.constexpr, SATURATE: tl.constexpr):
    """The value (fp32) of torch's cast of fp32 y to e4m3fn / e5m2 after `reference.quantize`'s overflow rule:
    saturating clamps to +-max (NaN stays NaN); without saturation e4m3 past 464 is NaN and e5m2 from 61440 on +-inf.
    Rounded to nearest even on the bits: a normal result keeps 3 (e4m3) or 2 (e5m2) mantissa bits of y's (the carry
    moves the exponent), a subnormal one is a multiple of 2^-9 (2^-16), found as (|y| + 2^14) - 2^14 ((|y| + 2^7) -
    2^7), whose sum rounds there."""
    if IS_E4M3:
        top: tl.constexpr = 448.0
        over: tl.constexpr = 464.0
        normal: tl.constexpr = 0.015625          # 2^-6
        magic: tl.constexpr = 16384.0            # 2^14: its fp32 ulp is 2^-9
        drop: tl.constexpr = 20                  # fp32 mantissa bits dropped
    else:
        top: tl.constexpr = 57344.0
        over: tl.constexpr = 61440.0
        normal: tl.constexpr = 0.00006103515625  # 2^-14
        magic: tl.constexpr = 128.0              # 2^7: its fp32 ulp is 2^-16
        drop: tl.constexpr = 21
    if SATURATE:
        y = tl.where(y > top, top, tl.where(y < -top, -top, y))   # NaN compares false: kept
    bits = y.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    half: tl.constexpr = (1 << (drop - 1)) - 1
    keep: tl.constexpr = 0xFFFFFFFF ^ ((1 << drop) - 1)
    rounded = ((mag + half + ((mag >> drop) & 1)) & keep).to(tl.float32, bitcast=True)
    size = tl.abs(y)
    value = tl.where(size < normal, (size + magic) - magic, rounded)
    value = (value.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    if not SATURATE:
        if IS_E4M3:
            value = tl.where(size > over, (sign | 0x7FC00000).to(tl.float32, bitcast=True), value)   # signed NaN
        else:
            value = tl.where(size >= over, tl.where(y < 0, float("-inf"), float("inf")), value)
    return tl.where(y != y, y, value)


@triton.jit
def _fp8_values_kernel(Y, OUT, n, IS_E4M3: tl.constexpr, SATURATE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(Y + offs, mask=offs < n, other=0.0)
    tl.store(OUT + offs, fp8_value(y, IS_E4M3, SATURATE), mask=offs < n)


@on_tensor_device
def fp8_values(y: torch.Tensor, fmt: str, saturate: bool = True) -> torch.Tensor:
    """`fp8_value` of each of y (fp32, contiguous), as a tensor: what its tests hold against torch's cast."""
    assert y.dtype == torch.float32 and y.is_contiguous() and fmt in ("e4m3", "e5m2"), (y.dtype, fmt)
    _check_cuda(y)
    out = torch.empty_like(y)
    if y.numel():
        _fp8_values_kernel[(triton.cdiv(y.numel(), 1024),)](y, out, y.numel(), IS_E4M3=fmt == "e4m3",
                                                             SATURATE=saturate, BLOCK=1024)
    return out


@triton.jit(do_not_specialize=["C", "stride_vr"])
def _square_error_sums_kernel(
    X, A, B, VALID, PARTS,       # [R, H, C, D] x and two read-backs (any strides); [R, C] int (0 = pad); fp64 out
    B_SCALE,                     # fp32 (B_CODES): B's scale, broadcast over [R, H, C] by its strides
    C, stride_vr,
    sx0, sx1, sx2, sx3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3, ss0, ss1, ss2,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, HAS_VALID: tl.constexpr,
    B_CODES: tl.constexpr,       # B holds FP8 codes: read back as (code x scale in fp32) cast once to X's dtype
    B_FORMAT: tl.constexpr = 0,  # 1 e4m3 / 2 e5m2: no B; it is fp8(x / scale) read back (the definition's), here
    B_SATURATE: tl.constexpr = True,
):
    tiles = tl.cdiv(C, BLOCK_T)
    pid = tl.program_id(0)
    r = (pid // tiles).to(tl.int64)
    tile = pid % tiles
    head = tl.program_id(1)
    offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_mask = offs_t < C
    if HAS_VALID:
        t_mask &= tl.load(VALID + r * stride_vr + offs_t, mask=t_mask, other=0) != 0
    m2 = t_mask[:, None] & (offs_d < D)[None, :]
    x = tl.load(X + r * sx0 + head * sx1 + offs_t[:, None] * sx2 + offs_d[None, :] * sx3, mask=m2, other=0.0)
    a = tl.load(A + r * sa0 + head * sa1 + offs_t[:, None] * sa2 + offs_d[None, :] * sa3, mask=m2, other=0.0)
    if B_FORMAT:  # reference.quantize's codes of x (x / scale in fp32, IEEE), read back as dequantize does
        scale = tl.load(B_SCALE + r * ss0 + head * ss1 + offs_t * ss2, mask=t_mask, other=1.0)
        quotient = tl.math.div_rn(x.to(tl.float32), scale[:, None])
        b = (fp8_value(quotient, B_FORMAT == 1, B_SATURATE) * scale[:, None]).to(X.dtype.element_ty)
    else:
        b = tl.load(B + r * sb0 + head * sb1 + offs_t[:, None] * sb2 + offs_d[None, :] * sb3, mask=m2, other=0.0)
    if B_CODES:   # kernels/reference.py's dequantize: fp8 -> fp32 is exact, one fp32 product, one rounding
        scale = tl.load(B_SCALE + r * ss0 + head * ss1 + offs_t * ss2, mask=t_mask, other=1.0)
        b = (b.to(tl.float32) * scale[:, None]).to(X.dtype.element_ty)
    x = x.to(tl.float32)
    out = PARTS + ((r * tl.num_programs(1) + head) * tiles + tile) * 2
    ea = a.to(tl.float32) - x
    ea = ea * ea
    ea = tl.where((ea == ea) & (ea != float("inf")), ea, 0.0)      # torch.nan_to_num(nan=0, posinf=0)
    eb = b.to(tl.float32) - x
    eb = eb * eb
    eb = tl.where((eb == eb) & (eb != float("inf")), eb, 0.0)
    tl.store(out, tl.sum(tl.sum(ea.to(tl.float64), axis=1), axis=0))
    tl.store(out + 1, tl.sum(tl.sum(eb.to(tl.float64), axis=1), axis=0))


@on_tensor_device
def square_error_sums(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, valid: torch.Tensor | None = None,
                      b_scale: torch.Tensor | None = None, b_format: str | None = None,
                      saturate: bool = True) -> torch.Tensor:
    """[R, 2] fp64: per row r, the sums over (H, C, D) of (a - x)^2 and of (b - x)^2, each difference and square in
    fp32 and summed in fp64 (torch's `(a.float() - x.float()).square_()` then `.sum(dtype=torch.float64)`), NaN and
    +inf squares counted 0 (`torch.nan_to_num(nan=0, posinf=0)`), tokens with valid[r, c] == 0 not counted.
    x, a: [R, H, C, D] bf16/fp16/fp32, any strides; valid: [R, C] (last dim contiguous) or None. b: values as a, or,
    with b_scale (fp32, broadcastable to [R, H, C, 1]), FP8 codes read back as `reference.dequantize(b, b_scale,
    x.dtype)` does, in the kernel (the write check's reference without its widened copy). b None and b_format
    ("e4m3" / "e5m2"): b is `reference.quantize(x, b_scale, b_format, saturate)` read back so, computed here
    (`fp8_value`). Deterministic: one fp64 partial a program, summed by torch in a fixed order."""
    encode = b is None
    assert encode == (b_format is not None), "b_format is for a b computed here (b None), and only then"
    assert not encode or (b_format in ("e4m3", "e5m2") and b_scale is not None), \
        f"the definition's b needs an FP8 format (e4m3 / e5m2) and its scale, got {b_format}, {b_scale is not None}"
    assert x.dim() == 4 and a.shape == x.shape and (encode or b.shape == x.shape), \
        f"x, a, b must be one [R, H, C, D] shape, got {list(x.shape)}, {list(a.shape)}, " \
        f"{None if encode else list(b.shape)}"
    rows, heads, chunk, dim = x.shape
    assert valid is None or (valid.shape == (rows, chunk) and valid.stride(1) == 1), \
        f"valid must be [{rows}, {chunk}] with a contiguous last dim, got {None if valid is None else list(valid.shape)}"
    assert encode or (b_scale is None) == (not is_fp8(b.dtype)), \
        f"b holds FP8 codes exactly when b_scale is given, got b {b.dtype} and b_scale {b_scale is not None}"
    if b_scale is not None:
        assert b_scale.dtype == torch.float32, f"b_scale must be fp32, got {b_scale.dtype}"
        b_scale = torch.broadcast_to(b_scale, (rows, heads, chunk, 1))   # strides 0 where broadcast
    _check_cuda(x, a, *([] if encode else [b]), *([valid] if valid is not None else []),
                *([b_scale] if b_scale is not None else []))
    block_t = min(TOKENS_PER_PROGRAM, triton.next_power_of_2(max(chunk, 2)))
    tiles = triton.cdiv(chunk, block_t)
    parts = torch.zeros(rows, heads * tiles, 2, dtype=torch.float64, device=x.device)
    if x.numel():
        block_d = triton.next_power_of_2(dim)
        _square_error_sums_kernel[(rows * tiles, heads)](
            x, a, x if encode else b, valid if valid is not None else parts, parts,
            b_scale if b_scale is not None else parts, chunk, valid.stride(0) if valid is not None else 0,
            *x.stride(), *a.stride(), *(x if encode else b).stride(),
            *(b_scale.stride()[:3] if b_scale is not None else (0, 0, 0)), D=dim, BLOCK_D=block_d, BLOCK_T=block_t,
            HAS_VALID=valid is not None, B_CODES=not encode and b_scale is not None,
            B_FORMAT=0 if not encode else 1 if b_format == "e4m3" else 2, B_SATURATE=saturate,
            num_warps=_warps(block_t * block_d))
    return parts.sum(1)
