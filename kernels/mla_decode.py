"""MLA decode attention (absorbed projections) over a paged FP8 (or BF16) latent cache, split-KV.

Cache row j = [c_j (latent_dim, e.g. 512) | k_pe_j (rope_dim, e.g. 64)], one scale per cache (as engines
do). With W_UK absorbed into q (q_latent = q_nope @ W_UK) and W_UV applied after (by the caller):
    s_j = sm_scale * scale * (q_latent . c_codes_j + q_pe . pe_codes_j)   (scale folded: exact)
    out = scale * sum_j softmax(s)_j c_codes_j                           (latent space, [H, latent_dim])
    lse = log sum_j exp(s_j)
A program handles BLOCK_H heads of one sequence over one split, so each cache tile read feeds BLOCK_H
heads; the splits are combined by the GQA kernel's merge (same partial layout and formula; the CUDA kernel's entry
by its own merge kernel, cuda_merge). Two kernels:
- `_mla_decode_kernel` (session 4): every tile read by masked pointer loads (cp.async or register prefetch).
- `_mla_decode_tc_kernel`, the tile kernel (`tma`, session 5; power-of-two Dc and Dr): a split's whole tiles
  come by TMA (one bulk copy per tile where page_size % block_n == 0, else unmasked pointer loads), its last
  partial tile by masked loads, so slots past seq_len (stale or NaN) are never read into the sums.
An FP8 cache is multiplied in fp16 (codes exact in fp16; q rounded to fp16, exact for bf16 q below
65504), P rounded to fp16 for P @ c, fp32 accumulation; a BF16/FP16 cache runs in its dtype and never
reads the scale. The fp8_mma option (tile kernel, e4m3 caches) instead quantises Q per head and P (x 2^8)
to e4m3 and runs both products on fp8 tensor cores: extra error, measured in kernels/BENCHMARKS.md.
Torch mirror: `reference.mla_decode`.

FP8 attention options (engines' q_scale / prob_scale; the GQA kernel's definition, kernels/decode_attention.py),
always in e4m3, in the tile kernel: Q = [q_latent | q_pe] becomes q8 = e4m3(q / q_scale) (IEEE division, RTNE,
saturating) with q_scale given (fp32 [] or [H]) or "dynamic" (per head: amax over both parts / 448); P is the
tile-relative unnormalised p_j = 2^(s_j - m_t) in (0, 1] rounded as p8_j = e4m3(p_j * fp32(1 / prob_scale)),
the denominator sums the unquantised p and prob_scale multiplies the output back. The e4m3 operands are widened
to the compute dtype (fp16, or bf16 over a bf16 cache: exact) so the products are exact; the fp64 emulation
of exactly this (tiles and splits included) is `reference.mla_decode_fp8`.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.decode_attention import (LOG2E, _check_attention_scales, _decode_attention_pages, _widen, merge_splits,
                                     on_tensor_device, partials, plan_splits)
from kernels import mla_block_scaled_cuda, nvrtc
from kernels.configs import launch_config
from kernels.splits import MLA_IDLE_MIN_TOKENS
from kernels.reference import FP8_MAX, is_fp8

# Launch configurations (kernel, tile, warps, pipeline depth, heads per program, tokens-as-M "swap", programs per
# SM) per GPU: kernels/configs.py, swept by kernels/tune_mla.py. Triton 3.6 double-buffers the latent tile only
# from num_stages 4-5 (one stage goes to the page-index load its address depends on): kernels/BENCHMARKS.md.


@triton.jit
def _mla_decode_load_tile(CACHE, page, tok, t_mask, offs_c, offs_r, c_mask, r_mask, stride_cb, stride_cs,
                          LATENT_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Latent and RoPE parts of the cache rows of tokens `tok` ([BLOCK_N]) on pages `page`."""
    rows = CACHE + page * stride_cb + (tok % PAGE_SIZE) * stride_cs                       # [BLOCK_N] pointers
    c = tl.load(rows[:, None] + offs_c[None, :], mask=t_mask[:, None] & c_mask[None, :], other=0.0)
    pe = tl.load(rows[:, None] + LATENT_DIM + offs_r[None, :], mask=t_mask[:, None] & r_mask[None, :], other=0.0)
    return c, pe                                                                          # [BLOCK_N, BLOCK_DC], [BLOCK_N, BLOCK_DR]


