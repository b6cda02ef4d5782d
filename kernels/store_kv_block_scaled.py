"""Fused cache write for block-scaled KV formats (NVFP4, MXFP8, MXFP4, INT8 / INT4 per token-head): in one pass
over each token and head, the block scales, the codes, the read-back values (what the harness's cache layer keeps),
the paged store of codes and scales (the layout of kernels/reference.py, "Block-scaled caches") and the write
statistics, as `store_kv.quantize_store` does for FP8.

The numerics are harness/kv_paths/formats.py's encode and decode, op for op, for x [..., D] in blocks of B values
under a static scale s (1.0 where the format has none), all in fp32:
    v = x / s;  amax = max |v| over the block (NaN if the block holds one)
    block scale:  e4m3: e4m3(amax / target) (saturating; NVFP4's target 6)
                  e8m0: 2^clamp(floor(log2 amax) - emax, -127, 127) (OCP's floor; emax 2 for e2m1, 8 for e4m3;
                        0 -> 2^-127, inf / NaN -> the NaN code 255), or with scale_rounding "ceil" (SGLang's mxfp8
                        and fp4_mx_block16) 2^clamp(ceil(log2(amax / element max)), -127, 127): nothing clips
                  fp32: max(amax / target, floor), NaN kept (per token-head: B = D; int8 127, int4 7)
    codes = element(v / block scale), 0 where the block scale is 0: e2m1 round to nearest, ties to the even code,
            saturating at 6 (NaN -> +0); e4m3 saturating (NaN kept); int round half to even, clamped (NaN -> 0)
    read back = (element value x (block scale x s)) in x's dtype
    ratio = |x / (block scale x s)| / element max: > 1 clipped (CUDA torch multiplies by the fp32 1 / max, as here);
            fp32 block scales: a ratio up to 1 + 2^-21 is 1 (the rounding of amax / target, not a clip)
Divisions are IEEE (div_rn), as torch divides tensor by tensor. e2m1 and int rounding are integer comparisons and
the fp32 round-to-nearest of (v + 1.5 x 2^23) - 1.5 x 2^23, so the Triton interpreter gives the GPU's bits; e4m3
block scales and MXFP8 codes are the hardware cast (store_kv's `_store_kv_codes`), which the interpreter
mis-rounds near powers of two: validate those on a GPU only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.decode_attention import on_tensor_device
from kernels.decode_attention_block_scaled import ELEMENTS, SCALES, code_bytes, interpreting
from kernels.reference import BLOCK_SCALE_TYPES, ELEMENT_BITS
from kernels.store_kv import (TOKENS_PER_PROGRAM, _check_slots, _store_kv_codes, _warps, alignment, read_back_out,
                              vector_alignment)

ELEMENT_MAX = {"e2m1": 6.0, "e4m3": 448.0, "int8": 127.0, "int4": 7.0}   # the largest magnitude of each element
ELEMENT_EMAX = {"e2m1": 2, "e4m3": 8}                                     # floor(log2 max): OCP MX's emax_elem
INT_RANGE = {"int8": (-128, 127), "int4": (-7, 7)}                        # int4 is symmetric: no -8
ROUNDER = 12582912.0   # 1.5 x 2^23: (v + it) - it rounds |v| < 2^22 to the nearest integer, ties to even, in fp32


@triton.jit
def _e2m1_code(v):
    """fp32 v (already divided by its scale) -> e2m1 code (int32, bit 3 the sign), formats.e2m1_codes's rule."""
    m = tl.abs(v)
    m = tl.where(m != m, 0.0, m)
    code = (m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32) + \
        (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32)
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    return code | (sign << 3)


