"""Paged KV-cache store: quantise new K/V (or an MLA latent row) into an FP8 cache, or copy into a BF16 one.

codes = fp8(x / scale), round to nearest even, the same bytes as torch's cast (`reference.quantize`):
saturating clamps |x / scale| to the format's max first; without saturation e4m3 overflow becomes NaN and
e5m2 overflow inf, as torch's cast does. NaN is written as 0x7F | sign in both formats.
The torch mirror of `store_kv` / `store_latent` is in `kernels/reference.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import FP8_MAX, fp8_format, is_fp8

_TL_FP8 = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}


@triton.jit
def _store_kv_codes(x, scale, FP8_DTYPE: tl.constexpr, FP8_MAX: tl.constexpr, IS_E4M3: tl.constexpr,
                    SATURATE: tl.constexpr):
    """fp8(x / scale) as raw bytes (uint8), bit-identical to torch's x.float() / scale -> fp8 cast."""
    y = tl.math.div_rn(x, scale)                      # IEEE division, as torch's
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
    assert device.type == "cuda", f"Triton kernels need CUDA tensors, got {device}"
    assert all(t.device == device for t in tensors), "all tensors must be on one device"


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
