"""Paged KV-cache store: quantise new K/V (or an MLA latent row) into an FP8 cache, or copy into a BF16 one;
`quantize_store` fuses the harness cache layer's FP8 round trip, the paged store and the cast statistics.

codes = fp8(x / scale), round to nearest even, the same bytes as torch's cast (`reference.quantize`):
saturating clamps |x / scale| to the format's max first; without saturation e4m3 overflow becomes NaN and
e5m2 overflow inf, as torch's cast does. NaN is written as 0x7F | sign in both formats.
The torch mirror of `store_kv` / `store_latent` is in `kernels/reference.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.decode_attention import on_tensor_device
from kernels.reference import FP8_MAX, MIN_SCALE, fp8_format, is_fp8
from kernels.splits import interpreting

_TL_FP8 = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}


@triton.jit
def _store_kv_codes(x, scale, FP8_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr,
                    SATURATE: tl.constexpr):
    """fp8(x / scale) as raw bytes (uint8), bit-identical to torch's x.float() / scale -> fp8 cast."""
    y = tl.math.div_rn(x, scale)                      # IEEE division, as torch's
    return _fp8_codes(y, FP8_DTYPE, FP8_MAX, IS_E4M3, SATURATE)


@triton.jit
def _fp8_codes(y, FP8_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr, SATURATE: tl.constexpr):
    """fp8(y) as raw bytes (uint8), y = x / scale already divided: torch's fp8 cast of y (`_store_kv_codes`)."""
    sign = ((y.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    clamped = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    # sm_89+ cvt is .satfinite: finite overflow would clamp anyway; the explicit clamp covers +-inf
    codes = clamped.to(FP8_DTYPE, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    if not SATURATE:
        if IS_E4M3:
            # torch: |y| > 464 (448 + half an ulp; 464 itself ties to even, 448) -> NaN, inf included
            codes = tl.where(tl.abs(y) > 464.0, (sign | 0x7F).to(tl.uint8), codes)
        else:
            # torch: |y| >= 61440 (57344 + half an ulp, which ties to even: up) -> inf (0x7C)
            codes = tl.where(tl.abs(y) >= 61440.0, (sign | 0x7C).to(tl.uint8), codes)
    return tl.where(y != y, (sign | 0x7F).to(tl.uint8), codes)


@triton.jit
def _store_kv_row(SRC, DST, offs, mask, scale, CACHE_IS_FP8: tl.constexpr, FP8_DTYPE: tl.constexpr,
                  FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr, SATURATE: tl.constexpr):
    x = tl.load(SRC + offs, mask=mask, other=0.0).to(tl.float32)
    if CACHE_IS_FP8:
        tl.store(DST + offs, _store_kv_codes(x, scale, FP8_DTYPE, FP8_MAX, IS_E4M3, SATURATE), mask=mask)
    else:
        tl.store(DST + offs, x.to(DST.dtype.element_ty), mask=mask)   # bf16/fp16 cache: plain copy


@triton.jit
def _store_kv_kernel(
    KEY, VALUE,              # [N, kv_heads, head_dim] bf16/fp16
    K_CACHE, V_CACHE,        # [num_blocks, block_size, kv_heads, head_dim]; fp8 caches seen as uint8
    SLOT_MAPPING,            # [N] int64, -1 = skip
    K_SCALE, V_SCALE,        # fp32, [] or [kv_heads]
    block_size, k_scale_stride, v_scale_stride,   # 0 per tensor, 1 per KV head
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cb, stride_cs, stride_ch,              # shared by both caches (asserted)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CACHE_IS_FP8: tl.constexpr, FP8_DTYPE: tl.constexpr,
    FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr, SATURATE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(SLOT_MAPPING + token)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_d < HEAD_DIM) & (slot >= 0)
    row = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + head * stride_ch
    k_scale = 1.0
    v_scale = 1.0
    if CACHE_IS_FP8:
        k_scale = tl.load(K_SCALE + head * k_scale_stride)
        v_scale = tl.load(V_SCALE + head * v_scale_stride)
    _store_kv_row(KEY + token * stride_kn + head * stride_kh, K_CACHE + row, offs_d, mask, k_scale,
                  CACHE_IS_FP8, FP8_DTYPE, FP8_MAX, IS_E4M3, SATURATE)
    _store_kv_row(VALUE + token * stride_vn + head * stride_vh, V_CACHE + row, offs_d, mask, v_scale,
                  CACHE_IS_FP8, FP8_DTYPE, FP8_MAX, IS_E4M3, SATURATE)


@triton.jit
def _store_latent_kernel(
    LATENT, K_PE,            # [N, latent_dim], [N, rope_dim] bf16/fp16
    CACHE,                   # [num_blocks, block_size, latent_dim + rope_dim]; fp8 seen as uint8
    SLOT_MAPPING, SCALE,     # [N] int64 (-1 = skip); fp32 []
    block_size, stride_ln, stride_pn, stride_cb, stride_cs,
    LATENT_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr,
    CACHE_IS_FP8: tl.constexpr, FP8_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr,
    SATURATE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOT_MAPPING + token)
    row = CACHE + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    scale = 1.0
    if CACHE_IS_FP8:
        scale = tl.load(SCALE)
    offs_c = tl.arange(0, BLOCK_DC)
    _store_kv_row(LATENT + token * stride_ln, row, offs_c, (offs_c < LATENT_DIM) & (slot >= 0), scale,
                  CACHE_IS_FP8, FP8_DTYPE, FP8_MAX, IS_E4M3, SATURATE)
    offs_r = tl.arange(0, BLOCK_DR)
    _store_kv_row(K_PE + token * stride_pn, row + LATENT_DIM, offs_r, (offs_r < ROPE_DIM) & (slot >= 0), scale,
                  CACHE_IS_FP8, FP8_DTYPE, FP8_MAX, IS_E4M3, SATURATE)


def _format_constexprs(cache_dtype: torch.dtype, saturate: bool) -> dict:
    fmt = fp8_format(cache_dtype) if is_fp8(cache_dtype) else "e4m3"   # unused for a bf16/fp16 cache
    return dict(CACHE_IS_FP8=is_fp8(cache_dtype), FP8_DTYPE=_TL_FP8[fmt], FP8_MAX=FP8_MAX[fmt],
                IS_E4M3=fmt == "e4m3", SATURATE=bool(saturate))


def _check_scale(scale, name: str, heads_allowed: tuple[int, ...]) -> None:
    assert isinstance(scale, torch.Tensor), f"{name} must be an fp32 tensor, got {type(scale).__name__}"
    assert scale.dtype == torch.float32, f"{name} must be fp32, got {scale.dtype}"
    assert scale.shape in [torch.Size([])] + [torch.Size([h]) for h in heads_allowed], \
        f"{name} must have shape [] or {list(heads_allowed)}, got {list(scale.shape)}"
    assert scale.is_contiguous(), f"{name} must be contiguous"


def _check_slots(slot_mapping: torch.Tensor, tokens: int) -> None:
    assert slot_mapping.dtype == torch.int64, f"slot_mapping must be int64, got {slot_mapping.dtype}"
    assert slot_mapping.shape == (tokens,), f"slot_mapping must be [{tokens}], got {list(slot_mapping.shape)}"
    assert slot_mapping.is_contiguous(), "slot_mapping must be contiguous"


def _check_cuda(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    assert device.type == "cuda" or interpreting(), f"Triton kernels need CUDA tensors, got {device}"
    assert all(t.device == device for t in tensors), "all tensors must be on one device"


@on_tensor_device
def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
             saturate: bool = True) -> None:
    """In place: k_cache.flatten(0, 1)[slot_mapping[n]] = fp8(key[n] / k_scale) (and v), slot -1 skipped.
    key/value: [N, kv_heads, head_dim] bf16/fp16; caches: [num_blocks, block_size, kv_heads, head_dim] fp8
    (e4m3/e5m2) or bf16/fp16 (plain copy, scales ignored); scales: fp32 [] or [kv_heads]."""
    assert key.dim() == 3 and value.shape == key.shape, \
        f"key/value must be [N, kv_heads, head_dim] of one shape, got {list(key.shape)}, {list(value.shape)}"
    assert key.dtype in (torch.bfloat16, torch.float16) and value.dtype == key.dtype, \
        f"key/value must be bf16 or fp16, got {key.dtype}, {value.dtype}"
    tokens, kv_heads, head_dim = key.shape
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.shape[2:] == key.shape[1:], \
        f"caches must be [num_blocks, block_size, {kv_heads}, {head_dim}], got {list(k_cache.shape)}, {list(v_cache.shape)}"
    assert v_cache.dtype == k_cache.dtype, f"k/v caches differ in dtype: {k_cache.dtype}, {v_cache.dtype}"
    assert is_fp8(k_cache.dtype) or k_cache.dtype in (torch.bfloat16, torch.float16), \
        f"cache dtype must be float8_e4m3fn, float8_e5m2, bf16 or fp16, got {k_cache.dtype}"
    assert k_cache.stride() == v_cache.stride(), "k/v caches must share strides"
    assert k_cache.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1, "head_dim must be contiguous"
    _check_slots(slot_mapping, tokens)
    if is_fp8(k_cache.dtype):
        _check_scale(k_scale, "k_scale", (kv_heads,))
        _check_scale(v_scale, "v_scale", (kv_heads,))
    _check_cuda(key, value, k_cache, v_cache, slot_mapping, *[s for s in (k_scale, v_scale) if s is not None])
    if tokens == 0:
        return
    as_bytes = (lambda c: c.view(torch.uint8)) if is_fp8(k_cache.dtype) else (lambda c: c)
    k_scale = k_scale if k_scale is not None else slot_mapping   # unread by a bf16/fp16 cache
    v_scale = v_scale if v_scale is not None else slot_mapping
    _store_kv_kernel[(tokens, kv_heads)](
        key, value, as_bytes(k_cache), as_bytes(v_cache), slot_mapping, k_scale, v_scale,
        k_cache.shape[1], int(k_scale.dim() == 1), int(v_scale.dim() == 1),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        **_format_constexprs(k_cache.dtype, saturate), num_warps=1,
    )


@on_tensor_device
def store_latent(latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                 scale: torch.Tensor | None, saturate: bool = True) -> None:
    """MLA variant, in place: cache.flatten(0, 1)[slot] = fp8([latent[n] | k_pe[n]] / scale), slot -1 skipped.
    latent: [N, Dc], k_pe: [N, Dr] bf16/fp16; cache: [num_blocks, block_size, Dc + Dr]; scale: fp32 []."""
    assert latent.dim() == 2 and k_pe.dim() == 2 and k_pe.shape[0] == latent.shape[0], \
        f"latent/k_pe must be [N, Dc] and [N, Dr], got {list(latent.shape)}, {list(k_pe.shape)}"
    assert latent.dtype in (torch.bfloat16, torch.float16) and k_pe.dtype == latent.dtype, \
        f"latent/k_pe must be bf16 or fp16, got {latent.dtype}, {k_pe.dtype}"
    tokens, latent_dim = latent.shape
    rope_dim = k_pe.shape[1]
    assert cache.dim() == 3 and cache.shape[2] == latent_dim + rope_dim, \
        f"cache must be [num_blocks, block_size, {latent_dim + rope_dim}], got {list(cache.shape)}"
    assert is_fp8(cache.dtype) or cache.dtype in (torch.bfloat16, torch.float16), \
        f"cache dtype must be float8_e4m3fn, float8_e5m2, bf16 or fp16, got {cache.dtype}"
    assert cache.stride(-1) == 1 and latent.stride(-1) == 1 and k_pe.stride(-1) == 1, "last dims must be contiguous"
    _check_slots(slot_mapping, tokens)
    if is_fp8(cache.dtype):
        _check_scale(scale, "scale", ())
    _check_cuda(latent, k_pe, cache, slot_mapping, *[s for s in (scale,) if s is not None])
    if tokens == 0:
        return
    _store_latent_kernel[(tokens,)](
        latent, k_pe, cache.view(torch.uint8) if is_fp8(cache.dtype) else cache, slot_mapping,
        scale if scale is not None else slot_mapping,
        cache.shape[1], latent.stride(0), k_pe.stride(0), cache.stride(0), cache.stride(1),
        LATENT_DIM=latent_dim, ROPE_DIM=rope_dim, BLOCK_DC=triton.next_power_of_2(latent_dim),
        BLOCK_DR=triton.next_power_of_2(rope_dim), **_format_constexprs(cache.dtype, saturate), num_warps=4,
    )


# ---------------------------------------------------------------------------------------------------
# Fused cache write: the FP8 round trip a harness cache layer emulates (codes = fp8(x / s), read back
# codes * s in x's dtype), the paged store of the same codes, and the cast statistics, in one launch.
# ---------------------------------------------------------------------------------------------------
# Arguments that change from step to step (the step's pad mask is a column slice of a growing mask: its offset and
# row stride move every decode step) or from call to call are not specialised on: otherwise Triton compiles a new
# variant whenever one of them changes divisibility by 16 or pointer alignment, inside a timed decode loop.
# A launch writes one tensor, or K and V at once (grid axis 2 = the side; `quantize_store_pair`): a decode step's
# two writes a layer were two launches of ~5 us each for a few kB (8B-shaped b32 1k, H200: 64 launches, 0.35 ms).
@triton.jit(do_not_specialize=["C", "stride_xr", "stride_xh", "stride_xc", "stride_vr", "stride_cb", "stride_cs",
                               "stride_ch", "col_offset", "stride_or", "stride_oh", "stride_oc",
                               "v_stride_xr", "v_stride_xh", "v_stride_xc", "v_col_offset"],
            do_not_specialize_on_alignment=["VALID", "OUT_COLS"])
def _quantize_store_kernel(
    X, OUT,                  # [R, H, C, D] x (any strides), OUT [R, H, C or columns, D] in x's dtype (D contiguous)
    SCALE,                   # fp32 [] or [H] (static scales; unread per token)
    CACHE, SLOTS,            # paged cache seen as uint8, [R * C] int64 slots (-1 skip); unread unless STORE
    VALID, LIVE, COUNTS, AMAX,   # [R, C] int (0 = pad), [R] int64 stats row, [rows, 3] int64, [rows] fp32
    OUT_COLS,                # [C] int64: OUT's column of chunk token t (static storage); unread unless HAS_COLS
    V_X, V_OUT, V_SCALE, V_CACHE,   # V's tensors when SIDES == 2 (grid axis 2: 0 writes K, 1 writes V)
    C, scale_stride,
    stride_xr, stride_xh, stride_xc, stride_xd, stride_vr,
    block_size, stride_cb, stride_cs, stride_ch, col_offset,
    stride_or, stride_oh, stride_oc,
    v_stride_xr, v_stride_xh, v_stride_xc, v_col_offset,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, FP8_DTYPE: tl.constexpr,
    FP8_MAX: tl.constexpr, INV_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, IS_E4M3: tl.constexpr,
    SATURATE: tl.constexpr, PER_TOKEN: tl.constexpr, STORE: tl.constexpr, STATS: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_COLS: tl.constexpr, SIDES: tl.constexpr, X_ALIGN: tl.constexpr,
    ROW_ALIGN: tl.constexpr, OUT_ALIGN: tl.constexpr,
):
    tiles = tl.cdiv(C, BLOCK_T)
    pid = tl.program_id(0)
    r = pid // tiles
    head = tl.program_id(1)
    # int64 on both sides (an unspecialised int argument is i32 or i64 by its value, and both branches must agree)
    sxr, sxh, sxc, offset = (stride_xr.to(tl.int64), stride_xh.to(tl.int64), stride_xc.to(tl.int64),
                             col_offset.to(tl.int64))
    if SIDES == 2:
        if tl.program_id(2) == 1:  # V: its own tensors, strides and row offset; the rest is shared (pair_refusal)
            X, OUT, SCALE, CACHE = V_X, V_OUT, V_SCALE, V_CACHE
            sxr, sxh, sxc, offset = (v_stride_xr.to(tl.int64), v_stride_xh.to(tl.int64), v_stride_xc.to(tl.int64),
                                     v_col_offset.to(tl.int64))
    offs_t = (pid % tiles) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_mask = offs_t < C
    m2 = t_mask[:, None] & (offs_d < D)[None, :]
    token = r.to(tl.int64) * sxr + head * sxh + offs_t * sxc           # [BLOCK_T] first element
    if X_ALIGN > 1:  # the strides are not specialised on: say what the launcher checked (vector loads)
        token = tl.multiple_of(token, X_ALIGN)
    src = X + token[:, None] + offs_d[None, :] * stride_xd
    x = tl.load(src, mask=m2, other=0.0).to(tl.float32)
    # the small loads before any store: the compiler does not move a load above a store it may alias, and a decode
    # step's write (one token a program) is mostly these latencies
    if HAS_COLS:  # straight into static storage: token t at column OUT_COLS[t]
        out_cols = tl.load(OUT_COLS + offs_t, mask=t_mask, other=0)
    else:
        out_cols = offs_t
    if STORE:
        slot = tl.load(SLOTS + r.to(tl.int64) * C + offs_t, mask=t_mask, other=-1)
    if STATS:
        if HAS_VALID:
            real = (tl.load(VALID + r.to(tl.int64) * stride_vr + offs_t, mask=t_mask, other=0) != 0) & t_mask
        else:
            real = t_mask
        stats_row = tl.load(LIVE + r)
    if PER_TOKEN:
        # reference.per_token_scale: (|x|.amax(-1) / max).clamp_min(MIN_SCALE), an IEEE division (amax_scale
        # divides by a tensor, so torch on CUDA does not turn it into x * (1 / max)); NaN wins
        amax = tl.max(tl.abs(x), axis=1)
        has_nan = tl.sum((x != x).to(tl.int32), axis=1) > 0
        amax_scale = tl.math.div_rn(amax, tl.full([BLOCK_T], FP8_MAX, tl.float32))
        scale = tl.where(has_nan, float("nan"), tl.maximum(amax_scale, MIN_SCALE))[:, None]
    else:
        scale = tl.load(SCALE + head * scale_stride)
    y = tl.math.div_rn(x, scale)       # IEEE division, as torch's: once, for the codes and the clip ratio
    codes = _fp8_codes(y, FP8_DTYPE, FP8_MAX, IS_E4M3, SATURATE)
    read = (codes.to(FP8_DTYPE, bitcast=True).to(tl.float32) * scale).to(OUT.dtype.element_ty)
    out_rows = r.to(tl.int64) * stride_or + head * stride_oh + out_cols.to(tl.int64) * stride_oc
    if OUT_ALIGN > 1:  # as for X: the read-back went out two bytes a store (16 x 8k: 878 us a write, 2x session 24's)
        out_rows = tl.multiple_of(out_rows, OUT_ALIGN)
    tl.store(OUT + out_rows[:, None] + offs_d[None, :], read, mask=m2)
    if STORE:
        row = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + head * stride_ch + offset
        if ROW_ALIGN > 1:  # as for X: without them the codes went out a byte a store (32 x 1k: 0.47 ms, now 0.11)
            row = tl.multiple_of(row, ROW_ALIGN)
        tl.store(CACHE + row[:, None] + offs_d[None, :], codes, mask=m2 & (slot >= 0)[:, None])
    if STATS:
        counted = real[:, None] & (offs_d < D)[None, :]
        ratio = tl.abs(y) * INV_MAX     # torch on CUDA: (x / s).abs() / max
        back = read.to(tl.float32)
        finite_back = (back == back) & (tl.abs(back) != float("inf"))
        finite_ratio = tl.where(counted & (ratio == ratio) & (ratio != float("inf")), ratio, 0.0)
        # clipped + 2^16 x nonfinite in one int32 sum: a program holds fewer than 2^16 values (the launcher asserts)
        flags = (counted & (ratio > 1.0)).to(tl.int32) + (counted & ~finite_back).to(tl.int32) * 65536
        packed = tl.sum(tl.sum(flags, axis=1), axis=0)
        # relaxed: the sums are read only after the launch ends, so no order among them or with the stores is
        # wanted; Triton's default (acq_rel) fenced each of the five and waited for its old value (Triton 3.9
        # sm_90 PTX: atom.acq_rel + bar.sync, now red.relaxed)
        tl.atomic_add(COUNTS + stats_row * 3, tl.sum(real.to(tl.int32)).to(tl.int64) * D, sem="relaxed")
        tl.atomic_add(COUNTS + stats_row * 3 + 1, (packed % 65536).to(tl.int64), sem="relaxed")
        tl.atomic_add(COUNTS + stats_row * 3 + 2, (packed // 65536).to(tl.int64), sem="relaxed")
        tl.atomic_max(AMAX + stats_row, tl.max(tl.max(finite_ratio, axis=1), axis=0), sem="relaxed")


# Tokens a program of the fused write takes, at most. With its stores and loads vectorised (ROW_ALIGN, X_ALIGN), the
# write of one layer's K in an 8B-shaped prefill took 107 us at 32 and 135 at 64 for 32 x 1k tokens, 414 and 534 us
# for 16 x 8k (H200, session 24, benchmarks/fused_write_bench.py)
TOKENS_PER_PROGRAM = 32


def _inverse_max(fmt: str) -> float:
    """1 / max as fp32 computes it (what torch's CUDA division by a Python scalar multiplies by)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(FP8_MAX[fmt], dtype=torch.float32))


@on_tensor_device
def quantize_store(x: torch.Tensor, scale: torch.Tensor | None, fmt: str, saturate: bool = True, *,
                   out: torch.Tensor | None = None, out_columns: torch.Tensor | None = None,
                   cache: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                   cache_strides: tuple[int, int, int] = (0, 0, 0), col_offset: int = 0, block_size: int = 16,
                   counts: torch.Tensor | None = None, amax: torch.Tensor | None = None,
                   live: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> torch.Tensor:
    """One launch: codes = fp8(x / scale) (scale None: per token over D, as `reference.per_token_scale`),
    returns codes * scale in x's dtype (bit-identical to `reference.dequantize(reference.quantize(...))`),
    optionally writes the codes into a paged cache and adds the cast statistics on the device.

    x: [R, H, C, D] bf16/fp16 (D contiguous or not); scale: fp32 [] or [H], or None for per-token.
    out: where the read-back goes, [R, H, C, D] (any strides, D contiguous; None: a new contiguous tensor), or with
    out_columns [C] int64 (on the device, so a CUDA graph replays it as the step moves) [R, H, columns, D]: token t
    at column out_columns[t] (static storage, `harness.kv_paths.cache.StaticColumns`).
    cache (uint8 view of an fp8 cache) + slots [R * C] int64 (-1 skip, row-major over (r, c)) + cache_strides
    (block, slot, head) in elements + col_offset: row slot of head h starts at
    (slot // block_size) * s_b + (slot % block_size) * s_s + h * s_h + col_offset.
    counts [rows, 3] int64 (+= values, clipped, nonfinite), amax [rows] fp32 (max= largest finite |x / s| / max),
    live [R] int64: the stats row of each batch row; valid [R, C] int (0 = pad, not counted; None: all real).
    """
    return _launch([(x, scale, out, cache, col_offset)], fmt, saturate, out_columns, slots, cache_strides,
                   block_size, counts, amax, live, valid)[0]


@on_tensor_device
def quantize_store_pair(key: torch.Tensor, value: torch.Tensor, k_scale: torch.Tensor | None,
                        v_scale: torch.Tensor | None, fmt: str, saturate: bool = True, *,
                        k_out: torch.Tensor | None = None, v_out: torch.Tensor | None = None,
                        out_columns: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                        v_cache: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                        cache_strides: tuple[int, int, int] = (0, 0, 0), block_size: int = 16,
                        counts: torch.Tensor | None = None, amax: torch.Tensor | None = None,
                        live: torch.Tensor | None = None, valid: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_store` of key and value in one launch: the same shape, dtype, format and kind of scale (both per
    token, or both static of the same shape), caches of the same strides (`pair_refusal` says why not). Returns
    (key's read-back, value's)."""
    why = pair_refusal(key, value, k_scale, v_scale, k_cache, v_cache)
    assert why is None, why
    return tuple(_launch([(key, k_scale, k_out, k_cache, 0), (value, v_scale, v_out, v_cache, 0)], fmt, saturate,
                         out_columns, slots, cache_strides, block_size, counts, amax, live, valid))


def read_back_out(x: torch.Tensor, out: torch.Tensor | None, out_columns: torch.Tensor | None) -> torch.Tensor:
    """Where a fused write of x [R, H, C, D] puts its read-back (both fused writes take it so): `out` checked, or a new
    contiguous tensor; with out_columns [C] int64, out is [R, H, columns, D] (static storage)."""
    rows, heads, chunk, dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    assert out.dtype == x.dtype and out.dim() == 4 and out.stride(3) == 1, \
        "out must be [R, H, C, D] in x's dtype, D contiguous"
    if out_columns is None:
        assert out.shape == x.shape, f"out must be x's shape {list(x.shape)}, got {list(out.shape)}"
    else:
        assert out.shape[:2] == x.shape[:2] and out.shape[3] == dim, \
            f"out must be [{rows}, {heads}, columns, {dim}], got {list(out.shape)}"
        assert out_columns.dtype == torch.int64 and out_columns.shape == (chunk,) and out_columns.stride(0) == 1, \
            f"out_columns must be [{chunk}] int64"
    return out


def pair_refusal(key: torch.Tensor, value: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None, k_cache: torch.Tensor | None = None,
                 v_cache: torch.Tensor | None = None) -> str | None:
    """Why key and value cannot share one launch of the fused write, or None."""
    if key.shape != value.shape or key.dtype != value.dtype:
        return f"key {list(key.shape)} {key.dtype} and value {list(value.shape)} {value.dtype} differ"
    if key.stride(3) != value.stride(3):
        return "key and value differ in head_dim stride"
    if (k_scale is None) != (v_scale is None) or (k_scale is not None and k_scale.shape != v_scale.shape):
        return "key and value have different kinds of scale"
    if (k_cache is None) != (v_cache is None) or (k_cache is not None and k_cache.stride() != v_cache.stride()):
        return "key and value caches differ in layout"
    return None


def _launch(sides: list[tuple], fmt: str, saturate: bool, out_columns: torch.Tensor | None,
            slots: torch.Tensor | None, cache_strides: tuple[int, int, int], block_size: int,
            counts: torch.Tensor | None, amax: torch.Tensor | None, live: torch.Tensor | None,
            valid: torch.Tensor | None) -> list[torch.Tensor]:
    """One launch of `_quantize_store_kernel` over one or two sides, each (x, scale, out, cache, col_offset)."""
    assert fmt in _TL_FP8, f"unknown fp8 format {fmt!r}"
    x, scale = sides[0][0], sides[0][1]
    assert x.dim() == 4 and x.dtype in (torch.bfloat16, torch.float16), \
        f"x must be [R, H, C, D] bf16/fp16, got {list(x.shape)} {x.dtype}"
    rows, heads, chunk, dim = x.shape
    store, stats = sides[0][3] is not None, counts is not None
    outs, caches = [], []
    for side_x, side_scale, out, cache, _ in sides:
        if side_scale is not None:
            _check_scale(side_scale, "scale", (heads,))
        out = read_back_out(side_x, out, out_columns)
        if store:
            assert cache is not None and cache.dtype == torch.uint8, "cache must be a uint8 view, with slots"
        outs.append(out)
        caches.append(cache)
    if store:
        assert slots is not None, "a cache needs slots"
        _check_slots(slots, rows * chunk)
    if stats:
        assert counts.dtype == torch.int64 and counts.dim() == 2 and counts.shape[1] == 3, "counts must be [rows, 3] int64"
        assert amax is not None and amax.dtype == torch.float32 and amax.shape == counts.shape[:1], "amax must be [rows] fp32"
        assert live is not None and live.dtype == torch.int64 and live.shape == (rows,), "live must be [R] int64"
        assert valid is None or (valid.shape == (rows, chunk) and valid.stride(1) == 1), "valid must be [R, C]"
    _check_cuda(*[t for side in sides for t in side[:2] if t is not None], *outs,
                *[t for t in (*caches, slots, counts, amax, live, valid, out_columns) if t is not None])
    if x.numel() == 0:
        return outs
    block_t = min(TOKENS_PER_PROGRAM, triton.next_power_of_2(max(chunk, 2)))
    assert block_t * triton.next_power_of_2(dim) < 65536, \
        f"a program's values must number under 2^16 (the statistics pack two counts in an int32), head size {dim}"
    first, last = sides[0], sides[-1]  # the same side when one
    out, v_out = outs[0], outs[-1]
    assert out.stride() == v_out.stride(), "key's and value's out must have the same strides"
    dummy = out
    x_align = min(vector_alignment(first[0]), vector_alignment(last[0]))
    _quantize_store_kernel[(rows * triton.cdiv(chunk, block_t), heads, len(sides))](
        x, out, scale if scale is not None else dummy, caches[0] if store else dummy, slots if store else dummy,
        valid if valid is not None else dummy, live if stats else dummy, counts if stats else dummy,
        amax if stats else dummy, out_columns if out_columns is not None else dummy,
        last[0], v_out, last[1] if last[1] is not None else dummy, caches[-1] if store else dummy,
        chunk, int(scale is not None and scale.dim() == 1),
        x.stride(0), x.stride(1), x.stride(2), x.stride(3), valid.stride(0) if valid is not None else 0,
        block_size, *cache_strides, first[4],
        out.stride(0), out.stride(1), out.stride(2),
        last[0].stride(0), last[0].stride(1), last[0].stride(2), last[4],
        D=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_T=block_t, FP8_DTYPE=_TL_FP8[fmt], FP8_MAX=FP8_MAX[fmt],
        INV_MAX=_inverse_max(fmt), MIN_SCALE=MIN_SCALE, IS_E4M3=fmt == "e4m3", SATURATE=bool(saturate),
        PER_TOKEN=scale is None, STORE=store, STATS=stats, HAS_VALID=valid is not None,
        HAS_COLS=out_columns is not None, SIDES=len(sides), X_ALIGN=x_align,
        ROW_ALIGN=alignment(*cache_strides, first[4], last[4]) if store else 1,
        OUT_ALIGN=vector_alignment(out),
        num_warps=_warps(block_t * triton.next_power_of_2(dim)),
    )
    return outs


def alignment(*offsets: int, at: int = 16) -> int:
    """The largest power of two up to `at` that divides every offset (in elements): what a kernel may tell Triton of
    addresses built from strides it does not specialise on, so that it loads and stores whole vectors."""
    align = at
    while align > 1 and any(offset % align for offset in offsets):
        align //= 2
    return align


def vector_alignment(t: torch.Tensor) -> int:
    """`alignment` of a [R, H, C, D] tensor's rows (its first three strides) for 16-byte vectors of its elements; 1
    where D is not contiguous (no vectors along it)."""
    return alignment(t.stride(0), t.stride(1), t.stride(2), at=16 // t.element_size()) if t.stride(3) == 1 else 1


def _warps(elements: int) -> int:
    """Warps for a program of `elements` values: 32 a thread from 8,192 up, 2 warps below 2,048."""
    return 8 if elements >= 8192 else 4 if elements >= 2048 else 2