@triton.jit
def _e2m1_value(code):
    """e2m1 code (int32) -> fp32 value: magnitude (code & 7) as 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    mag = code & 7
    exponent = mag >> 1
    value = tl.where(exponent == 0, (mag & 1).to(tl.float32) * 0.5,
                     (1.0 + (mag & 1).to(tl.float32) * 0.5) * (1 << (tl.maximum(exponent, 1) - 1)).to(tl.float32))
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def _e8m0_bits(amax, EMAX: tl.constexpr):
    """OCP MX scale bits of a block amax (fp32, >= 0 or NaN): clamp(floor(log2 amax) - EMAX, -127, 127) + 127,
    floor(log2) from the exponent field (a subnormal or zero amax clamps to 0); inf and NaN give 255."""
    field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    exponent = tl.where(field == 0, -127, field - 127 - EMAX)
    bits = tl.minimum(tl.maximum(exponent, -127), 127) + 127
    return tl.where(field == 255, 255, bits)


@triton.jit
def _e8m0_bits_ceil(amax, ELEMENT_MAX: tl.constexpr):
    """The engines' MX scale bits (SGLang's mxfp8 / fp4_mx_block16): clamp(ceil(log2(amax / element max)), -127,
    127) + 127, the smallest power of two that leaves amax unclipped; ceil(log2 r) from r's fields: its exponent, plus
    one unless the mantissa is zero (a subnormal r first scaled by 2^64, exactly); zero -> 0, inf and NaN -> 255."""
    ratio = tl.math.div_rn(amax, tl.full(amax.shape, ELEMENT_MAX, tl.float32))
    field = (ratio.to(tl.int32, bitcast=True) >> 23) & 0xFF
    normal = tl.where(field == 0, ratio * 18446744073709551616.0, ratio).to(tl.int32, bitcast=True)  # x 2^64
    exponent = ((normal >> 23) & 0xFF) - 127 + ((normal & 0x7FFFFF) != 0).to(tl.int32) - tl.where(field == 0, 64, 0)
    exponent = tl.where(ratio > 0, exponent, -127)
    bits = tl.minimum(tl.maximum(exponent, -127), 127) + 127
    return tl.where(field == 255, 255, bits)


@triton.jit
def _e8m0_value(bits):
    """e8m0 bits (int32) -> fp32 2^(bits - 127); 0 -> 2^-127 (a subnormal: 0x00400000), 255 -> NaN."""
    value = tl.where(bits == 0, 0x00400000, bits << 23).to(tl.float32, bitcast=True)
    return tl.where(bits == 255, float("nan"), value)


@triton.jit(do_not_specialize=["C", "stride_xr", "stride_xh", "stride_xc", "stride_vr", "stride_cb", "stride_cs",
                               "stride_ch", "stride_sb", "stride_ss", "stride_sh", "stride_or", "stride_oh",
                               "stride_oc"],
            do_not_specialize_on_alignment=["VALID", "OUT_COLS"])
def _quantize_store_block_scaled_kernel(
    X, OUT,                  # [R, H, C, D] x (any strides), OUT [R, H, C or columns, D] in x's dtype (D contiguous)
    SCALE,                   # fp32 [] or [H] static scale (read when HAS_SCALE)
    CODES, BLOCK_SCALES,     # paged codes (uint8) and block scales (uint8 bits or fp32); read when STORE
    SLOTS,                   # [R * C] int64 slots (-1 skip)
    VALID, LIVE, COUNTS, AMAX,   # [R, C] int (0 = pad), [R] int64 stats row, [rows, 3] int64, [rows] fp32
    OUT_COLS,                # [C] int64: OUT's column of chunk token t (static storage); read when HAS_COLS
    C, scale_stride,
    stride_xr, stride_xh, stride_xc, stride_xd, stride_vr,
    page_size, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh, stride_or, stride_oh, stride_oc,
    D: tl.constexpr, BLOCK_T: tl.constexpr, ELEMENT: tl.constexpr, BLOCK_SCALE: tl.constexpr, BLOCK: tl.constexpr,
    TARGET: tl.constexpr, FLOOR: tl.constexpr, EMAX: tl.constexpr, CEIL: tl.constexpr, ELEMENT_MAX_: tl.constexpr,
    INV_MAX: tl.constexpr,
    INT_LOW: tl.constexpr, INT_HIGH: tl.constexpr, HAS_SCALE: tl.constexpr, STORE: tl.constexpr,
    STATS: tl.constexpr, HAS_VALID: tl.constexpr, HAS_COLS: tl.constexpr, X_ALIGN: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    SCALE_ALIGN: tl.constexpr, OUT_ALIGN: tl.constexpr,
):
    NUM_BLOCKS: tl.constexpr = D // BLOCK
    tiles = tl.cdiv(C, BLOCK_T)
    pid = tl.program_id(0)
    r = pid // tiles
    head = tl.program_id(1)
    offs_t = (pid % tiles) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D)
    t_mask = offs_t < C
    m2 = t_mask[:, None]
    token = r.to(tl.int64) * stride_xr + head * stride_xh + offs_t * stride_xc           # [BLOCK_T] first element
    if X_ALIGN > 1:  # the strides are not specialised on: say what the launcher checked (vector loads)
        token = tl.multiple_of(token, X_ALIGN)
    x = tl.load(X + token[:, None] + offs_d[None, :] * stride_xd, mask=m2, other=0.0).to(tl.float32)  # [BLOCK_T, D]
    s = 1.0
    if HAS_SCALE:
        s = tl.load(SCALE + head * scale_stride)
        v = tl.math.div_rn(x, tl.zeros_like(x) + s)
    else:
        v = x
    blocks = tl.reshape(v, BLOCK_T, NUM_BLOCKS, BLOCK)
    amax = tl.max(tl.abs(blocks), axis=2)                                                    # [BLOCK_T, NUM_BLOCKS]
    amax = tl.where(tl.sum((blocks != blocks).to(tl.int32), axis=2) > 0, float("nan"), amax)
    if BLOCK_SCALE == 0:      # e4m3(amax / target), saturating
        wanted = tl.math.div_rn(amax, tl.full(amax.shape, TARGET, tl.float32))
        if FLOOR > 0:
            wanted = tl.where(wanted != wanted, wanted, tl.maximum(wanted, FLOOR))
        stored = _store_kv_codes(wanted, 1.0, tl.float8e4nv, 448.0, True, True)             # uint8 bits
        block_fp32 = stored.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif BLOCK_SCALE == 1:    # e8m0: OCP's floor, or the engines' ceil (CEIL)
        if CEIL:
            stored = _e8m0_bits_ceil(amax, ELEMENT_MAX_)
        else:
            stored = _e8m0_bits(amax, EMAX)
        block_fp32 = _e8m0_value(stored)
        stored = stored.to(tl.uint8)
    else:                     # fp32: max(amax / target, floor), NaN kept
        block_fp32 = tl.where(amax != amax, amax,
                              tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, TARGET, tl.float32)), FLOOR))
    divisor = tl.broadcast_to(block_fp32[:, :, None], (BLOCK_T, NUM_BLOCKS, BLOCK))
    scaled = tl.where(divisor == 0, 0.0, tl.math.div_rn(blocks, divisor))
    if ELEMENT == 0:          # e2m1
        codes = _e2m1_code(scaled)
        values = _e2m1_value(codes)
    elif ELEMENT == 1:        # e4m3, saturating
        codes = _store_kv_codes(scaled, 1.0, tl.float8e4nv, 448.0, True, True)
        values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:                     # int: round half to even, clamped; NaN -> 0
        rounded = tl.minimum(tl.maximum(tl.where(scaled != scaled, 0.0, scaled), -256.0), 256.0)
        rounded = (rounded + 12582912.0) - 12582912.0      # ROUNDER: ties to even, in fp32
        values = tl.minimum(tl.maximum(rounded, INT_LOW), INT_HIGH)
        codes = values.to(tl.int32)
    value_scale = block_fp32 * s                                                             # [BLOCK_T, NUM_BLOCKS]
    read = values * tl.broadcast_to(value_scale[:, :, None], (BLOCK_T, NUM_BLOCKS, BLOCK))
    read = tl.reshape(read, BLOCK_T, D).to(OUT.dtype.element_ty)
    if HAS_COLS:  # straight into static storage: token t at column OUT_COLS[t]
        out_cols = tl.load(OUT_COLS + offs_t, mask=t_mask, other=0)
    else:
        out_cols = offs_t
    out_rows = r.to(tl.int64) * stride_or + head * stride_oh + out_cols.to(tl.int64) * stride_oc
    if OUT_ALIGN > 1:  # its strides are not specialised on: what the launcher checked (vector stores, not 2 bytes)
        out_rows = tl.multiple_of(out_rows, OUT_ALIGN)
    tl.store(OUT + out_rows[:, None] + offs_d[None, :], read, mask=m2)
    if STORE:
        slot = tl.load(SLOTS + r.to(tl.int64) * C + offs_t, mask=t_mask, other=-1)
        keep = t_mask & (slot >= 0)
        page = slot // page_size
        row = page * stride_cb + (slot % page_size) * stride_cs + head * stride_ch            # [BLOCK_T]
        if ROW_ALIGN > 1:  # as for X (store_kv.quantize_store: one-byte stores without it)
            row = tl.multiple_of(row, ROW_ALIGN)
        codes = tl.reshape(codes, BLOCK_T, D)
        if ELEMENT == 1 or ELEMENT == 2:                     # 8-bit elements: one a byte
            offs_c = tl.arange(0, D)
            tl.store(CODES + row[:, None] + offs_c[None, :], codes.to(tl.uint8), mask=keep[:, None])
        else:                                                # 4-bit: two a byte, the even index in the low nibble
            low, high = tl.split(tl.reshape(codes & 15, BLOCK_T, D // 2, 2))
            offs_c = tl.arange(0, D // 2)
            tl.store(CODES + row[:, None] + offs_c[None, :], (low | (high << 4)).to(tl.uint8), mask=keep[:, None])
        scale_row = page * stride_sb + (slot % page_size) * stride_ss + head * stride_sh
        if SCALE_ALIGN > 1:
            scale_row = tl.multiple_of(scale_row, SCALE_ALIGN)
        offs_b = tl.arange(0, NUM_BLOCKS)
        if BLOCK_SCALE == 2:   # fp32: one a token-head (NUM_BLOCKS 1), or one a block (fp8_ds_mla's tiles of 128)
            tl.store(BLOCK_SCALES + scale_row[:, None] + offs_b[None, :], block_fp32, mask=keep[:, None])
        else:
            tl.store(BLOCK_SCALES + scale_row[:, None] + offs_b[None, :], stored, mask=keep[:, None])
    if STATS:
        if HAS_VALID:
            real = (tl.load(VALID + r.to(tl.int64) * stride_vr + offs_t, mask=t_mask, other=0) != 0) & t_mask
        else:
            real = t_mask
        counted = real[:, None, None] & (tl.zeros([BLOCK_T, NUM_BLOCKS, BLOCK], tl.int32) == 0)
        whole = tl.broadcast_to(value_scale[:, :, None], (BLOCK_T, NUM_BLOCKS, BLOCK))
        ratio = tl.abs(tl.math.div_rn(tl.reshape(x, BLOCK_T, NUM_BLOCKS, BLOCK), whole)) * INV_MAX
        if BLOCK_SCALE == 2:   # the block's top within 4 fp32 ulps of the max is the max (formats' clip_ratio)
            ratio = tl.where((ratio > 1.0) & (ratio <= 1.000000476837158203125), 1.0, ratio)   # 1 + 2^-21
        back = tl.reshape(read, BLOCK_T, NUM_BLOCKS, BLOCK).to(tl.float32)
        finite_back = (back == back) & (tl.abs(back) != float("inf"))
        finite_ratio = tl.where(counted & (ratio == ratio) & (ratio != float("inf")), ratio, 0.0)
        clipped = tl.sum(tl.sum((counted & (ratio > 1.0)).to(tl.int64), axis=2))
        nonfinite = tl.sum(tl.sum((counted & ~finite_back).to(tl.int64), axis=2))
        stats_row = tl.load(LIVE + r)
        # relaxed, as store_kv's: read only after the launch, so no order to keep (acq_rel fenced each one)
        tl.atomic_add(COUNTS + stats_row * 3, tl.sum(real.to(tl.int64)) * D, sem="relaxed")
        tl.atomic_add(COUNTS + stats_row * 3 + 1, clipped, sem="relaxed")
        tl.atomic_add(COUNTS + stats_row * 3 + 2, nonfinite, sem="relaxed")
        tl.atomic_max(AMAX + stats_row, tl.max(tl.max(tl.max(finite_ratio, axis=2), axis=1), axis=0), sem="relaxed")


def _inverse(value: float) -> float:
    """1 / value as fp32 computes it (what torch's CUDA division by a Python scalar multiplies by)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(value, dtype=torch.float32))


@on_tensor_device
def quantize_store_block_scaled(x: torch.Tensor, scale: torch.Tensor | None, *, element: str, block_scale: str,
                                block_size: int, target: float = 0.0, scale_floor: float = 0.0,
                                scale_rounding: str = "floor", out: torch.Tensor | None = None,
                                out_columns: torch.Tensor | None = None, codes: torch.Tensor | None = None,
                                block_scales: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                                page_size: int = 16, counts: torch.Tensor | None = None,
                                amax: torch.Tensor | None = None, live: torch.Tensor | None = None,
                                valid: torch.Tensor | None = None) -> torch.Tensor:
    """One launch: block scales and codes of x (module docstring), returns the read-back values in x's dtype,
    optionally stores codes and block scales into paged caches and adds the write statistics on the device.

    x: [R, H, C, D] bf16/fp16 (any strides), D a power of two in [16, 256]; scale: fp32 [] or [H] static, or None;
    element: e2m1 | e4m3 | int8 | int4; block_scale: e4m3 | e8m0 | fp32 (per token-head where block_size is 0 or
    the head; per block of block_size values below it: fp8_ds_mla);
    target: what the block amax maps to (e4m3 / fp32 block scales); scale_floor: the smallest fp32 (or e4m3)
    block scale; scale_rounding: e8m0 block scales by OCP's "floor" or the engines' "ceil" (module docstring);
    out, out_columns: where the read-back goes, as `store_kv.quantize_store` takes them (static storage's columns).
    codes [num_blocks, page_size, H, D * bits / 8] uint8, block_scales [num_blocks, page_size, H,
    D / B] uint8 or fp32 (or [num_blocks, page_size, H] fp32) + slots [R * C] int64 (-1 skip, row-major over (r, c));
    counts [rows, 3] int64 (+= values, clipped, nonfinite), amax [rows] fp32 (max= largest finite ratio),
    live [R] int64 (the stats row of each batch row), valid [R, C] int (0 = pad, not counted; None: all real).
    """
    assert x.dim() == 4 and x.dtype in (torch.bfloat16, torch.float16), \
        f"x must be [R, H, C, D] bf16/fp16, got {list(x.shape)} {x.dtype}"
    assert element in ELEMENTS and block_scale in BLOCK_SCALE_TYPES, \
        f"element {element!r} / block scale {block_scale!r}: expected one of {sorted(ELEMENTS)} / {BLOCK_SCALE_TYPES}"
    rows, heads, chunk, dim = x.shape
    assert 16 <= dim <= 256 and dim & (dim - 1) == 0, f"head_dim must be a power of two in [16, 256], got {dim}"
    per_block_fp32 = block_scale == "fp32" and 0 < block_size < dim   # fp8_ds_mla's tiles of 128
    block = block_size if per_block_fp32 else dim if block_scale == "fp32" else block_size
    assert block_scale == "fp32" or (block in (16, 32) and dim % block == 0), \
        f"block_size must be 16 or 32 and divide head_dim {dim}, got {block_size}"
    assert not per_block_fp32 or (block >= 16 and block & (block - 1) == 0), \
        f"fp32 scales per block: blocks of a power of two >= 16 values within the head, got {block_size} of {dim}"
    assert block_scale == "e8m0" or target > 0, f"an {block_scale} block scale needs a target, got {target}"
    assert block_scale != "e8m0" or element in ELEMENT_EMAX, f"e8m0 block scales take e2m1 or e4m3, not {element}"
    assert scale_rounding in ("floor", "ceil"), f"scale_rounding must be floor or ceil, got {scale_rounding!r}"
    assert element not in INT_RANGE or block_scale == "fp32", "int elements take fp32 per token-head scales"
    if scale is not None:
        assert scale.dtype == torch.float32 and scale.shape in ((), (heads,)) and scale.is_contiguous(), \
            f"scale must be a contiguous fp32 tensor of shape [] or [{heads}], got {list(scale.shape)} {scale.dtype}"
    out = read_back_out(x, out, out_columns)
    store, stats = codes is not None, counts is not None
    if store:
        expected = code_bytes(element, dim)
        assert codes.dim() == 4 and codes.shape[1:] == (page_size, heads, expected) and codes.dtype == torch.uint8 \
            and codes.stride(-1) == 1, f"codes must be uint8 [num_blocks, {page_size}, {heads}, {expected}], got " \
                                       f"{list(codes.shape)} {codes.dtype}"
        shape = (codes.shape[0], page_size, heads) + (() if block == dim and block_scale == "fp32" else (dim // block,))
        wanted = torch.float32 if block_scale == "fp32" else torch.uint8
        assert block_scales is not None and block_scales.shape[:len(shape)] == shape and block_scales.dtype == wanted \
            and block_scales.numel() == codes.shape[0] * page_size * heads * (dim // block), \
            f"block_scales must be {wanted} {list(shape)}, got {None if block_scales is None else list(block_scales.shape)}"
        assert slots is not None, "a store needs slots"
        _check_slots(slots, rows * chunk)
    if stats:
        assert counts.dtype == torch.int64 and counts.dim() == 2 and counts.shape[1] == 3, "counts must be [rows, 3] int64"
        assert amax is not None and amax.dtype == torch.float32 and amax.shape == counts.shape[:1], "amax must be [rows] fp32"
        assert live is not None and live.dtype == torch.int64 and live.shape == (rows,), "live must be [R] int64"
        assert valid is None or (valid.shape == (rows, chunk) and valid.stride(1) == 1), "valid must be [R, C]"
    device = x.device
    assert device.type == "cuda" or interpreting(), f"Triton kernels need CUDA tensors, got {device}"
    assert all(t.device == device for t in (out, scale, codes, block_scales, slots, counts, amax, live, valid,
                                            out_columns) if t is not None), "all tensors must be on one device"
    if x.numel() == 0:
        return out
    block_t = min(TOKENS_PER_PROGRAM, triton.next_power_of_2(max(chunk, 2)))
    dummy = out
    low, high = INT_RANGE.get(element, (0, 0))
    _quantize_store_block_scaled_kernel[(rows * triton.cdiv(chunk, block_t), heads)](
        x, out, scale if scale is not None else dummy, codes if store else dummy,
        block_scales if store else dummy, slots if store else dummy,
        valid if valid is not None else dummy, live if stats else dummy, counts if stats else dummy,
        amax if stats else dummy, out_columns if out_columns is not None else dummy,
        chunk, int(scale is not None and scale.dim() == 1),
        x.stride(0), x.stride(1), x.stride(2), x.stride(3), valid.stride(0) if valid is not None else 0,
        page_size, *(codes.stride()[:3] if store else (0, 0, 0)), *(block_scales.stride()[:3] if store else (0, 0, 0)),
        out.stride(0), out.stride(1), out.stride(2),
        D=dim, BLOCK_T=block_t, ELEMENT=ELEMENTS[element], BLOCK_SCALE=SCALES[block_scale], BLOCK=block,
        TARGET=float(target), FLOOR=float(scale_floor), EMAX=ELEMENT_EMAX.get(element, 0),
        CEIL=scale_rounding == "ceil", ELEMENT_MAX_=float(ELEMENT_MAX[element]),
        INV_MAX=_inverse(ELEMENT_MAX[element]), INT_LOW=float(low), INT_HIGH=float(high), HAS_SCALE=scale is not None,
        STORE=store, STATS=stats, HAS_VALID=valid is not None, HAS_COLS=out_columns is not None,
        X_ALIGN=vector_alignment(x),
        ROW_ALIGN=alignment(*codes.stride()[:3]) if store else 1,
        SCALE_ALIGN=alignment(*block_scales.stride()[:3], at=16 // block_scales.element_size()) if store else 1,
        OUT_ALIGN=vector_alignment(out),
        num_warps=_warps(block_t * dim),
    )
    return out
