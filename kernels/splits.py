"""The launch plumbing every decode kernel shares (Triton and CUDA): the device guard, the split-KV plan, the
partials' buffers and the merge of the splits (with attention sinks). Split out of kernels/decode_attention.py so the
CUDA launchers (kernels/gqa_decode_cuda.py) and the Triton launchers import it without importing each other."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.launches import launching

LOG2E = 1.4426950408889634      # log2(e): scores kept in base 2 for exp2
MIN_TOKENS_PER_SPLIT = 256      # below this a split's fixed cost (q load, partial store, merge) dominates
# MLA's splits where MIN_TOKENS_PER_SPLIT leaves SMs without a program (the MLA launchers: one sequence's 16
# heads are one program, 64 on the warpgroup kernel). On an H200 (kernels/BENCHMARKS.md, session 48, the whole call
# against 256 in one process): 16 heads at 1k-8k, batch 1-16, FP8 (CUDA entry) 1.11-1.31x faster, BF16 1.17-1.29x,
# the block-scaled tile kernel 1.19-1.42x; 128 heads, batch 1, 2k-8k, 1.11-1.33x. Past one program an SM it lost
# (batch 4 at 8k, FP8: 64 splits 0.0257 ms against 32's 0.0237), so the shorter splits stop there.
MLA_IDLE_MIN_TOKENS = 128
MERGE_TILE = 4096               # fp32 values a merge program loads at once (`merge_tile`)


def on_tensor_device(launcher):
    """Run `launcher` with its first tensor argument's CUDA device current: Triton launches on the current
    device's stream, so a kernel given cuda:1 tensors while cuda:0 is current would run on the wrong GPU
    (issue 30). CPU tensors are passed through (the launchers refuse them with a clear message)."""
    @functools.wraps(launcher)
    def guarded(*args, **kwargs):
        tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if tensor is None or tensor.device.type != "cuda":
            return launcher(*args, **kwargs)
        launching(tensor.device)
        with torch.cuda.device(tensor.device):
            return launcher(*args, **kwargs)
    guarded.on_tensor_device = True
    return guarded


def interpreting() -> bool:
    """Under Triton's CPU interpreter (TRITON_INTERPRET=1): CPU tensors, no inline assembly."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _decode_attention_merge_kernel(
    PART_OUT, PART_LSE,      # [B, H, splits, D] fp32, [B, H, splits] fp32 (base 2, split stride 1)
    OUT, LSE,                # [B, H, D] q.dtype, [B, H] fp32 (natural log)
    SINKS,                   # [H] fp32 natural-log sink logits (read when HAS_SINKS)
    num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh, stride_eb,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr = False,
):
    # program (head, b, chunk): BLOCK_D columns of one row, the splits read BLOCK_S at a time as one tile (the loads
    # of a chunk's splits in flight together, not one split after another)
    head = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse_row = PART_LSE + b * stride_lb + head * stride_lh
    m = float("-inf")
    for s0 in range(0, num_splits, BLOCK_S):
        m = tl.maximum(m, tl.max(tl.load(lse_row + s0 + offs_s, mask=s0 + offs_s < num_splits,
                                         other=float("-inf")), axis=0))
    if HAS_SINKS:  # the sink: a term of the denominator with no value (base 2, as the splits' lse)
        sink = tl.load(SINKS + head) * 1.4426950408889634                                   # log2(e)
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)                  # every split empty: weights 0, lse -inf
    denom = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    out_row = PART_OUT + b * stride_pb + head * stride_ph + offs_d[None, :]
    for s0 in range(0, num_splits, BLOCK_S):
        s_mask = s0 + offs_s < num_splits
        weight = tl.math.exp2(tl.load(lse_row + s0 + offs_s, mask=s_mask, other=float("-inf")) - m)
        denom += tl.sum(weight, axis=0)
        part = tl.load(out_row + (s0 + offs_s)[:, None] * stride_ps, mask=s_mask[:, None] & d_mask[None, :],
                       other=0.0)
        acc += tl.sum(weight[:, None] * part, axis=0)
    if HAS_SINKS:
        denom += tl.math.exp2(sink - m)
    out = tl.where(denom == 0.0, 0.0, acc / denom)           # NaN stays NaN (NaN == 0 is false)
    tl.store(OUT + b * stride_ob + head * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=d_mask)
    if tl.program_id(2) == 0:
        tl.store(LSE + b * stride_eb + head, (m + tl.math.log2(denom)) * 0.6931471805599453)   # ln 2