@triton.jit
def _mla_decode_kernel(
    Q_LATENT, Q_PE,          # [B, H, Dc], [B, H, Dr] bf16/fp16
    CACHE,                   # [num_blocks, block_size, Dc + Dr] fp8 / bf16 / fp16
    BLOCK_TABLE, SEQ_LENS,   # [B, max_blocks] int32, [B] int32
    SCALE,                   # fp32 [] (unread for a bf16/fp16 cache)
    PART_OUT, PART_LSE,      # [B, H, splits, Dc] fp32, [B, H, splits] fp32 base-2 lse
    sm_scale_log2, tokens_per_split, num_heads,
    stride_lb, stride_lh, stride_pb, stride_ph, stride_cb, stride_cs, stride_tb,
    stride_ob, stride_oh, stride_os, stride_eb, stride_eh,
    LATENT_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CACHE_IS_FP8: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, PREFETCH: tl.constexpr, SWAP: tl.constexpr,
):
    head_block = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    offs_c = tl.arange(0, BLOCK_DC)
    offs_r = tl.arange(0, BLOCK_DR)
    offs_n = tl.arange(0, BLOCK_N)
    c_mask = offs_c < LATENT_DIM
    r_mask = offs_r < ROPE_DIM
    q_c = tl.load(Q_LATENT + b * stride_lb + heads[:, None] * stride_lh + offs_c[None, :],
                  mask=h_mask[:, None] & c_mask[None, :], other=0.0).to(COMPUTE_DTYPE)   # [BLOCK_H, BLOCK_DC]
    q_r = tl.load(Q_PE + b * stride_pb + heads[:, None] * stride_ph + offs_r[None, :],
                  mask=h_mask[:, None] & r_mask[None, :], other=0.0).to(COMPUTE_DTYPE)   # [BLOCK_H, BLOCK_DR]
    qk_scale = sm_scale_log2
    out_scale = 1.0
    if CACHE_IS_FP8:
        out_scale = tl.load(SCALE)
        qk_scale = sm_scale_log2 * out_scale

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if SWAP:
        q_c = tl.trans(q_c)                                                                # [BLOCK_DC, BLOCK_H]
        q_r = tl.trans(q_r)
        acc = tl.zeros([BLOCK_DC, BLOCK_H], tl.float32)                                    # out transposed
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_DC], tl.float32)
    table_row = BLOCK_TABLE + b * stride_tb
    if PREFETCH:   # as in decode_attention: tile i computes while tile i+1 and tile i+2's pages load
        t_mask = start + offs_n < end
        c, pe = _mla_decode_load_tile(CACHE, _decode_attention_pages(table_row, start + offs_n, t_mask, PAGE_SIZE),
                                      start + offs_n, t_mask, offs_c, offs_r, c_mask, r_mask, stride_cb, stride_cs,
                                      LATENT_DIM, PAGE_SIZE)
        next_mask = start + BLOCK_N + offs_n < end
        next_page = _decode_attention_pages(table_row, start + BLOCK_N + offs_n, next_mask, PAGE_SIZE)
    for n0 in range(start, end, BLOCK_N):
        if PREFETCH:
            after_mask = n0 + 2 * BLOCK_N + offs_n < end
            after_page = _decode_attention_pages(table_row, n0 + 2 * BLOCK_N + offs_n, after_mask, PAGE_SIZE)
            c_next, pe_next = _mla_decode_load_tile(CACHE, next_page, n0 + BLOCK_N + offs_n, next_mask, offs_c, offs_r,
                                                    c_mask, r_mask, stride_cb, stride_cs, LATENT_DIM, PAGE_SIZE)
        else:
            t_mask = n0 + offs_n < end
            c, pe = _mla_decode_load_tile(CACHE, _decode_attention_pages(table_row, n0 + offs_n, t_mask, PAGE_SIZE),
                                          n0 + offs_n, t_mask, offs_c, offs_r, c_mask, r_mask, stride_cb, stride_cs,
                                          LATENT_DIM, PAGE_SIZE)
        c16 = c.to(COMPUTE_DTYPE)                                                          # [BLOCK_N, BLOCK_DC]
        if SWAP:
            # Tokens as the MMA's M dimension, heads as N: S^T = C Q^T, O^T += C^T P^T (the accumulator
            # is [latent, heads], so the latent dimension fills M of the second product).
            s = tl.dot(pe.to(COMPUTE_DTYPE), q_r, acc=tl.dot(c16, q_c)) * qk_scale        # [BLOCK_N, BLOCK_H]
            s = tl.where(t_mask[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha[None, :] + tl.dot(tl.trans(c16), p.to(COMPUTE_DTYPE))
        else:
            s = tl.dot(q_r, tl.trans(pe.to(COMPUTE_DTYPE)), acc=tl.dot(q_c, tl.trans(c16))) * qk_scale   # [BLOCK_H, BLOCK_N]
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), c16)
        m_i = m_new
        if PREFETCH:
            c, pe, t_mask = c_next, pe_next, next_mask
            next_page, next_mask = after_page, after_mask

    if SWAP:
        acc = tl.trans(acc)                                                                # [BLOCK_H, BLOCK_DC]
    empty = l_i == 0.0
    out = acc * (out_scale / tl.where(empty, 1.0, l_i))[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_i))
    out_rows = PART_OUT + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_c[None, :]
    tl.store(out_rows, out, mask=h_mask[:, None] & c_mask[None, :])
    tl.store(PART_LSE + b * stride_eb + heads * stride_eh + split, lse2, mask=h_mask)


# ---------------------------------------------------------------------------------------------------
# The tensor-core kernel (session 5): TMA tiles, full tiles unmasked, optional fp8 MMAs.
# ---------------------------------------------------------------------------------------------------

P_SCALE = 256.0   # fp8_mma: P in [0, 1] is stored as fp8(P * 2^8) (a power of two: undone exactly at the end)


