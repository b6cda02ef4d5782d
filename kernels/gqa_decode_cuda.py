"""The CUDA GQA decode kernel's launcher: kernels/gqa_decode_block_scaled.cu, compiled at first use by NVRTC
(kernels/nvrtc.py), over every block-scaled layout (kernels/decode_attention_block_scaled.py's impl="cuda") and over
the plain FP8 caches of kernels/decode_attention.py (e4m3 / e5m2 codes with a static per-tensor or per-KV-head scale:
the layout's block scale "none").

What it serves is declared here, once, for both launchers to ask: `cuda_serves` (layouts), `cuda_head_dims`,
`cuda_refusal` (why it cannot run one call: shape, alignment, device, compiler); `decode` runs it and merges the splits
(kernels/splits.py); a kernel that does not build raises nvrtc.BuildError, remembered per build
(`nvrtc.BUILD_FAILURES`), and the launcher that asked runs its Triton kernel instead (`warn_fallback` says so once).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from kernels import nvrtc
from kernels.splits import LOG2E, merge_splits, partials, plan_splits

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gqa_decode_block_scaled.cu")
# A plain FP8 cache's launch whose one split has at least this many programs (batch x KV heads) an SM takes 2 blocks
# an SM with two tiles ahead instead of 3 with one (H200, session 26, kernels/BENCHMARKS.md, ms, plain e4m3, head 128:
# batch 32 1k 0.0348 -> 0.0337, batch 64 1k 0.0643 -> 0.0566, batch 32 8k 0.1547 -> 0.1482; below it, batch 16 8k
# and batch 8 32k, 3 blocks an SM were 2-4% faster)
ONE_SPLIT_FILL = 1.9
GROUP_MAX = 16         # query heads per KV head: Q . K^T's m16; above 8 (G16) P . V takes two n8 MMAs
GROUP_WIDE_HEAD_DIMS = (64, 128)   # 9-16 heads a KV head: the second accumulator at head 256 needs 64 KB of smem
TILE = 16              # tokens a warp takes at a time (pages hold whole tiles)
IMPLS = ("cuda", "triton")
# the kernel's ELEMENT and SCALE (the block-scaled Triton kernel's numbering, then the plain FP8 caches')
ELEMENTS = {"e2m1": 0, "e4m3": 1, "int8": 2, "int4": 3, "e5m2": 4}
SCALES = {"e4m3": 0, "e8m0": 1, "fp32": 2, "none": 3}
BITS = {"e2m1": 4, "e4m3": 8, "int8": 8, "int4": 4, "e5m2": 8}


def cuda_serves(element: str, block_scale: str, block: int) -> bool:
    """Whether the kernel reads this layout: any block-scaled element under e4m3 scales per 16 values, e8m0 per 16 or
    32, or fp32 per token-head (every layout of kernels/reference.py's "Block-scaled caches"); or e4m3 / e5m2 codes
    with no block scale (a plain FP8 cache). e5m2 comes only without block scales."""
    if block_scale == "none":
        return element in ("e4m3", "e5m2")
    return element in ELEMENTS and element != "e5m2" and (
        block_scale == "fp32" or (block_scale, block) in (("e4m3", 16), ("e8m0", 16), ("e8m0", 32)))


def cuda_head_dims(element: str, block_scale: str) -> tuple[int, ...]:
    """The head sizes it is built for: 256 only for 4-bit elements under e4m3 or fp32 scales (the rest spill:
    8-bit elements at 256 spill 564-1300 bytes, ptxas 12 for sm_90)."""
    return (64, 128, 256) if BITS[element] == 4 and block_scale != "e8m0" else (64, 128)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def cuda_refusal(q: torch.Tensor, k_codes: torch.Tensor, k_block_scales: torch.Tensor | None, element: str,
                 block_scale: str, block: int, v_codes: torch.Tensor | None = None,
                 v_block_scales: torch.Tensor | None = None) -> str | None:
    """Why the kernel cannot run this call (None when it can): the layout, the shape and the alignment first, then
    the device and the compiler. k_codes: [pages, page, Hkv, bytes] (any dtype: its bytes); V's tensors share K's
    strides (the launchers assert it); their bases are checked beside K's where given."""
    if not cuda_serves(element, block_scale, block):
        return (f"it reads e4m3 scales per 16, e8m0 per 16 or 32, fp32 per token-head, or e4m3 / e5m2 with no block "
                f"scale, got {element} / {block_scale} / {block}")
    head_dim, group = q.shape[2], q.shape[1] // k_codes.shape[2]
    head_dims = cuda_head_dims(element, block_scale)
    if head_dim not in head_dims:
        return f"it is built for head sizes {head_dims}, got {head_dim}"
    if group > GROUP_MAX:
        return f"it takes up to {GROUP_MAX} query heads per KV head, got {group}"
    if group > 8 and head_dim not in GROUP_WIDE_HEAD_DIMS:
        return f"it takes 9-16 query heads per KV head at head sizes {GROUP_WIDE_HEAD_DIMS}, got {head_dim}"
    if k_codes.shape[1] % TILE:
        return f"its tiles of {TILE} tokens must lie in one page: page size {k_codes.shape[1]}"
    # runs of codes: a quarter of a head (K); of scales: a quarter's e4m3 bytes, a whole e8m0 row, one fp32
    codes_align = min(16, head_dim * BITS[element] // 32)
    bases = [t.data_ptr() for t in (k_codes, v_codes) if t is not None]
    strides = [s * k_codes.element_size() for s in k_codes.stride()[:3]]
    if any(p % codes_align for p in bases) or any(s % codes_align for s in strides):
        return f"it loads {codes_align}-byte runs of codes: the codes' base and strides must be multiples of that"
    if block_scale != "none":
        scales_align = (4 if block_scale == "fp32" else max(1, head_dim // 64) if block_scale == "e4m3"
                        else min(16, head_dim // block))
        bases = [t.data_ptr() for t in (k_block_scales, v_block_scales) if t is not None]
        strides = [s * k_block_scales.element_size() for s in k_block_scales.stride()[:3]]
        if any(p % scales_align for p in bases) or any(s % scales_align for s in strides):
            return (f"it loads {scales_align}-byte runs of scales: the scales' base and strides must be multiples of "
                    f"that")
    if q.device.type != "cuda":
        return f"it runs on CUDA tensors, got {q.device.type} ones"
    reason = nvrtc.unavailable()
    if reason:
        return reason
    if _capability(q.device.index) < (8, 9):
        return "it needs sm_89 or later (cvt from e4m3 / e5m2 pairs)"
    return None


@functools.lru_cache(maxsize=None)
def warn_fallback(launcher: str, reason: str, source: str = "kernels/gqa_decode_block_scaled.cu") -> None:
    """Once per launcher and reason: the kernel (`source`) did not build, so `launcher` runs its Triton kernel."""
    warnings.warn(f"{launcher}: the CUDA kernel ({source}) did not build here, so the Triton kernel runs instead: "
                  f"{reason}", RuntimeWarning, stacklevel=4)


def two_ahead_fits(element: str, block_scale: str, block: int, head_dim: int, ctas: int) -> bool:
    """Whether two tiles loaded ahead fit the registers without a spill (ptxas 12 for sm_90, every layout compiled):
    at 2 blocks an SM (255 registers) for heads up to 128 (9-16 query heads a KV head included: 135-252 registers);
    at 3 (168), 4-bit elements only, and not under e8m0 scales per 16 at head 128 (32-48 bytes spilled). 8-bit
    elements spill 52-280 bytes at 3."""
    if head_dim > 128:
        return False
    if ctas <= 2:
        return True
    return BITS[element] == 4 and not (block_scale == "e8m0" and block == 16 and head_dim == 128)


def _kernel(defines: tuple, index: int):
    return nvrtc.build(SOURCE, "gqa_block_scaled_decode", defines, index)


def decode(q, k_codes, v_codes, k_block_scales, v_block_scales, block_table, seq_lens, k_scale, v_scale, sm_scale,
           num_splits, cfg, sinks=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's (out, lse) for a call `cuda_refusal` passed; nvrtc.BuildError where it does not build here.
    cfg: "layout" (element, block scale, block: head_dim for fp32 per token-head and "none"), "cuda_warps", "ctas",
    "cuda_prefetch". k_block_scales None for block scale "none". sinks: fp32 [Hq], merged with the splits."""
    batch, q_heads, head_dim = q.shape
    kv_heads, page_size = k_codes.shape[2], k_codes.shape[1]
    warps = cfg.get("cuda_warps", 4)
    element, block_scale, block = cfg["layout"]
    # head size 256 holds 245 registers a thread with one tile ahead, and 9-16 query heads a KV head (a second
    # accumulator) 188-252 at head 128: 2 blocks an SM (at 3 they spill 48-312 bytes, ptxas 12 for sm_90)
    wide = q_heads // kv_heads > 8
    ctas = 2 if head_dim > 128 or wide else cfg.get("ctas", 3)
    prefetch = cfg.get("cuda_prefetch", 1) if two_ahead_fits(element, block_scale, block, head_dim, ctas) else 1
    if (block_scale == "none" and ctas == 3 and prefetch == 1 and num_splits is None
            and batch * kv_heads >= ONE_SPLIT_FILL * _sm_count(q.device.index)):
        # one split whose programs fill two blocks an SM: budget the registers for two and load two tiles ahead
        ctas, prefetch = 2, 2
    codes_bytes = k_codes.element_size()
    if k_block_scales is None:   # no block scales: the kernel reads none (its pointers and strides unused)
        k_block_scales = v_block_scales = k_codes
        scale_bytes, scale_strides = 1, (0, 0, 0)
    else:
        scale_bytes = k_block_scales.element_size()   # the scales' strides go to the kernel in bytes
        scale_strides = tuple(s * scale_bytes for s in k_block_scales.stride()[:3])
    defines = (("ELEMENT", ELEMENTS[element]), ("SCALE", SCALES[block_scale]), ("BLOCK", block),
               ("HEAD_DIM", head_dim), ("PAGE", page_size), ("CS", k_codes.stride(1) * codes_bytes),
               ("SS", scale_strides[1]), ("NW", warps), ("CTAS", ctas), ("PREFETCH", prefetch),
               ("Q_BF16", int(q.dtype == torch.bfloat16)), ("G16", int(wide)))
    kernel = _kernel(defines, q.device.index)
    # one wave: ctas blocks an SM (two waves measured slower, kernels/BENCHMARKS.md session 25)
    num_splits, tokens_per_split = plan_splits(block_table.shape[1] * page_size, batch * kv_heads, TILE * warps,
                                               ctas, q.device, num_splits, whole_waves=True)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    # one split and no sinks: the kernel writes out and lse itself, as the merge would (bit for bit: x 1, + log2 1)
    direct = num_splits == 1 and sinks is None
    lse = torch.empty(batch, q_heads, dtype=torch.float32, device=q.device) if direct else None
    part_out, part_lse = (out, lse) if direct else partials(out, num_splits)   # direct: not written
    part_strides = (0,) * 5 if direct else (part_out.stride(0), part_out.stride(1), part_out.stride(2),
                                            part_lse.stride(0), part_lse.stride(1))
    static = k_scale is not None
    kernel((kv_heads, batch, num_splits), (32 * warps, 1, 1), 0,
           [q, k_codes, v_codes, k_block_scales, v_block_scales, block_table, seq_lens,
            k_scale if static else seq_lens, v_scale if static else seq_lens, part_out, part_lse, sm_scale * LOG2E,
            tokens_per_split, q_heads // kv_heads, int(static and k_scale.dim() == 1),
            int(static and v_scale.dim() == 1), int(static), q.stride(0), q.stride(1),
            k_codes.stride(0) * codes_bytes, k_codes.stride(2) * codes_bytes, scale_strides[0], scale_strides[2],
            block_table.stride(0), *part_strides, out, lse if direct else part_lse, int(direct), out.stride(0),
            out.stride(1), lse.stride(0) if direct else 0])
    return (out, lse) if direct else (out, merge_splits(part_out, part_lse, out, sinks))
