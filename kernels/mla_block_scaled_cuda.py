"""The CUDA kernel of MLA decode over a block-scaled latent (kernels/mla_decode_block_scaled.cu): what it serves, why
it refuses a call, and its launch. `decode_attention_block_scaled.mla_decode_block_scaled` asks it first (impl None or
"cuda") and runs another kernel where it refuses (impl None) or raises the reason (impl "cuda").

Served, the latent 512 wide and k_pe 64 (DeepSeek's MLA), k_pe in the query's 16-bit type, pages of any size, on sm_90
(its tiles arrive by bulk copies):
- NVFP4: e2m1 values under e4m3 scales per 16, with or without an fp32 static scale;
- vLLM's fp8_ds_mla (FlashMLA's sparse cache): e4m3 values under an fp32 scale per tile of 128, no static scale;
- MXFP4 / MXFP8: e2m1 / e4m3 values under e8m0 scales per 32.
The launch is kernels/mla_decode.py's CUDA entry for FP8 latents (4 warps, 32-token tiles, 4 stages, 2 blocks an
SM; 16 heads a block), its splits merged by kernels/splits.merge_splits. A latent in records whose rows lie one after
another in a page (the engine's pages; fp8_ds_mla's is vLLM's record) runs kernels/mla_decode_latent_split.cu instead
(`latent_split_refusal` says when it cannot): the same definition, on an H200 at 16 heads 1.29-1.48x the tile
kernel's speed for NVFP4 at batches 8 and 32 and 1.20-1.36x at batch 1 (kernels/BENCHMARKS.md, sessions 45-47); for
fp8_ds_mla 1.45-1.55x from 32k and 1.23x at batch 1, 8k, MXFP4 1.34-1.67x, MXFP8 1.32-1.49x (session 49).
The same kernel serves kernels/mla_decode.py's plain FP8 cache (`plain_fp8_refusal`, `decode_plain_fp8`: rows of 512 +
64 fp8 codes under one static scale), its latent_split option.
"""

from __future__ import annotations

import functools
import os

import torch