def plan_splits(max_tokens: int, programs_per_split: int, block_n: int, programs_per_sm: int,
                device: torch.device, num_splits: int | None, whole_waves: bool = False,
                idle_min_tokens: int | None = None) -> tuple[int, int]:
    """(splits, tokens per split) of a split-KV launch over `max_tokens` cache slots. num_splits=None asks
    for ~programs_per_sm programs per SM with no split under MIN_TOKENS_PER_SPLIT, or under idle_min_tokens
    while the grid has at most one program an SM (MLA_IDLE_MIN_TOKENS); a split is a whole
    number of block_n tiles, and splits that no sequence reaches are dropped. whole_waves (MLA): at most
    programs_per_sm programs per SM (rounded down), so a grid never spills a few programs into a second wave
    (session 7: 17 splits x 8 sequences = 136 programs on 132 SMs at one resident program per SM)."""
    if num_splits is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        slots = programs_per_sm * sms
        wanted = max(1, slots // programs_per_split) if whole_waves else triton.cdiv(slots, programs_per_split)
        splits = triton.cdiv(max_tokens, MIN_TOKENS_PER_SPLIT)
        if idle_min_tokens is not None:
            splits = max(splits, min(triton.cdiv(max_tokens, idle_min_tokens), sms // programs_per_split))
        num_splits = max(1, min(wanted, splits))
    tokens_per_split = triton.cdiv(triton.cdiv(max(max_tokens, 1), num_splits), block_n) * block_n
    return triton.cdiv(max(max_tokens, 1), tokens_per_split), tokens_per_split


def partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernels' fp32 outputs for `out` [B, H, D]: normalised partials [B, H, splits, D] and
    their base-2 lse [B, H, splits]."""
    batch, heads, dim = out.shape
    return (torch.empty(batch, heads, num_splits, dim, dtype=torch.float32, device=out.device),
            torch.empty(batch, heads, num_splits, dtype=torch.float32, device=out.device))


@on_tensor_device
def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Combine the splits into `out` (written in place), with each head's sink logit (fp32 [H], natural log) in
    the denominator where given; returns the natural-log lse [B, H] fp32."""
    batch, heads, num_splits, dim = part_out.shape
    assert sinks is None or (sinks.dtype == torch.float32 and sinks.shape == (heads,) and sinks.is_contiguous()
                             and sinks.device == out.device), \
        f"sinks must be a contiguous fp32 [{heads}] tensor on {out.device}, got {sinks!r:.80}"
    lse = torch.empty(batch, heads, dtype=torch.float32, device=out.device)
    block_s, block_d = merge_tile(num_splits, dim)
    _decode_attention_merge_kernel[(heads, batch, triton.cdiv(dim, block_d))](
        part_out, part_lse, out, lse, sinks if sinks is not None else lse, num_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_S=block_s, HAS_SINKS=sinks is not None, num_warps=4,
    )
    return lse


def merge_tile(num_splits: int, dim: int) -> tuple[int, int]:
    """(splits, columns) of a merge program's tile: up to MERGE_TILE values (32 a thread of 4 warps), the splits
    first (up to 256 at a time), the columns what is left (at least 16). One program a row read its splits one
    after another before: on an H200 a batch-1 128k MLA call of 132 splits took 0.0661 ms with that merge and 0.0538
    with these tiles, batch 8 at 32k (49 splits) 0.0739 and 0.0709 (kernels/BENCHMARKS.md, session 45)."""
    block_s = min(triton.next_power_of_2(max(num_splits, 1)), 256)
    return block_s, max(16, min(triton.next_power_of_2(dim), MERGE_TILE // block_s))