@triton.jit
def _mla_tc_step(c, pe, t_mask, q_c, q_r, row_scale, m_i, l_i, acc, p_inv, MASKED: tl.constexpr, SWAP: tl.constexpr,
                 FP8_MMA: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, P_SCALE: tl.constexpr, P_FP8: tl.constexpr,
                 FP8_MAX: tl.constexpr, CONVERT: tl.constexpr = 0):
    """One tile of the online softmax: (m_i, l_i, acc) updated with the cache rows c [BLOCK_N, Dc], pe [BLOCK_N, Dr].
    FP8_MMA: c, pe stay fp8 codes and q_c / q_r are fp8 (row_scale holds their per-head scales); P goes to fp8.
    P_FP8: P rounded to e4m3 as e4m3(p * p_inv) (RTNE, saturating at FP8_MAX), widened to COMPUTE_DTYPE (exact)."""
    if FP8_MMA:
        c_op = c
        pe_op = pe
    else:
        c_op = _widen(c, COMPUTE_DTYPE, CONVERT)
        pe_op = _widen(pe, COMPUTE_DTYPE, CONVERT)
    if SWAP:   # tokens as M: S^T = C Q^T [BLOCK_N, BLOCK_H]; O^T += C^T P^T [Dc, BLOCK_H]
        s = tl.dot(pe_op, q_r, acc=tl.dot(c_op, q_c)) * row_scale[None, :]
        if MASKED:
            s = tl.where(t_mask[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        if FP8_MMA:   # the rescaled accumulator as the dot's input (Triton does not fuse the add for fp8)
            acc = tl.dot(tl.trans(c_op), (p * P_SCALE).to(c.dtype, fp_downcast_rounding="rtne"), acc=acc * alpha[None, :])
        else:
            p_op = p.to(COMPUTE_DTYPE)
            if P_FP8:
                p_op = tl.minimum(p * p_inv, FP8_MAX).to(tl.float8e4nv, fp_downcast_rounding="rtne").to(COMPUTE_DTYPE)
            acc = acc * alpha[None, :] + tl.dot(tl.trans(c_op), p_op)
    else:      # heads as M: S = Q C^T [BLOCK_H, BLOCK_N]; O += P C [BLOCK_H, Dc]
        s = tl.dot(q_r, tl.trans(pe_op), acc=tl.dot(q_c, tl.trans(c_op))) * row_scale[:, None]
        if MASKED:
            s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP8_MMA:
            acc = tl.dot((p * P_SCALE).to(c.dtype, fp_downcast_rounding="rtne"), c_op, acc=acc * alpha[:, None])
        else:
            p_op = p.to(COMPUTE_DTYPE)
            if P_FP8:
                p_op = tl.minimum(p * p_inv, FP8_MAX).to(tl.float8e4nv, fp_downcast_rounding="rtne").to(COMPUTE_DTYPE)
            acc = acc * alpha[:, None] + tl.dot(p_op, c_op)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_eb", "stride_eh"])   # they follow the split count: one compile for all
def _mla_decode_tc_kernel(
    Q_LATENT, Q_PE, CACHE, C_DESC, PE_DESC, BLOCK_TABLE, SEQ_LENS, SCALE, Q_SCALE, PROB_SCALE, PART_OUT, PART_LSE,
    sm_scale_log2, tokens_per_split, num_heads, q_scale_stride,
    stride_lb, stride_lh, stride_pb, stride_ph, stride_cb, stride_cs, stride_tb,
    stride_ob, stride_oh, stride_os, stride_eb, stride_eh,
    LATENT_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_H: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, CACHE_IS_FP8: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, SWAP: tl.constexpr,
    TMA: tl.constexpr, FP8_MMA: tl.constexpr, FP8_MAX: tl.constexpr, P_SCALE: tl.constexpr,
    Q_QUANT: tl.constexpr, P_FP8: tl.constexpr, CONVERT: tl.constexpr = 0,
):
    """As _mla_decode_kernel (same partial layout), for power-of-two Dc and Dr. The split's whole tiles are
    read unmasked (TMA: one bulk copy per tile through C_DESC / PE_DESC, pipelined by Triton over num_stages;
    a tile never crosses a page since PAGE_SIZE % BLOCK_N == 0); its last partial tile is read masked."""
    head_block = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b)
    start = split * tokens_per_split
    n_tokens = tl.maximum(tl.minimum(start + tokens_per_split, seq_len) - start, 0)
    full_end = start + (n_tokens // BLOCK_N) * BLOCK_N

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    offs_c = tl.arange(0, LATENT_DIM)
    offs_r = tl.arange(0, ROPE_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q_c = tl.load(Q_LATENT + b * stride_lb + heads[:, None] * stride_lh + offs_c[None, :],
                  mask=h_mask[:, None], other=0.0)                                       # [BLOCK_H, Dc]
    q_r = tl.load(Q_PE + b * stride_pb + heads[:, None] * stride_ph + offs_r[None, :],
                  mask=h_mask[:, None], other=0.0)                                       # [BLOCK_H, Dr]
    row_scale = tl.full([BLOCK_H], sm_scale_log2, tl.float32)
    out_scale = 1.0
    if CACHE_IS_FP8:
        out_scale = tl.load(SCALE)
        row_scale = row_scale * out_scale
    if FP8_MMA:   # Q per head into the cache's fp8 format: q = q_s * fp8(q / q_s), q_s = amax / fp8 max
        q_amax = tl.maximum(tl.max(tl.abs(q_c.to(tl.float32)), axis=1), tl.max(tl.abs(q_r.to(tl.float32)), axis=1))
        q_s = tl.where(q_amax > 0, tl.math.div_rn(q_amax, tl.full([BLOCK_H], FP8_MAX, tl.float32)), 1.0)
        q_c = tl.math.div_rn(q_c.to(tl.float32), q_s[:, None]).to(CACHE.dtype.element_ty, fp_downcast_rounding="rtne")
        q_r = tl.math.div_rn(q_r.to(tl.float32), q_s[:, None]).to(CACHE.dtype.element_ty, fp_downcast_rounding="rtne")
        row_scale = row_scale * q_s
    elif Q_QUANT != 0:   # q_scale: Q in e4m3 under its scale (1 dynamic per head, 2 given), widened (exact)
        qf_c = q_c.to(tl.float32)
        qf_r = q_r.to(tl.float32)
        if Q_QUANT == 1:
            q_amax = tl.maximum(tl.max(tl.abs(qf_c), axis=1), tl.max(tl.abs(qf_r), axis=1))
            q_s = tl.where(q_amax > 0, tl.math.div_rn(q_amax, tl.full([BLOCK_H], FP8_MAX, tl.float32)), 1.0)
        else:
            q_s = tl.load(Q_SCALE + heads * q_scale_stride, mask=h_mask, other=1.0)
        q_c = tl.clamp(tl.math.div_rn(qf_c, q_s[:, None]), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        q_r = tl.clamp(tl.math.div_rn(qf_r, q_s[:, None]), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        q_c = q_c.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(COMPUTE_DTYPE)
        q_r = q_r.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(COMPUTE_DTYPE)
        row_scale = row_scale * q_s
    else:
        q_c = q_c.to(COMPUTE_DTYPE)
        q_r = q_r.to(COMPUTE_DTYPE)
    p_inv = 1.0
    if P_FP8:
        prob_scale = tl.load(PROB_SCALE)
        p_inv = tl.math.div_rn(1.0, prob_scale)                    # r = fp32(1 / prob_scale), IEEE
        out_scale = out_scale * prob_scale

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    if SWAP:
        q_c = tl.trans(q_c)                                                              # [Dc, BLOCK_H]
        q_r = tl.trans(q_r)
        acc = tl.zeros([LATENT_DIM, BLOCK_H], tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, LATENT_DIM], tl.float32)
    table_row = BLOCK_TABLE + b * stride_tb
    all_tokens = offs_n >= 0
    for n0 in range(start, full_end, BLOCK_N):
        if TMA:
            row = tl.load(table_row + n0 // PAGE_SIZE) * PAGE_SIZE + n0 % PAGE_SIZE
            c = C_DESC.load([row, 0])
            pe = PE_DESC.load([row, LATENT_DIM])
        else:
            tok = n0 + offs_n
            pages = _decode_attention_pages(table_row, tok, all_tokens, PAGE_SIZE)
            rows = CACHE + pages * stride_cb + (tok % PAGE_SIZE) * stride_cs
            c = tl.load(rows[:, None] + offs_c[None, :])
            pe = tl.load(rows[:, None] + LATENT_DIM + offs_r[None, :])
        m_i, l_i, acc = _mla_tc_step(c, pe, all_tokens, q_c, q_r, row_scale, m_i, l_i, acc, p_inv, False, SWAP,
                                     FP8_MMA, COMPUTE_DTYPE, P_SCALE, P_FP8, FP8_MAX, CONVERT)
    for n0 in range(full_end, start + n_tokens, BLOCK_N):   # the split's last, partial tile (a loop of at
        tok = n0 + offs_n                                     # most one trip, so Triton pipelines its copies)
        t_mask = tok < start + n_tokens
        c, pe = _mla_decode_load_tile(CACHE, _decode_attention_pages(table_row, tok, t_mask, PAGE_SIZE), tok, t_mask,
                                      offs_c, offs_r, offs_c < LATENT_DIM, offs_r < ROPE_DIM, stride_cb, stride_cs,
                                      LATENT_DIM, PAGE_SIZE)
        m_i, l_i, acc = _mla_tc_step(c, pe, t_mask, q_c, q_r, row_scale, m_i, l_i, acc, p_inv, True, SWAP,
                                     FP8_MMA, COMPUTE_DTYPE, P_SCALE, P_FP8, FP8_MAX, CONVERT)

    if SWAP:
        acc = tl.trans(acc)                                                              # [BLOCK_H, Dc]
    empty = l_i == 0.0
    if FP8_MMA:
        out_scale = out_scale / P_SCALE
    out = acc * (out_scale / tl.where(empty, 1.0, l_i))[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_i))
    tl.store(PART_OUT + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_c[None, :], out,
             mask=h_mask[:, None])
    tl.store(PART_LSE + b * stride_eb + heads * stride_eh + split, lse2, mask=h_mask)


# ---------------------------------------------------------------------------------------------------
# The split-latent tile kernel (session 7): the latent dimension in 4 chunks, so Q.C^T is 4 independent MMA
# chains (plus RoPE) instead of one chain over all 576 columns, and P.C 4 independent accumulators.
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _mla_split_tile(C_DESC, PE_DESC, CACHE, table_row, n0, offs_n, offs_k, offs_r, end, stride_cb, stride_cs,
                    LATENT_DIM: tl.constexpr, CHUNK: tl.constexpr, PAGE_SIZE: tl.constexpr, TMA: tl.constexpr,
                    MASKED: tl.constexpr):
    """The 4 latent chunks [BLOCK_N, CHUNK] and the RoPE part [BLOCK_N, Dr] of the tile at token n0 (one TMA
    copy each where TMA; masked pointer loads of tokens < end where MASKED, so no slot past it is read)."""
    if TMA:
        row = tl.load(table_row + n0 // PAGE_SIZE) * PAGE_SIZE + n0 % PAGE_SIZE
        c0 = C_DESC.load([row, 0])
        c1 = C_DESC.load([row, CHUNK])
        c2 = C_DESC.load([row, 2 * CHUNK])
        c3 = C_DESC.load([row, 3 * CHUNK])
        pe = PE_DESC.load([row, LATENT_DIM])
    else:
        tok = n0 + offs_n
        t_mask = tok < end
        pages = _decode_attention_pages(table_row, tok, t_mask, PAGE_SIZE)
        rows = (CACHE + pages * stride_cb + (tok % PAGE_SIZE) * stride_cs)[:, None]
        if MASKED:
            m = t_mask[:, None]
            c0 = tl.load(rows + offs_k[None, :], mask=m, other=0.0)
            c1 = tl.load(rows + CHUNK + offs_k[None, :], mask=m, other=0.0)
            c2 = tl.load(rows + 2 * CHUNK + offs_k[None, :], mask=m, other=0.0)
            c3 = tl.load(rows + 3 * CHUNK + offs_k[None, :], mask=m, other=0.0)
            pe = tl.load(rows + LATENT_DIM + offs_r[None, :], mask=m, other=0.0)
        else:
            c0 = tl.load(rows + offs_k[None, :])
            c1 = tl.load(rows + CHUNK + offs_k[None, :])
            c2 = tl.load(rows + 2 * CHUNK + offs_k[None, :])
            c3 = tl.load(rows + 3 * CHUNK + offs_k[None, :])
            pe = tl.load(rows + LATENT_DIM + offs_r[None, :])
    return c0, c1, c2, c3, pe


@triton.jit
def _mla_split_step(c0, c1, c2, c3, pe, t_mask, q0, q1, q2, q3, q_r, row_scale, m_i, l_i, acc0, acc1, acc2, acc3,
                    MASKED: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, WIDEN: tl.constexpr):
    """One tile of the online softmax over the chunked latent (heads as M). The partial score products use
    max_num_imprecise_acc=1, which fp16/bf16 MMAs ignore, only so that Triton does not fold their sum back into
    one accumulator chain (its dot(a, b, 0) + c -> dot(a, b, c) rewrite applies to max_num_imprecise_acc 0)."""
    c0 = _widen(c0, COMPUTE_DTYPE, WIDEN)
    c1 = _widen(c1, COMPUTE_DTYPE, WIDEN)
    c2 = _widen(c2, COMPUTE_DTYPE, WIDEN)
    c3 = _widen(c3, COMPUTE_DTYPE, WIDEN)
    pe = _widen(pe, COMPUTE_DTYPE, WIDEN)
    s01 = tl.dot(q0, tl.trans(c0), max_num_imprecise_acc=1) + tl.dot(q1, tl.trans(c1), max_num_imprecise_acc=1)
    s23 = tl.dot(q2, tl.trans(c2), max_num_imprecise_acc=1) + tl.dot(q3, tl.trans(c3), max_num_imprecise_acc=1)
    s = (s01 + s23 + tl.dot(q_r, tl.trans(pe), max_num_imprecise_acc=1)) * row_scale[:, None]   # [BLOCK_H, BLOCK_N]
    if MASKED:
        s = tl.where(t_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p_op = p.to(COMPUTE_DTYPE)
    acc0 = acc0 * alpha[:, None] + tl.dot(p_op, c0)
    acc1 = acc1 * alpha[:, None] + tl.dot(p_op, c1)
    acc2 = acc2 * alpha[:, None] + tl.dot(p_op, c2)
    acc3 = acc3 * alpha[:, None] + tl.dot(p_op, c3)
    return m_new, l_i, acc0, acc1, acc2, acc3


@triton.jit(do_not_specialize=["stride_eb", "stride_eh"])
def _mla_decode_split_kernel(
    Q_LATENT, Q_PE, CACHE, C_DESC, PE_DESC, BLOCK_TABLE, SEQ_LENS, SCALE, PART_OUT, PART_LSE,
    sm_scale_log2, tokens_per_split, num_heads,
    stride_lb, stride_lh, stride_pb, stride_ph, stride_cb, stride_cs, stride_tb,
    stride_ob, stride_oh, stride_os, stride_eb, stride_eh,
    LATENT_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_H: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, CACHE_IS_FP8: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, TMA: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """As _mla_decode_tc_kernel without its options (no swap, fp8_mma, q_scale or prob_scale): same partial
    layout and formula, the latent dimension in 4 chunks of LATENT_DIM / 4 (C_DESC's block is [BLOCK_N, CHUNK])."""
    CHUNK: tl.constexpr = LATENT_DIM // 4
    head_block = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    n_tokens = tl.maximum(end - start, 0)
    full_end = start + (n_tokens // BLOCK_N) * BLOCK_N

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    offs_k = tl.arange(0, CHUNK)
    offs_r = tl.arange(0, ROPE_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q_rows = Q_LATENT + b * stride_lb + heads[:, None] * stride_lh + offs_k[None, :]
    q0 = tl.load(q_rows, mask=h_mask[:, None], other=0.0).to(COMPUTE_DTYPE)                # [BLOCK_H, CHUNK]
    q1 = tl.load(q_rows + CHUNK, mask=h_mask[:, None], other=0.0).to(COMPUTE_DTYPE)
    q2 = tl.load(q_rows + 2 * CHUNK, mask=h_mask[:, None], other=0.0).to(COMPUTE_DTYPE)
    q3 = tl.load(q_rows + 3 * CHUNK, mask=h_mask[:, None], other=0.0).to(COMPUTE_DTYPE)
    q_r = tl.load(Q_PE + b * stride_pb + heads[:, None] * stride_ph + offs_r[None, :],
                  mask=h_mask[:, None], other=0.0).to(COMPUTE_DTYPE)                        # [BLOCK_H, Dr]
    row_scale = tl.full([BLOCK_H], sm_scale_log2, tl.float32)
    out_scale = 1.0
    if CACHE_IS_FP8:
        out_scale = tl.load(SCALE)
        row_scale = row_scale * out_scale

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    acc1 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    acc2 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    acc3 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    table_row = BLOCK_TABLE + b * stride_tb
    all_tokens = offs_n >= 0
    for n0 in range(start, full_end, BLOCK_N):
        c0, c1, c2, c3, pe = _mla_split_tile(C_DESC, PE_DESC, CACHE, table_row, n0, offs_n, offs_k, offs_r, end,
                                             stride_cb, stride_cs, LATENT_DIM, CHUNK, PAGE_SIZE, TMA, False)
        m_i, l_i, acc0, acc1, acc2, acc3 = _mla_split_step(c0, c1, c2, c3, pe, all_tokens, q0, q1, q2, q3, q_r,
                                                           row_scale, m_i, l_i, acc0, acc1, acc2, acc3, False,
                                                           COMPUTE_DTYPE, WIDEN)
    for n0 in range(full_end, end, BLOCK_N):   # the split's last, partial tile (at most one trip)
        c0, c1, c2, c3, pe = _mla_split_tile(C_DESC, PE_DESC, CACHE, table_row, n0, offs_n, offs_k, offs_r, end,
                                             stride_cb, stride_cs, LATENT_DIM, CHUNK, PAGE_SIZE, False, True)
        m_i, l_i, acc0, acc1, acc2, acc3 = _mla_split_step(c0, c1, c2, c3, pe, n0 + offs_n < end, q0, q1, q2, q3,
                                                           q_r, row_scale, m_i, l_i, acc0, acc1, acc2, acc3, True,
                                                           COMPUTE_DTYPE, WIDEN)

    empty = l_i == 0.0
    norm = (out_scale / tl.where(empty, 1.0, l_i))[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_i))
    out_rows = PART_OUT + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_k[None, :]
    tl.store(out_rows, acc0 * norm, mask=h_mask[:, None])
    tl.store(out_rows + CHUNK, acc1 * norm, mask=h_mask[:, None])
    tl.store(out_rows + 2 * CHUNK, acc2 * norm, mask=h_mask[:, None])
    tl.store(out_rows + 3 * CHUNK, acc3 * norm, mask=h_mask[:, None])
    tl.store(PART_LSE + b * stride_eb + heads * stride_eh + split, lse2, mask=h_mask)


@on_tensor_device
def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: torch.Tensor | None, sm_scale: float, num_splits: int | None = None,
               *, block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
               prefetch: bool | None = None, swap: bool | None = None, programs_per_sm: int | None = None,
               block_h: int | None = None, tma: bool | None = None, fp8_mma: bool = False,
               q_scale: torch.Tensor | str | None = None, prob_scale: torch.Tensor | None = None,
               widen: bool | None = None, split_latent: bool | None = None,
               impl: str | None = None, ctas: int | None = None,
               bulk: bool | None = None, wgmma: bool | None = None,
               cuda_merge: bool | None = None, latent_split: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q_latent: [B, H, Dc] (q_nope @ W_UK), q_pe: [B, H, Dr], bf16/fp16; cache: [num_blocks, block_size,
    Dc + Dr] fp8 (e4m3/e5m2) or q dtype; block_table: [B, max_blocks] int32; seq_lens: [B] int32;
    scale: fp32 [] (ignored for a bf16/fp16 cache). Returns (out [B, H, Dc] q dtype, lse [B, H] fp32).
    fp8_mma (an option, e4m3 cache only; extra error, measured in kernels/BENCHMARKS.md): Q is quantised per
    head and P under the fixed scale 2^8 into e4m3, and both products run on fp8 tensor cores.
    FP8 attention (module docstring; always e4m3; any cache; the tile kernel only, so power-of-two Dc and Dr):
    q_scale = "dynamic" (per head, amax of [q_latent | q_pe] / 448) or an fp32 tensor [] or [H] quantises Q;
    prob_scale (fp32 []) quantises the tile-relative probabilities. Not with fp8_mma (its own fixed scales).
    The launch keywords override this GPU's entry in kernels/configs.py (tma: the tile kernel,
    _mla_decode_tc_kernel, with TMA copies where page_size % block_n == 0; needs power-of-two Dc and Dr;
    widen: the tile kernel over an fp8 cache widens each tile to fp16 once, by inline PTX, and both products
    read that fp16 tile, instead of the compiler's cast in each MMA operand layout: kernels/BENCHMARKS.md;
    split_latent: the tile kernel without options as _mla_decode_split_kernel, the latent in 4 chunks, so the
    score product is 4 independent MMA chains; taken only without swap, fp8_mma, q_scale and prob_scale;
    impl="cuda": the CUDA kernel kernels/mla_decode_fp8.cu over an fp8 cache with Dc 512 and Dr 64, without
    options (block_n = 8 x num_warps x its n8 blocks per warp; num_stages: tiles in flight; block_h 16, 32 or 64
    heads a block; ctas: blocks per SM its registers are budgeted for; bulk=False: cp.async instead of sm_90's
    bulk copies; wgmma=True: the warp-specialized warpgroup-MMA kernel kernels/mla_decode_fp8_ws.cu for many heads,
    sm_90 only, 64 heads and 64 tokens a block of 12 warps, num_stages tiles in flight; an entry's wgmma applies to
    explicit launch keywords too: wgmma=False picks the mma.sync kernel; cuda_merge: the mma.sync kernel's splits
    merged by the same file's mla_fp8_merge, as a programmatic dependent launch on sm_90, instead of by
    merge_splits); `cuda_refusal` says when it cannot run,
    and an entry's impl="cuda" then falls back to the Triton entry CUDA_FALLBACK, as it does (with a warning) where
    this machine cannot build it). latent_split (an fp8 cache, no options; not the Triton kernel's split_latent):
    kernels/mla_decode_latent_split.cu, the latent's columns split between 4 warps over 16 heads a block; an entry's
    latent_split applies to a call without launch keywords (they choose another kernel) whose batch x cache slots
    (block_table's pages x page size) are at most its latent_split_max_tokens (where it has one), where
    `mla_block_scaled_cuda.plain_fp8_refusal` says it can run, else the entry's other keys do; an explicit
    latent_split=True it cannot run fails."""
    assert q_latent.dim() == 3 and q_pe.dim() == 3 and q_pe.shape[:2] == q_latent.shape[:2], \
        f"q_latent/q_pe must be [B, H, Dc] and [B, H, Dr], got {list(q_latent.shape)}, {list(q_pe.shape)}"
    assert q_latent.dtype in (torch.bfloat16, torch.float16) and q_pe.dtype == q_latent.dtype, \
        f"q_latent/q_pe must be bf16 or fp16, got {q_latent.dtype}, {q_pe.dtype}"
    batch, heads, latent_dim = q_latent.shape
    rope_dim = q_pe.shape[2]
    assert cache.dim() == 3 and cache.shape[2] == latent_dim + rope_dim, \
        f"cache must be [num_blocks, block_size, {latent_dim + rope_dim}], got {list(cache.shape)}"
    assert is_fp8(cache.dtype) or cache.dtype == q_latent.dtype, f"cache must be fp8 or {q_latent.dtype}, got {cache.dtype}"
    assert 16 <= rope_dim and 16 <= latent_dim <= 1024, f"need 16 <= Dr and 16 <= Dc <= 1024, got {rope_dim}, {latent_dim}"
    assert cache.stride(-1) == 1 and q_latent.stride(-1) == 1 and q_pe.stride(-1) == 1, "last dims must be contiguous"
    assert block_table.dim() == 2 and block_table.shape[0] == batch and block_table.dtype == torch.int32, \
        f"block_table must be [{batch}, max_blocks] int32, got {list(block_table.shape)} {block_table.dtype}"
    assert seq_lens.shape == (batch,) and seq_lens.dtype == torch.int32, \
        f"seq_lens must be [{batch}] int32, got {list(seq_lens.shape)} {seq_lens.dtype}"
    fp8 = is_fp8(cache.dtype)
    if fp8:
        assert isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.shape == (), \
            f"scale must be an fp32 tensor of shape [], got {scale!r:.80}"
    device = q_latent.device
    q_quant = _check_attention_scales(q_scale, prob_scale, heads, device)
    fp8_attention = q_quant != 0 or prob_scale is not None
    assert not (fp8_mma and fp8_attention), \
        "give fp8_mma or q_scale / prob_scale, not both (fp8_mma quantises Q and P under its own scales)"
    pow2 = latent_dim & (latent_dim - 1) == 0 and rope_dim & (rope_dim - 1) == 0
    assert not fp8_attention or (pow2 and not prefetch and tma is not False), \
        (f"q_scale / prob_scale run in the tile kernel only (power-of-two Dc and Dr, no prefetch, tma not False); "
         f"got Dc={latent_dim}, Dr={rope_dim}, prefetch={prefetch}, tma={tma}")
    assert device.type == "cuda", f"Triton kernels need CUDA tensors, got {device}"
    assert not fp8_mma or cache.dtype == torch.float8_e4m3fn, \
        f"fp8_mma needs an e4m3 cache (Q and P are quantised to e4m3), got {cache.dtype}"
    assert not fp8_mma or rope_dim >= 32, f"fp8_mma needs Dr >= 32 (an fp8 MMA's K step), got {rope_dim}"
    kind = "mla_fp8_mma" if fp8_mma else "mla_fp8" if fp8 else "mla_bf16"
    entry = kind + ("_many_heads" if heads >= 64 else "")
    given = {key: value for key, value in (
        ("block_n", block_n), ("num_warps", num_warps), ("num_stages", num_stages), ("prefetch", prefetch),
        ("swap", swap), ("programs_per_sm", programs_per_sm), ("block_h", block_h), ("tma", tma), ("widen", widen),
        ("split_latent", split_latent), ("impl", impl), ("ctas", ctas), ("bulk", bulk), ("wgmma", wgmma),
        ("cuda_merge", cuda_merge), ("latent_split", latent_split))
        if value is not None}
    cfg = dict(launch_config(entry, device), **given)
    slots = batch * block_table.shape[1] * cache.shape[1]
    if latent_split or (cfg.get("latent_split") and not given   # an entry's: a call without launch keywords
                        and slots <= cfg.get("latent_split_max_tokens", slots)):
        refusal = "no fp8_mma, q_scale or prob_scale" if fp8_mma or fp8_attention else \
            mla_block_scaled_cuda.plain_fp8_refusal(q_latent, q_pe, cache)
        assert not latent_split or refusal is None, f"latent_split=True cannot run: {refusal}"
        if refusal is None:
            try:
                return mla_block_scaled_cuda.decode_plain_fp8(q_latent, q_pe, cache, block_table, seq_lens, scale,
                                                              sm_scale, num_splits)
            except nvrtc.BuildError as e:   # as impl="cuda" below: the entry's other keys run, an explicit one fails
                if latent_split:
                    raise
                _warn_cuda_fallback(str(e), "kernels/mla_decode_latent_split.cu", "the entry's other kernel")
    if cfg.get("impl") == "cuda":
        refusal = cuda_refusal(q_latent, q_pe, cache, fp8_mma or fp8_attention, cfg)
        assert impl is None or refusal is None, f"impl='cuda' cannot run: {refusal}"
        if refusal is None:
            try:
                return _mla_decode_cuda(q_latent, q_pe, cache, block_table, seq_lens, scale, sm_scale, num_splits,
                                        cfg)
            except nvrtc.BuildError as e:   # this machine's NVRTC or driver refused the kernel: the table's entry
                if impl is not None:       # falls back (once warned), an explicit impl="cuda" fails
                    raise
                _warn_cuda_fallback(str(e))
        cfg = dict(CUDA_FALLBACK.get(entry, launch_config(entry, device)), **given)   # the Triton entry
    if tma is None and (prefetch or not pow2):   # explicit register prefetch, or dims the tile kernel cannot
        cfg["tma"] = False                       # take: session 4's kernel, whatever the table says
    tile_kernel = cfg.get("tma", False) or fp8_mma or fp8_attention
    assert not tile_kernel or pow2, f"tma / fp8_mma need power-of-two Dc and Dr, got {latent_dim}, {rope_dim}"
    assert not (tile_kernel and prefetch), "tma / fp8_mma pipeline with num_stages; prefetch is refused with them"
    if tile_kernel:   # the table entry's register prefetch belongs to the other kernel
        cfg["prefetch"] = False
    if prefetch and swap is None:   # an explicit register prefetch means the plain layout (see the assert below)
        cfg["swap"] = False
    block_n, block_h = cfg["block_n"], cfg["block_h"]
    assert not (cfg["swap"] and cfg["prefetch"]), \
        "swap with prefetch is refused: it produced NaN on an H100 with Triton 3.6 (kernels/BENCHMARKS.md)"
    assert block_h >= 16 and block_h & (block_h - 1) == 0, f"block_h must be a power of two >= 16, got {block_h}"
    assert block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n must be a power of two >= 16, got {block_n}"
    assert num_splits is None or num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    assert all(t.device == device for t in (q_pe, cache, block_table, seq_lens, *([scale] if fp8 else []))), \
        "all tensors must be on one device"

    page_size = cache.shape[1]
    head_blocks = triton.cdiv(heads, block_h)
    num_splits, tokens_per_split = plan_splits(block_table.shape[1] * page_size, batch * head_blocks, block_n,
                                               cfg["programs_per_sm"], device, num_splits, whole_waves=True,
                                               idle_min_tokens=MLA_IDLE_MIN_TOKENS)
    out = torch.empty(batch, heads, latent_dim, dtype=q_latent.dtype, device=device)
    part_out, part_lse = partials(out, num_splits)
    compute = tl.float16 if fp8 or q_latent.dtype == torch.float16 else tl.bfloat16
    strides = (q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0),
               cache.stride(1), block_table.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
               part_lse.stride(0), part_lse.stride(1))
    q_scale_stride = q_scale.stride(0) if q_quant == 2 and q_scale.dim() == 1 else 0   # per head, or one scale
    widen_code = (1 if cache.dtype == torch.float8_e4m3fn else 2) if fp8 and not fp8_mma and cfg.get("widen") else 0
    if tile_kernel and cfg.get("split_latent") and latent_dim >= 64 and not (cfg["swap"] or fp8_mma or fp8_attention):
        use_tma = page_size % block_n == 0 and cache.is_contiguous() and cache.data_ptr() % 16 == 0
        c_desc = pe_desc = cache
        if use_tma:
            rows = cache.view(-1, latent_dim + rope_dim)
            c_desc = TensorDescriptor.from_tensor(rows, [block_n, latent_dim // 4])
            pe_desc = TensorDescriptor.from_tensor(rows, [block_n, rope_dim])
        _mla_decode_split_kernel[(head_blocks, batch, num_splits)](
            q_latent, q_pe, cache, c_desc, pe_desc, block_table, seq_lens, scale if fp8 else seq_lens, part_out,
            part_lse, sm_scale * LOG2E, tokens_per_split, heads, *strides,
            LATENT_DIM=latent_dim, ROPE_DIM=rope_dim, BLOCK_H=block_h, PAGE_SIZE=page_size, BLOCK_N=block_n,
            CACHE_IS_FP8=fp8, COMPUTE_DTYPE=compute, TMA=use_tma, WIDEN=widen_code,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return out, merge_splits(part_out, part_lse, out)
    if tile_kernel:
        use_tma = page_size % block_n == 0 and cache.is_contiguous() and cache.data_ptr() % 16 == 0
        c_desc = pe_desc = cache
        if use_tma:
            rows = cache.view(-1, latent_dim + rope_dim)
            c_desc = TensorDescriptor.from_tensor(rows, [block_n, latent_dim])
            pe_desc = TensorDescriptor.from_tensor(rows, [block_n, rope_dim])
        _mla_decode_tc_kernel[(head_blocks, batch, num_splits)](
            q_latent, q_pe, cache, c_desc, pe_desc, block_table, seq_lens, scale if fp8 else seq_lens,
            q_scale if q_quant == 2 else seq_lens, prob_scale if prob_scale is not None else seq_lens, part_out,
            part_lse, sm_scale * LOG2E, tokens_per_split, heads, q_scale_stride, *strides,
            LATENT_DIM=latent_dim, ROPE_DIM=rope_dim, BLOCK_H=block_h, PAGE_SIZE=page_size, BLOCK_N=block_n,
            CACHE_IS_FP8=fp8, COMPUTE_DTYPE=compute, SWAP=cfg["swap"], TMA=use_tma, FP8_MMA=fp8_mma,
            FP8_MAX=FP8_MAX["e4m3"], P_SCALE=P_SCALE, Q_QUANT=q_quant, P_FP8=prob_scale is not None,
            CONVERT=widen_code,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return out, merge_splits(part_out, part_lse, out)
    _mla_decode_kernel[(head_blocks, batch, num_splits)](
        q_latent, q_pe, cache, block_table, seq_lens, scale if fp8 else seq_lens, part_out, part_lse,
        sm_scale * LOG2E, tokens_per_split, heads, *strides,
        LATENT_DIM=latent_dim, ROPE_DIM=rope_dim, BLOCK_DC=triton.next_power_of_2(latent_dim),
        BLOCK_DR=triton.next_power_of_2(rope_dim), BLOCK_H=block_h, PAGE_SIZE=page_size, BLOCK_N=block_n,
        CACHE_IS_FP8=fp8, COMPUTE_DTYPE=compute, PREFETCH=cfg["prefetch"], SWAP=cfg["swap"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, merge_splits(part_out, part_lse, out)


# ---------------------------------------------------------------------------------------------------
# The CUDA kernel (session 11): kernels/mla_decode_fp8.cu, compiled at first use by NVRTC (kernels/nvrtc.py).
# ---------------------------------------------------------------------------------------------------

CUDA_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mla_decode_fp8.cu")
CUDA_LATENT, CUDA_ROPE = 512, 64
# The Triton entries an impl="cuda" entry falls back to where the CUDA kernel cannot run (kernels/configs.py).
CUDA_FALLBACK = {"mla_fp8": dict(block_n=64, num_warps=4, num_stages=5, prefetch=False, swap=False,
                                 programs_per_sm=1, block_h=16, tma=True, widen=True, split_latent=True),
                 "mla_fp8_many_heads": dict(block_n=32, num_warps=8, num_stages=5, prefetch=False, swap=False,
                                            programs_per_sm=1, block_h=64, tma=True, widen=True, split_latent=True)}


# The warp-specialized warpgroup-MMA kernel for many heads (session 13), sm_90a: kernels/mla_decode_fp8_ws.cu
# (wgmma=True); its tile (64 tokens), heads a block (64) and warps (12: three warp groups) are fixed by its source.
WGMMA_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mla_decode_fp8_ws.cu")
WGMMA_TOKENS, WGMMA_HEADS, WGMMA_WARPS = 64, 64, 12


def _wgmma_smem(stages: int) -> int:
    """Tile rows (16 bytes more a row for the row shifts), Q^T in fp16, two P^T tiles of 64 heads, alphas [2, 64],
    maxima [4, 64], l [64] in fp32 and two mbarriers a stage; the [64, 513] fp32 output staging reuses the tiles and
    Q^T."""
    row = CUDA_LATENT + CUDA_ROPE
    return stages * WGMMA_TOKENS * (row + 16) + WGMMA_HEADS * row * 2 + 2 * WGMMA_TOKENS * 64 * 2 \
        + (2 + 4 + 1) * 64 * 4 + 16 * stages


def _cuda_shape(cfg: dict) -> tuple[int, int, int, int]:
    """(warps, n8 token blocks per warp, stages, m16 head tiles per block) of a CUDA entry."""
    warps, block_n = cfg["num_warps"], cfg["block_n"]
    return warps, block_n // (8 * warps), cfg["num_stages"], cfg.get("block_h", 16) // 16


def _cuda_tile_bytes(warps: int, blocks: int, stages: int, bulk: bool) -> int:
    """The pipeline's tile buffers (bulk copies: 16 bytes more a row for the row shifts)."""
    row = CUDA_LATENT + CUDA_ROPE + 16 * bulk
    return stages * 8 * warps * blocks * row


def _cuda_smem(warps: int, blocks: int, stages: int, m_tiles: int, bulk: bool) -> int:
    row = CUDA_LATENT + CUDA_ROPE
    return (_cuda_tile_bytes(warps, blocks, stages, bulk) + (row // 16) * m_tiles * 32 * 16
            + 2 * warps * 32 * m_tiles * blocks * 16 + 8 * stages)


@functools.lru_cache(maxsize=None)
def _gpu(index: int) -> tuple[tuple[int, int], int]:
    """(compute capability, shared memory a block may opt in to) of a device: asked once (a call costs ~10 µs)."""
    return (torch.cuda.get_device_capability(index),
            torch.cuda.get_device_properties(index).shared_memory_per_block_optin)


def _cuda_bulk(cfg: dict, device: torch.device) -> bool:
    """Bulk copies (sm_90's cp.async.bulk, one per tile row) unless the entry says bulk=False (then cp.async)."""
    return cfg.get("bulk", True) and _gpu(device.index)[0] >= (9, 0)


def cuda_refusal(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, options: bool,
                 cfg: dict) -> str | None:
    """Why the CUDA kernel cannot run this call (None when it can)."""
    if not is_fp8(cache.dtype):
        return f"it reads fp8 caches only, got {cache.dtype}"
    if options:
        return "no fp8_mma, q_scale or prob_scale (the Triton tile kernel has them)"
    if q_latent.shape[2] != CUDA_LATENT or q_pe.shape[2] != CUDA_ROPE:
        return f"it is built for Dc {CUDA_LATENT} and Dr {CUDA_ROPE}, got {q_latent.shape[2]} and {q_pe.shape[2]}"
    reason = nvrtc.unavailable()
    if reason:
        return reason
    if _gpu(cache.device.index)[0] < (8, 9):
        return "it needs sm_89 or later (cvt from fp8 pairs)"
    if cache.stride(2) != 1 or cache.stride(1) != CUDA_LATENT + CUDA_ROPE or cache.stride(0) % 16 \
            or cache.data_ptr() % 16:
        return "it copies 16-byte chunks: cache rows contiguous, pages and the base 16-byte aligned"
    if cfg.get("wgmma"):
        if _gpu(cache.device.index)[0] != (9, 0):
            return "wgmma=True needs an sm_90 GPU (Hopper; the kernel is built for sm_90a)"
        shape = (cfg["block_n"], cfg["num_warps"], cfg.get("block_h"))
        if shape != (WGMMA_TOKENS, WGMMA_WARPS, WGMMA_HEADS) or cfg["num_stages"] < 2:
            return (f"wgmma=True is built for block_n {WGMMA_TOKENS}, num_warps {WGMMA_WARPS}, block_h {WGMMA_HEADS} "
                    f"and num_stages >= 2; got {cfg}")
        smem = _wgmma_smem(cfg["num_stages"])
        if smem > _gpu(cache.device.index)[1]:
            return f"{smem} bytes of shared memory is more than this GPU has for a block"
        if any(t.data_ptr() % 8 or t.stride(0) % 4 or t.stride(1) % 4 for t in (q_latent, q_pe)):
            return "it reads the query 4 elements at a time: q_latent and q_pe strides and base 8-byte aligned"
        return None
    warps, blocks, stages, m_tiles = _cuda_shape(cfg)
    if warps not in (1, 2, 4, 8, 16) or blocks not in (1, 2, 4) or 8 * warps * blocks != cfg["block_n"] \
            or warps * blocks % 2 or stages < 3 or cfg.get("block_h", 16) not in (16, 32, 64):
        return (f"block_n = 8 x num_warps x 1, 2 or 4 n8 blocks (an even count of n8 blocks), num_stages >= 3, "
                f"block_h 16, 32 or 64; got {cfg}")
    if any(t.data_ptr() % 8 or t.stride(0) % 4 or t.stride(1) % 4 for t in (q_latent, q_pe)):
        return "it reads the query 4 elements at a time: q_latent and q_pe strides and base 8-byte aligned"
    smem = _cuda_smem(warps, blocks, stages, m_tiles, _cuda_bulk(cfg, cache.device))
    if smem > _gpu(cache.device.index)[1]:
        return f"{smem} bytes of shared memory is more than this GPU has for a block"
    return None


@functools.lru_cache(maxsize=None)
def _warn_cuda_fallback(reason: str, kernel: str = "kernels/mla_decode_fp8.cu",
                        instead: str = "the Triton entry") -> None:
    warnings.warn(f"mla_decode: the CUDA kernel ({kernel}) did not build here, so {instead} runs instead: {reason}",
                  RuntimeWarning, stacklevel=3)


def _cuda_kernel(defines: tuple, index: int, wgmma: bool = False, name: str = "mla_fp8_decode"):
    if wgmma:
        return nvrtc.build(WGMMA_SOURCE, "mla_fp8_decode_wgmma", defines, index, arch_specific=True)
    return nvrtc.build(CUDA_SOURCE, name, defines, index)


def _mla_decode_cuda(q_latent, q_pe, cache, block_table, seq_lens, scale, sm_scale, num_splits, cfg):
    batch, heads, latent_dim = q_latent.shape
    device = q_latent.device
    page_size = cache.shape[1]
    formats = (("FMT_E5M2", int(cache.dtype == torch.float8_e5m2)), ("Q_BF16", int(q_latent.dtype == torch.bfloat16)))
    if cfg.get("wgmma"):
        warps, heads_per_block, stages = WGMMA_WARPS, WGMMA_HEADS, cfg["num_stages"]
        defines = (("STAGES", stages), ("PAGE", page_size), *formats)
        kernel = _cuda_kernel(defines, device.index, wgmma=True)
        smem = _wgmma_smem(stages)
    else:
        warps, blocks, stages, m_tiles = _cuda_shape(cfg)
        bulk = _cuda_bulk(cfg, device)
        defines = (("NW", warps), ("NB", blocks), ("STAGES", stages), ("MT", m_tiles), ("CTAS", cfg.get("ctas", 1)),
                   ("PAGE", page_size), ("BULK", int(bulk)),
                   ("TILE_BYTES", _cuda_tile_bytes(warps, blocks, stages, bulk)), *formats)
        kernel = _cuda_kernel(defines, device.index)
        heads_per_block, smem = 16 * m_tiles, _cuda_smem(warps, blocks, stages, m_tiles, bulk)
    head_blocks = triton.cdiv(heads, heads_per_block)
    num_splits, tokens_per_split = plan_splits(block_table.shape[1] * page_size, batch * head_blocks, cfg["block_n"],
                                               cfg["programs_per_sm"], device, num_splits, whole_waves=True,
                                               idle_min_tokens=MLA_IDLE_MIN_TOKENS)
    out = torch.empty(batch, heads, latent_dim, dtype=q_latent.dtype, device=device)
    part_out, part_lse = partials(out, num_splits)
    kernel((head_blocks, batch, num_splits), (32 * warps, 1, 1), smem,
           [q_latent, q_pe, cache, block_table, seq_lens, scale, part_out, part_lse, sm_scale * LOG2E,
            tokens_per_split, heads, q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
            cache.stride(0), cache.stride(1), block_table.stride(0), part_out.stride(0), part_out.stride(1),
            part_out.stride(2), part_lse.stride(0), part_lse.stride(1)])
    if cfg.get("cuda_merge") and not cfg.get("wgmma"):
        lse = torch.empty(batch, heads, dtype=torch.float32, device=device)
        assert part_out.stride(2) == latent_dim, "the merge reads contiguous partial rows"
        merge = _cuda_kernel(defines, device.index, name="mla_fp8_merge")
        merge((heads, batch, 1), (latent_dim // 2, 1, 1), (num_splits + 1) * 4,
              [part_out, part_lse, out, lse, num_splits, part_out.stride(0), part_out.stride(1),
               part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1)],
              overlap=_gpu(device.index)[0] >= (9, 0))
        return out, lse
    return out, merge_splits(part_out, part_lse, out)