from kernels import nvrtc
from kernels.splits import LOG2E, MLA_IDLE_MIN_TOKENS, merge_splits, partials, plan_splits

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mla_decode_block_scaled.cu")
LATENT_SPLIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mla_decode_latent_split.cu")
LATENT, ROPE = 512, 64
# (element, block scale, values a block) -> the kernel's (ELEM_E4M3, SCALES), code bytes and block-scale bytes of a row
LAYOUTS = {("e2m1", "e4m3", 16): ((0, 0), LATENT // 2, LATENT // 16),     # NVFP4
           ("e4m3", "fp32", 128): ((1, 1), LATENT, 16),                  # fp8_ds_mla: 4 fp32 tile scales
           ("e2m1", "e8m0", 32): ((0, 2), LATENT // 2, LATENT // 32),    # MXFP4
           ("e4m3", "e8m0", 32): ((1, 2), LATENT, LATENT // 32)}         # MXFP8
# warps, n8 token blocks a warp, stages, blocks an SM, programs an SM for the split plan: kernels/configs.py's mla_fp8
# CUDA entry, the same tile pipeline. On an H200 (batch 8, 32k, session 27) 0.1052 ms at 16 heads for NVFP4; 4 x 2 x
# 3 x 2 and 8 x 1 x 3 x 2 were within 1.5% there and 4-7% faster at 128 heads (kernels/BENCHMARKS.md); the tests ran
# this one
WARPS, BLOCKS, STAGES, CTAS, PROGRAMS_PER_SM = 4, 1, 4, 2, 2
TOKENS = 8 * WARPS * BLOCKS
HEADS_PER_BLOCK = 16
# kernels/mla_decode_latent_split.cu over e2m1 records (NVFP4, MXFP4): 4 warps, tiles of TOKENS rows, stages, blocks
# an SM (also its split plan's blocks an SM where splits are long). On an H200 at batch 8, 16 heads over NVFP4
# (kernels/BENCHMARKS.md, session 45, before the two-step score sum and the tiled merge): 2 x 3 0.0732-0.0740 ms at
# 32k, 3 x 2 0.0755-0.0759, 4 x 2 0.0771-0.0775; at 128k 2 x 3 0.2135 against 4 x 2 0.2350. At 3 blocks an SM ptxas
# holds it in 168 registers, 4-8 bytes spilled (MXFP4: 168, none).
SPLIT_STAGES, SPLIT_CTAS = 2, 3
# A sequence's splits (`latent_split_plan`): SPLIT_CTAS blocks an SM where each split still gets LONG_SPLIT tokens,
# else REG_T_CTAS (short splits' fp32 partials and their merge cost more than a third block an SM gains); at most
# SPLIT_MAX_SPLITS_PER_SM splits an SM for one sequence; splits of at least MIN_SPLIT_TILES tiles, or half that where
# MIN_SPLIT_TILES would leave more than half the SMs without a block. On an H200 at 16 heads (kernels/BENCHMARKS.md,
# session 48, the whole call against other split counts in one process): batch 1 at 8k 0.0153 ms at 128 splits of 64
# tokens (0.0204 at 32 of 256, the plan before), 16 at 8k 0.0389 at 16 splits (0.0424 at 24), batch 8 at 128k 0.1967
# at 49 splits (0.2060 at 32); batch 1 at 128k (session 45) 0.0538 ms at 132 splits, 0.0460 at 264, 0.0482 at 396.
SPLIT_MAX_SPLITS_PER_SM = 2
LONG_SPLIT = 512
MIN_SPLIT_TILES = 4
# Its REG_T build (P . C's fragments kept in registers: 224 of them, so 2 blocks an SM, half the shared-memory traffic)
# where the grid has at most this many blocks an SM anyway: on an H200 at 16 heads 4-7% faster at batch 1 (8k-128k) and
# batch 8 at 8k, 1-4% slower than the 3-block build at batch 8 past 8k and batch 32 (kernels/BENCHMARKS.md, session 47).
# Also the split plan's blocks an SM where splits are short.
REG_T_CTAS = 2
NVFP4 = ("e2m1", "e4m3", 16)
FP8_DS_MLA = ("e4m3", "fp32", 128)
MXFP4, MXFP8 = ("e2m1", "e8m0", 32), ("e4m3", "e8m0", 32)
# the record layouts the latent split reads (`latent_split_refusal`); e2m1 codes take the NVFP4 constants above, fp8
# codes FP8_CTAS and FP8_REG_T below
LATENT_SPLIT_LAYOUTS = (NVFP4, MXFP4, FP8_DS_MLA, MXFP8)
# kernels/mla_decode.py's plain FP8 cache through the latent split (`plain_fp8_refusal`, `decode_plain_fp8`): rows of
# 512 + 64 fp8 codes under one static scale, k_pe's codes too
PLAIN_FP8 = {torch.float8_e4m3fn: ("e4m3", "static", 0), torch.float8_e5m2: ("e5m2", "static", 0)}
# The latent split over fp8 rows (fp8_ds_mla's and MXFP8's 656 bytes, the plain cache's 576) leaves room for 2 blocks
# an SM (`_split_smem`), the REG_T build's too, so one build serves every grid: REG_T, on an H200 at 16 heads over
# fp8_ds_mla 1.05-1.09x the other at batch 8 and 32 from 32k, level at batch 1, 8k; MXFP8 1.00-1.03x; the plain
# cache 1.01-1.10x (kernels/BENCHMARKS.md, session 49)
FP8_CTAS = 2
FP8_REG_T = True


def serves(element: str, block_scale: str, block: int) -> bool:
    return (element, block_scale, block) in LAYOUTS


def _row_bytes(layout: tuple) -> int:
    """A tile row: codes, block scales, k_pe."""
    _, codes, scales = LAYOUTS[layout]
    return codes + scales + 2 * ROPE


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _gpu(index: int) -> tuple[tuple[int, int], int]:
    return (torch.cuda.get_device_capability(index),
            torch.cuda.get_device_properties(index).shared_memory_per_block_optin)


def _tile_bytes(layout: tuple) -> int:
    """Tile stages: rows, and the row shifts (the kernel's tile_at: rows 32 bytes apart modulo 128 (NVFP4) 32 bytes
    every 8 rows and 32 for the last rows; 16 apart (the rest) 384 bytes every 8 rows)."""
    if _row_bytes(layout) % 128 == 16:
        return STAGES * (TOKENS * _row_bytes(layout) + 384 * (TOKENS // 8))
    return STAGES * (TOKENS * _row_bytes(layout) + 32 * (TOKENS // 8) + 32)


def _smem(layout: tuple) -> int:
    """Tile stages, Q's fragments (36 k steps), two score buffers, two of the rows' exponents (e8m0), mbarriers."""
    return (_tile_bytes(layout) + (LATENT // 16 + ROPE // 16) * 32 * 16 + 2 * WARPS * 32 * BLOCKS * 4 * 4
            + 2 * TOKENS * 4 + 8 * STAGES)


def _fp8_codes(layout: tuple) -> bool:
    """fp8 codes (fp8_ds_mla, MXFP8, the plain cache) against e2m1 (NVFP4, MXFP4): the latent split's launch kind."""
    return layout[0] != "e2m1"


def _split_row_bytes(layout: tuple) -> int:
    return LATENT + ROPE if layout in PLAIN_FP8.values() else _row_bytes(layout)


def _split_smem(reg_t: bool = False, layout: tuple = NVFP4) -> int:
    """Tile stages, two buffers of the four warps' partial scores (n8 blocks x 32 lanes x 4 fp32), each warp's
    widened tile (tokens x 128 columns in fp16; none in the REG_T build), an mbarrier a stage."""
    return (SPLIT_STAGES * TOKENS * _split_row_bytes(layout) + 2 * 4 * (TOKENS // 8) * 32 * 16
            + (0 if reg_t else 4 * TOKENS * 128 * 2) + 8 * SPLIT_STAGES)


def latent_split_refusal(codes: torch.Tensor, block_scales: torch.Tensor, k_pe: torch.Tensor,
                         layout: tuple) -> str | None:
    """Why kernels/mla_decode_latent_split.cu cannot take a call `refusal` passed (None when it can): it reads NVFP4,
    MX and fp8_ds_mla records whose rows lie one after another in a page (one copy a page), tiles of whole pages or
    inside one."""
    page = codes.shape[1]
    if layout not in LATENT_SPLIT_LAYOUTS:
        return f"it reads NVFP4, MXFP4, MXFP8 and fp8_ds_mla latents, got {'/'.join(map(str, layout))}"
    row = _row_bytes(layout)
    if not is_record(codes, block_scales, k_pe) or codes.stride(1) * codes.element_size() != row:
        return f"it copies a page's rows in one piece: one {row}-byte record a token, rows adjacent"
    if page % TOKENS and TOKENS % page:
        return f"its tiles of {TOKENS} tokens are whole pages or lie inside one: page {page}"
    if _split_smem(layout=layout) > _gpu(codes.device.index)[1]:
        return f"{_split_smem(layout=layout)} bytes of shared memory is more than this GPU has for a block"
    return None


def plain_fp8_refusal(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor) -> str | None:
    """Why the latent split cannot take kernels/mla_decode.py's plain FP8 cache ([pages, page, 512 + 64] e4m3 or
    e5m2 codes, one static scale) in this call (None when it can): rows adjacent in a page (one copy a page run),
    tiles of whole pages or inside one, the query read 4 elements at a time, sm_90's bulk copies."""
    if cache.dtype not in PLAIN_FP8:
        return f"it reads e4m3 or e5m2 caches, got {cache.dtype}"
    if q_latent.shape[-1] != LATENT or q_pe.shape[-1] != ROPE:
        return f"it is built for a latent of {LATENT} and k_pe of {ROPE}, got {q_latent.shape[-1]} and {q_pe.shape[-1]}"
    if cache.stride(2) != 1 or cache.stride(1) != LATENT + ROPE or cache.stride(0) % 16 or cache.data_ptr() % 16:
        return (f"it copies a page's rows in one piece: rows of {LATENT + ROPE} bytes adjacent, pages and the base "
                "16-byte aligned")
    page = cache.shape[1]
    if page % TOKENS and TOKENS % page:
        return f"its tiles of {TOKENS} tokens are whole pages or lie inside one: page {page}"
    # the larger build's shared memory, as `latent_split_refusal` asks: both builds are loaded at the first call
    return _query_and_device_refusal(q_latent, q_pe, _split_smem(layout=PLAIN_FP8[cache.dtype]))


def decode_plain_fp8(q_latent, q_pe, cache, block_table, seq_lens, scale, sm_scale: float, num_splits: int | None,
                     reg_t: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/mla_decode.py's definition over its plain FP8 cache, s = sm_scale x scale x (q_latent . c + q_pe .
    pe) and out = scale x sum_j p_j c_j, by kernels/mla_decode_latent_split.cu (FP8_PE): (out [B, H, 512] in q's
    dtype, lse [B, H] natural log); the caller checked `plain_fp8_refusal`."""
    return _decode_latent_split(q_latent, q_pe, cache, block_table, seq_lens, scale, sm_scale, num_splits, reg_t,
                                PLAIN_FP8[cache.dtype])


def refusal(q_latent: torch.Tensor, q_pe: torch.Tensor, codes: torch.Tensor, block_scales: torch.Tensor,
            k_pe: torch.Tensor, element: str, block_scale: str, block: int,
            scale: torch.Tensor | None = None) -> str | None:
    """Why the kernel cannot run this call (None when it can): the layout and shapes first, then the device."""
    if not serves(element, block_scale, block):
        return (f"it reads NVFP4 latents (e2m1 under e4m3 scales per 16), fp8_ds_mla's (e4m3 under fp32 scales per "
                f"128) and MX ones (e2m1 / e4m3 under e8m0 scales per 32), got {element} / {block_scale} / {block}")
    if q_latent.shape[-1] != LATENT or q_pe.shape[-1] != ROPE:
        return f"it is built for a latent of {LATENT} and k_pe of {ROPE}, got {q_latent.shape[-1]} and {q_pe.shape[-1]}"
    layout = (element, block_scale, block)
    _, code_bytes, scale_bytes = LAYOUTS[layout]
    if block_scale == "fp32" and scale is not None:
        return "fp8_ds_mla's tile scales are the whole scale: it takes no static scale"
    rows = ((codes, code_bytes), (block_scales, scale_bytes), (k_pe, 2 * ROPE))
    if any(t.element_size() * t.shape[-1] != size or t.stride(-1) != 1 for t, size in rows) or \
            any(t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:2]) for t, _ in rows):
        return (f"it copies whole rows (codes {code_bytes}, scales {scale_bytes}, k_pe {2 * ROPE} bytes) in 16-byte "
                "units: each contiguous, their pages, slots and bases 16-byte aligned")
    return _query_and_device_refusal(q_latent, q_pe, _smem(layout))


def _query_and_device_refusal(q_latent: torch.Tensor, q_pe: torch.Tensor, smem_needed: int) -> str | None:
    """What both kernels ask of the query and the device: 4 elements read at a time, CUDA tensors, NVRTC, sm_90's
    bulk copies, `smem_needed` bytes of shared memory a block."""
    if any(t.data_ptr() % 8 or t.stride(0) % 4 or t.stride(1) % 4 or t.stride(2) != 1 for t in (q_latent, q_pe)):
        return "it reads the query 4 elements at a time: q_latent and q_pe strides and base 8-byte aligned"
    if q_latent.device.type != "cuda":
        return f"it runs on CUDA tensors, got {q_latent.device.type} ones"
    reason = nvrtc.unavailable()
    if reason:
        return reason
    capability, smem = _gpu(q_latent.device.index)
    if capability < (9, 0):
        return "it needs sm_90 or later (bulk copies into shared memory)"
    if smem_needed > smem:
        return f"{smem_needed} bytes of shared memory is more than this GPU has for a block"
    return None


def is_record(codes: torch.Tensor, block_scales: torch.Tensor, k_pe: torch.Tensor) -> bool:
    """Whether a row's codes, block scales and k_pe lie one after another in one record with the same page and slot
    strides (the engine's MLA pages, `harness/kv_paths/block_layout.allocate_latent_rows`; fp8_ds_mla's is vLLM's
    record): one copy a row."""
    parts = (codes, block_scales, k_pe)
    starts = [t.data_ptr() for t in parts]
    ends = [t.data_ptr() + t.shape[-1] * t.element_size() for t in parts]
    strides = {tuple(s * t.element_size() for s in t.stride()[:2]) for t in parts}
    return starts[1] == ends[0] and starts[2] == ends[1] and len(strides) == 1


def decode(q_latent, q_pe, codes, block_scales, k_pe, block_table, seq_lens, scale, sm_scale: float,
           num_splits: int | None, layout: tuple = ("e2m1", "e4m3", 16),
           latent_split: bool | None = None, reg_t: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, 512] in q's dtype, lse [B, H] natural log); layout: (element, block scale, values a block); the
    caller checked `refusal`. latent_split None: kernels/mla_decode_latent_split.cu where it takes the call, else
    kernels/mla_decode_block_scaled.cu; True / False: that one (True raises its refusal). reg_t: the latent split's
    REG_T build or not (None: where the grid has at most REG_T_CTAS blocks an SM); both give the same bits."""
    if latent_split is not False:
        why = latent_split_refusal(codes, block_scales, k_pe, layout)
        if why is None:
            return _decode_latent_split(q_latent, q_pe, codes, block_table, seq_lens, scale, sm_scale, num_splits,
                                        reg_t, layout)
        if latent_split:
            raise ValueError(f"the latent-split MLA kernel cannot run this call: {why}")
    batch, heads, _ = q_latent.shape
    device = q_latent.device
    page = codes.shape[1]
    defines = (("NW", WARPS), ("NB", BLOCKS), ("STAGES", STAGES), ("MT", HEADS_PER_BLOCK // 16), ("CTAS", CTAS),
               ("PAGE", page), ("TILE_BYTES", _tile_bytes(layout)), ("ELEM_E4M3", LAYOUTS[layout][0][0]),
               ("SCALES", LAYOUTS[layout][0][1]),
               ("RECORD", int(is_record(codes, block_scales, k_pe))),
               ("Q_BF16", int(q_latent.dtype == torch.bfloat16)), ("HAS_SCALE", int(scale is not None)))
    kernel = nvrtc.build(SOURCE, "mla_block_scaled_decode", defines, device.index)
    head_blocks = -(-heads // HEADS_PER_BLOCK)
    num_splits, tokens_per_split = plan_splits(block_table.shape[1] * page, batch * head_blocks, TOKENS,
                                               PROGRAMS_PER_SM, device, num_splits, whole_waves=True,
                                               idle_min_tokens=MLA_IDLE_MIN_TOKENS)
    out = torch.empty(batch, heads, LATENT, dtype=q_latent.dtype, device=device)
    part_out, part_lse = partials(out, num_splits)
    scales = block_scales.view(torch.uint8)
    pe_bytes = k_pe.element_size()
    kernel((head_blocks, batch, num_splits), (32 * WARPS, 1, 1), _smem(layout),
           [q_latent, q_pe, codes.view(torch.uint8), scales, k_pe, block_table, seq_lens,
            scale if scale is not None else seq_lens, part_out, part_lse, sm_scale * LOG2E, tokens_per_split, heads,
            q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
            codes.stride(0) * codes.element_size(), codes.stride(1) * codes.element_size(),
            scales.stride(0), scales.stride(1), k_pe.stride(0) * pe_bytes, k_pe.stride(1) * pe_bytes,
            block_table.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0),
            part_lse.stride(1)])
    return out, merge_splits(part_out, part_lse, out)


def latent_split_plan(max_tokens: int, programs: int, sms: int, ctas: int = SPLIT_CTAS) -> tuple[int, int]:
    """(splits, tokens a split: whole tiles) of the latent split over `max_tokens` cache slots for `programs`
    (sequences x head blocks) on `sms` SMs, the grid inside one wave of `ctas` blocks an SM (the constants' comment
    says why)."""
    def at_most(blocks_per_sm: int) -> int:
        return max(1, min(blocks_per_sm * sms // programs, SPLIT_MAX_SPLITS_PER_SM * sms))

    max_tokens = max(max_tokens, 1)
    splits = at_most(ctas)
    if -(-max_tokens // splits) < LONG_SPLIT:
        splits = at_most(min(ctas, REG_T_CTAS))
    wanted = min(splits, -(-max_tokens // (MIN_SPLIT_TILES * TOKENS)))
    if wanted * programs < sms // 2:
        wanted = min(splits, -(-max_tokens // (MIN_SPLIT_TILES // 2 * TOKENS)))
    return plan_splits(max_tokens, programs, TOKENS, ctas, None, wanted)   # whole tiles, none empty


def _latent_split_kernel(page: int, q_bf16: bool, has_scale: bool, reg_t: bool, device: int,
                         layout: tuple = NVFP4) -> nvrtc.Kernel:
    """The latent split's build for this call, the other build (REG_T or not) loaded beside it at the first call:
    which one a call takes depends on its grid, so a CUDA graph captured later for another batch may take the other,
    and its module is then loaded already, not inside the capture. A build that fails is raised, named, by the call
    that needs it (nvrtc.build remembers why)."""
    def build(rt: bool) -> nvrtc.Kernel:
        ctas = FP8_CTAS if _fp8_codes(layout) else REG_T_CTAS if rt else SPLIT_CTAS
        defines = [("STAGES", SPLIT_STAGES), ("PAGE", page), ("CTAS", ctas), ("Q_BF16", int(q_bf16)),
                   ("HAS_SCALE", int(has_scale)), ("REG_T", int(rt))]
        if _fp8_codes(layout):
            defines.append(("ELEM_E4M3", 1))
        if layout[1] == "e8m0":
            defines.append(("E8M0", 1))
        if layout in PLAIN_FP8.values():
            defines += [("FP8_PE", 1), ("FMT_E5M2", int(layout[0] == "e5m2"))]
        return nvrtc.build(LATENT_SPLIT, "mla_latent_split_decode", tuple(defines), device)

    kernel = build(reg_t)
    try:
        build(not reg_t)
    except nvrtc.BuildError:
        pass
    return kernel


def _decode_latent_split(q_latent, q_pe, codes, block_table, seq_lens, scale, sm_scale: float,
                         num_splits: int | None, reg_t: bool | None,
                         layout: tuple = NVFP4) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, _ = q_latent.shape
    device = q_latent.device
    page = codes.shape[1]
    head_blocks = -(-heads // HEADS_PER_BLOCK)
    max_tokens = block_table.shape[1] * page
    ctas = FP8_CTAS if _fp8_codes(layout) else SPLIT_CTAS
    if num_splits is None:
        num_splits, tokens_per_split = latent_split_plan(max_tokens, batch * head_blocks, _sms(device.index), ctas)
    else:
        num_splits, tokens_per_split = plan_splits(max_tokens, batch * head_blocks, TOKENS, ctas, device,
                                                   num_splits, whole_waves=True)
    if reg_t is None:
        reg_t = FP8_REG_T if _fp8_codes(layout) else batch * head_blocks * num_splits <= REG_T_CTAS * _sms(device.index)
    kernel = _latent_split_kernel(page, q_latent.dtype == torch.bfloat16, scale is not None, reg_t, device.index,
                                  layout)
    out = torch.empty(batch, heads, LATENT, dtype=q_latent.dtype, device=device)
    part_out, part_lse = partials(out, num_splits)
    record = codes.view(torch.uint8)
    kernel((head_blocks, batch, num_splits), (32 * 4, 1, 1), _split_smem(reg_t, layout),
           [q_latent, q_pe, record, block_table, seq_lens, scale if scale is not None else seq_lens, part_out,
            part_lse, sm_scale * LOG2E, tokens_per_split, heads, q_latent.stride(0), q_latent.stride(1),
            q_pe.stride(0), q_pe.stride(1), record.stride(0), block_table.stride(0), part_out.stride(0),
            part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1)])
    return out, merge_splits(part_out, part_lse, out)
