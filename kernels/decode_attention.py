"""Paged GQA decode attention over an FP8 (or BF16) KV cache: split-KV flash-decoding plus a merge kernel.

For query head h of sequence b (kv head g = h // group) over its seq_lens[b] cached tokens j:
    s_j = sm_scale * k_scale[g] * (q . k_codes_j)          (k_scale folded into the softmax scale: exact)
    out = v_scale[g] * sum_j softmax(s)_j v_codes_j        (v_scale folded into the output: exact)
    lse = log sum_j exp(s_j)
Each program handles all `group` query heads of one kv head over one split of the sequence (K/V read
once per group), keeps a running max and sum in base 2 (exp2, scores pre-multiplied by log2 e), and
writes a partial output normalised by its own sum plus its base-2 lse; the merge kernel combines splits:
    out = sum_s 2^(lse_s - m) out_s / sum_s 2^(lse_s - m),   lse = (m + log2 sum_s 2^(lse_s - m)) * ln 2.
FP8 codes are exact in fp16, so an FP8 cache is multiplied in fp16 on tensor cores (q rounded to fp16:
exact for bf16 q in fp16's normal range, |q| < 65504), P is rounded to fp16 for P @ V; accumulation is fp32.
A BF16/FP16 cache runs the same code in its own dtype and never reads the scales (failure class 3).
The torch mirror is `reference.decode_attention`. Over an FP8 cache the launcher first asks the CUDA kernel
(kernels/gqa_decode_cuda.py, the same definition: fp16 products, fp32 accumulation, base-2 softmax, P in fp16) and
runs the Triton kernel below where it does not serve the call (`impl`).

Attention beyond SDPA (what gpt-oss, Gemma 2 and windowed layers compute; vLLM's and FlashInfer's decode kernels
take the same three):
- soft-capping: s_j = softcap * tanh(s_j / softcap) before the softmax (Gemma 2's attn_logit_softcapping);
- sinks: a learned logit per query head in the softmax's denominator only (gpt-oss):
      out = sum_j exp(s_j) V_j / (exp(sink_h) + sum_j exp(s_j)),  lse = log(exp(sink_h) + sum_j exp(s_j)),
  added once, by the merge kernel (a split-KV program never sees it);
- a window: row b attends to tokens first_key[b] .. seq_lens[b] - 1 (sliding: seq_len - window; chunked: the
  start of the query's chunk), the tokens before it read by no program.

FP8 attention options (engines' q_scale / prob_scale; FP8 FlashAttention-3), always in e4m3:
- Q: q8 = e4m3(q / q_scale) (IEEE division, RTNE, saturating), q_scale given ([] or [Hq]) or "dynamic" (per
  head: amax / 448); the scores use q8 * q_scale. On an e4m3 cache in the swap layout Q.K then runs on fp8
  tensor cores (K never converted); otherwise the e4m3 Q and the K codes are widened to fp16 (exact; same values).
- P: an online softmax never holds the normalised probabilities, so the kernel quantises what it has: the
  tile-relative unnormalised p_j = 2^(s_j - m_t) in (0, 1], m_t the running max of the split up to tile t:
      p8_j = e4m3(p_j * r),  r = fp32(1 / prob_scale)  (RTNE, saturating at 448)
      out = v_scale * prob_scale * sum_j 2^(m_t(j) - M) p8_j v_codes_j / sum_j 2^(s_j - M)
  with the denominator from the unquantised p (the reference also quantises P and does not renormalise).
  On an e4m3 cache P.V gets V's codes as they are (fp8 operands; swap: fp8 wgmma). The torch
  emulation of exactly this definition (tile and split boundaries included) is `reference.decode_attention`
  with prob_scale and block_n; `reference.attention_fp8` quantises the normalised P instead (same scale
  convention: prob_scale 1/448 maps the largest possible probability, 1, onto 448); the two differ in which
  values get rounded, not in the size of the rounding (kernels/BENCHMARKS.md measures both against fp64).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import gqa_decode_cuda, nvrtc
from kernels.configs import DEFAULT as DEFAULT_CONFIGS
from kernels.configs import launch_config
from kernels.reference import FP8_MAX, is_fp8
from kernels.splits import (LOG2E, MIN_TOKENS_PER_SPLIT, interpreting, merge_splits,  # noqa: F401 - re-exported
                            on_tensor_device, partials, plan_splits)

FP8_ACC_CHUNK = 32               # fp8 MMA products summed in fp32 per this many (Triton's max_num_imprecise_acc)
# Launch configurations (tile size, warps, pipeline, tokens-as-M "swap", programs per SM): kernels/configs.py.


@triton.jit
def _decode_attention_pages(table_row, tok, t_mask, PAGE_SIZE: tl.constexpr):
    """Physical page of each token in `tok` ([BLOCK_N]), via the sequence's block-table row."""
    return tl.load(table_row + tok // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)


@triton.jit
def _widen_fp8(x, E5M2: tl.constexpr):
    """fp8 codes -> fp16, exact (cvt.rn.f16x2.e4m3x2 / e5m2x2, two codes per instruction), as inline PTX: the
    compiler cannot move it past the tile's layout conversions, so each code is widened once, in the tile's
    load layout (16-byte shared loads), and both dots read the fp16 tile (ldmatrix / ldmatrix.trans). A plain
    `.to(tl.float16)` is moved into each dot's operand layout instead: the tile is widened twice and the
    transposed operand is gathered a byte at a time (kernels/BENCHMARKS.md, session 7)."""
    codes = x.to(tl.uint8, bitcast=True)
    if E5M2:
        y = tl.inline_asm_elementwise("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e5m2x2 $0, lo; "
                                      "cvt.rn.f16x2.e5m2x2 $1, hi; }", "=r,=r,r", [codes], dtype=tl.float16,
                                      is_pure=False, pack=4)
    else:
        y = tl.inline_asm_elementwise("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; "
                                      "cvt.rn.f16x2.e4m3x2 $1, hi; }", "=r,=r,r", [codes], dtype=tl.float16,
                                      is_pure=False, pack=4)
    return y


@triton.jit
def _widen(x, COMPUTE_DTYPE: tl.constexpr, WIDEN: tl.constexpr):
    """A cache tile as a tensor-core operand: WIDEN 1 / 2: e4m3 / e5m2 codes widened by `_widen_fp8` (fp16);
    0: `.to(COMPUTE_DTYPE)` (bf16/fp16 caches, and the widening the compiler places itself)."""
    if WIDEN != 0:
        return _widen_fp8(x, WIDEN == 2)
    else:
        return x.to(COMPUTE_DTYPE)


@triton.jit
def _decode_attention_load_tile(K_CACHE, V_CACHE, page, tok, t_mask, d_mask, offs_d, head_off,
                                stride_cb, stride_cs, PAGE_SIZE: tl.constexpr):
    """K and V rows of tokens `tok` ([BLOCK_N]) on pages `page`: two [BLOCK_N, BLOCK_D] tiles."""
    rows = page * stride_cb + (tok % PAGE_SIZE) * stride_cs + head_off                    # [BLOCK_N]
    mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(K_CACHE + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(V_CACHE + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (e^2x + 1): saturates to +-1 (exp2 overflows to inf, or underflows to 0) and runs under the
    # interpreter too (libdevice.tanh returned None there); absolute error ~1e-7 near 0, which soft-capping multiplies
    # by the cap: far below a bf16 score's rounding
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)   # 2 log2(e)


@triton.jit
def _decode_attention_kernel(
    Q,                       # [B, Hq, D] bf16/fp16
    K_CACHE, V_CACHE,        # [num_blocks, block_size, Hkv, D] fp8 / bf16 / fp16
    BLOCK_TABLE, SEQ_LENS,   # [B, max_blocks] int32, [B] int32
    K_SCALE, V_SCALE,        # fp32 [] or [Hkv] (unread for a bf16/fp16 cache)
    Q_SCALE, PROB_SCALE,     # fp32 [] or [Hq] (read when Q_QUANT == 2), fp32 [] (read when P_FP8)
    PART_OUT, PART_LSE,      # [B, Hq, splits, D] fp32 normalised partial outputs, [B, Hq, splits] fp32 base-2 lse
    FIRST_KEY,               # [B] int32: the first token each row attends to (read when WINDOWED)
    sm_scale_log2,           # sm_scale * log2(e)
    softcap_log2,            # softcap * log2(e) (read when SOFTCAP)
    tokens_per_split,        # multiple of BLOCK_N
    k_scale_stride, v_scale_stride,               # 0 per tensor, 1 per KV head
    q_scale_stride,                               # 0 per tensor, 1 per query head
    stride_qb, stride_qh,
    stride_cb, stride_cs, stride_ch,              # shared by both caches (asserted)
    stride_tb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CACHE_IS_FP8: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
    PREFETCH: tl.constexpr, SWAP: tl.constexpr, Q_QUANT: tl.constexpr, P_FP8: tl.constexpr,
    K_AS_FP8: tl.constexpr, V_AS_FP8: tl.constexpr, FP8_MAX: tl.constexpr, QK_ACC: tl.constexpr,
    PV_ACC: tl.constexpr, WIDEN: tl.constexpr = 0, WIDEN_V: tl.constexpr = 0, SOFTCAP: tl.constexpr = False,
    WINDOWED: tl.constexpr = False,
):
    # Q_QUANT: 0 Q as is, 1 dynamic per-head e4m3, 2 e4m3 under Q_SCALE. P_FP8: P quantised to e4m3 under
    # PROB_SCALE. K_AS_FP8 / V_AS_FP8: the cache tile goes to the MMA as fp8 codes (e4m3 cache with Q / P in fp8).
    # QK_ACC / PV_ACC: fp8 MMAs add their partial sums in fp32 every 32 products (None for fp16/bf16 MMAs):
    # Hopper's fp8 wgmma otherwise accumulates in reduced precision, which moved the scores (and the lse) by
    # ~3e-4 relative on an H100 (tests/test_kernels_gpu.py::test_fp8_attention_*, kernels/BENCHMARKS.md).
    kv_head = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    if WINDOWED:  # tokens before the row's window: read by no program (a split wholly before it is empty)
        start = tl.maximum(start, tl.load(FIRST_KEY + b))

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q_raw = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)                     # [BLOCK_G, BLOCK_D]
    qk_scale = sm_scale_log2
    v_scale = 1.0
    if CACHE_IS_FP8:
        qk_scale = sm_scale_log2 * tl.load(K_SCALE + kv_head * k_scale_stride)
        v_scale = tl.load(V_SCALE + kv_head * v_scale_stride)

    s_scale = tl.zeros([BLOCK_G], tl.float32) + qk_scale                                  # per query head
    if Q_QUANT == 0:
        q = q_raw.to(COMPUTE_DTYPE)
    else:
        # Q in e4m3 under its own scale (folded into the scores with k_scale). IEEE division and
        # round-to-nearest-even, as torch's q / q_scale and fp8 cast (the reference mirrors it).
        qf = q_raw.to(tl.float32)
        if Q_QUANT == 1:
            q_amax = tl.max(tl.abs(qf), axis=1)
            q_s = tl.where(q_amax > 0, tl.math.div_rn(q_amax, tl.full([BLOCK_G], FP8_MAX, tl.float32)), 1.0)
        else:
            q_s = tl.load(Q_SCALE + heads * q_scale_stride, mask=g_mask, other=1.0)
        q8 = tl.clamp(tl.math.div_rn(qf, q_s[:, None]), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        q = q8.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        if not K_AS_FP8:
            q = q.to(COMPUTE_DTYPE)             # plain layout or e5m2/bf16 cache: Q and K widened (exact)
        s_scale = s_scale * q_s
    p_inv = 1.0
    if P_FP8:
        prob_scale = tl.load(PROB_SCALE)
        p_inv = tl.math.div_rn(1.0, prob_scale)                    # r = fp32(1 / prob_scale), IEEE (not div.full)
        v_scale = v_scale * prob_scale
    if SWAP:
        q_t = tl.trans(q)                                                                  # [BLOCK_D, BLOCK_G]
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_D, BLOCK_G], tl.float32)                                     # out transposed
    else:
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)     # running max, base 2
        l_i = tl.zeros([BLOCK_G], tl.float32)                   # running sum of 2^(s - m)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = BLOCK_TABLE + b * stride_tb
    head_off = kv_head * stride_ch
    if PREFETCH:
        # Software pipeline in registers: tile i is computed while tile i+1's K/V and tile i+2's page numbers
        # load, so neither the page-table lookup nor the K/V fetch stalls the loop.
        t_mask = start + offs_n < end
        k, v = _decode_attention_load_tile(K_CACHE, V_CACHE, _decode_attention_pages(table_row, start + offs_n, t_mask,
                                           PAGE_SIZE), start + offs_n, t_mask, d_mask, offs_d, head_off, stride_cb,
                                           stride_cs, PAGE_SIZE)
        next_mask = start + BLOCK_N + offs_n < end
        next_page = _decode_attention_pages(table_row, start + BLOCK_N + offs_n, next_mask, PAGE_SIZE)
    for n0 in range(start, end, BLOCK_N):
        if PREFETCH:
            after_mask = n0 + 2 * BLOCK_N + offs_n < end
            after_page = _decode_attention_pages(table_row, n0 + 2 * BLOCK_N + offs_n, after_mask, PAGE_SIZE)
            k_next, v_next = _decode_attention_load_tile(K_CACHE, V_CACHE, next_page, n0 + BLOCK_N + offs_n, next_mask,
                                                         d_mask, offs_d, head_off, stride_cb, stride_cs, PAGE_SIZE)
        else:
            t_mask = n0 + offs_n < end
            k, v = _decode_attention_load_tile(K_CACHE, V_CACHE, _decode_attention_pages(table_row, n0 + offs_n, t_mask,
                                               PAGE_SIZE), n0 + offs_n, t_mask, d_mask, offs_d, head_off, stride_cb,
                                               stride_cs, PAGE_SIZE)
        k_op = k if K_AS_FP8 else _widen(k, COMPUTE_DTYPE, WIDEN)
        if SWAP:
            # Tokens as the MMA's M dimension (128 rows: Hopper wgmma), the group's heads as N (padded to 16).
            s = tl.dot(k_op, q_t, max_num_imprecise_acc=QK_ACC) * s_scale[None, :]               # [BLOCK_N, BLOCK_G]
            if SOFTCAP:  # base 2 throughout: softcap * log2e * tanh(s_nat / softcap) = c2 * tanh(s / c2)
                s = softcap_log2 * _tanh(s / softcap_log2)
            s = tl.where(t_mask[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            p_op = p.to(COMPUTE_DTYPE)
            if P_FP8:   # e4m3(p * r), saturating; fp8 to the MMA, or widened to fp16 over an e5m2/bf16 cache
                p_op = tl.minimum(p * p_inv, FP8_MAX).to(tl.float8e4nv, fp_downcast_rounding="rtne")
                if not V_AS_FP8:
                    p_op = p_op.to(COMPUTE_DTYPE)
            v_op = v if V_AS_FP8 else _widen(v, COMPUTE_DTYPE, WIDEN_V)
            acc = acc * alpha[None, :] + tl.dot(tl.trans(v_op), p_op, max_num_imprecise_acc=PV_ACC)
        else:
            s = tl.dot(q, tl.trans(k_op), max_num_imprecise_acc=QK_ACC) * s_scale[:, None]       # [BLOCK_G, BLOCK_N]
            if SOFTCAP:
                s = softcap_log2 * _tanh(s / softcap_log2)
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            p_op = p.to(COMPUTE_DTYPE)
            if P_FP8:
                p_op = tl.minimum(p * p_inv, FP8_MAX).to(tl.float8e4nv, fp_downcast_rounding="rtne")
                if not V_AS_FP8:
                    p_op = p_op.to(COMPUTE_DTYPE)
            v_op = v if V_AS_FP8 else _widen(v, COMPUTE_DTYPE, WIDEN_V)   # here, not before Q.K: 7% slower there (H100)
            acc = acc * alpha[:, None] + tl.dot(p_op, v_op, max_num_imprecise_acc=PV_ACC)
        m_i = m_new
        if PREFETCH:
            k, v, t_mask = k_next, v_next, next_mask
            next_page, next_mask = after_page, after_mask

    if SWAP:
        acc = tl.trans(acc)                                                                # [BLOCK_G, BLOCK_D]
    empty = l_i == 0.0                                       # split past the end of this sequence
    out = acc * (v_scale / tl.where(empty, 1.0, l_i))[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_i))
    out_rows = PART_OUT + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(out_rows, out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(PART_LSE + b * stride_lb + heads * stride_lh + split, lse2, mask=g_mask)


@on_tensor_device
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                     sm_scale: float, num_splits: int | None = None, *, qk_fp8: bool = False,
                     block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                     prefetch: bool | None = None, swap: bool | None = None,
                     programs_per_sm: int | None = None, q_scale: torch.Tensor | str | None = None,
                     prob_scale: torch.Tensor | None = None,
                     widen: bool | str | None = None,
                     whole_waves: bool | None = None, sinks: torch.Tensor | None = None,
                     softcap: float | None = None,
                     first_key: torch.Tensor | None = None, impl: str | None = None, cuda_warps: int | None = None,
                     ctas: int | None = None, cuda_prefetch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Hq, D] bf16/fp16; caches: [num_blocks, block_size, Hkv, D] fp8 (e4m3/e5m2) or q.dtype;
    block_table: [B, max_blocks] int32; seq_lens: [B] int32 (each <= max_blocks * block_size);
    k_scale/v_scale: fp32 [] or [Hkv] (ignored for a bf16/fp16 cache).
    Returns (out [B, Hq, D] q.dtype, lse [B, Hq] fp32 natural log). num_splits=None picks enough
    splits to fill the GPU. FP8 attention (module docstring; always e4m3): q_scale = "dynamic" (per head,
    amax / 448) or an fp32 tensor [] or [Hq] quantises Q; prob_scale (fp32 []) quantises the tile-relative
    probabilities for P.V. qk_fp8=True is the older spelling of q_scale="dynamic" (e4m3 cache only). Any cache
    takes them; an e4m3 cache gets the speed (fp8 MMAs, no tile converted). The launch keywords override this
    GPU's entry in kernels/configs.py ("gqa_fp8_pv" when P is in fp8 over an e4m3 cache). widen (fp8 caches):
    each fp8 tile is widened to fp16 once, by inline PTX in its load layout (`_widen_fp8`), instead of where
    the compiler puts the cast (in each MMA operand's layout, the V operand gathered a byte at a time); widen="v"
    (session 8): only the V tile so, K by the compiler's cast (K-contiguous: no byte gathers); with prob_scale over an
    e4m3 cache, widen True or "v" also widens the e4m3 P (exact) so P.V runs on the fp16 tile instead of the fp8 codes.
    whole_waves (session 8): the split count rounded down to whole waves of programs_per_sm programs per SM
    (plan_splits), as the MLA launcher always does. sinks: fp32 [Hq] sink logits (natural log); softcap: the
    soft-capping value (> 0); first_key: [B] int32, the first token each row attends to (its window's start).
    impl (fp8 caches): "cuda" (kernels/gqa_decode_cuda.py: the block-scaled CUDA kernel reading the e4m3 / e5m2 codes
    with the static scales; a call it cannot serve raises ValueError saying why), "triton", or None: the entry's, the
    CUDA kernel where it serves the call (no FP8 attention, soft-capping or window; sinks are merged) and builds, else
    the Triton kernel; cuda_warps, ctas (blocks an SM) and cuda_prefetch (tiles loaded ahead) are the CUDA kernel's."""
    assert q.dim() == 3 and q.dtype in (torch.bfloat16, torch.float16), \
        f"q must be [B, Hq, D] bf16/fp16, got {list(q.shape)} {q.dtype}"
    batch, q_heads, head_dim = q.shape
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.shape[3] == head_dim, \
        f"caches must be [num_blocks, block_size, Hkv, {head_dim}], got {list(k_cache.shape)}, {list(v_cache.shape)}"
    num_blocks, page_size, kv_heads, _ = k_cache.shape
    assert q_heads % kv_heads == 0, f"Hq={q_heads} is not a multiple of Hkv={kv_heads}"
    assert v_cache.dtype == k_cache.dtype and (is_fp8(k_cache.dtype) or k_cache.dtype == q.dtype), \
        f"caches must be fp8 or {q.dtype}, got {k_cache.dtype}, {v_cache.dtype}"
    assert 16 <= head_dim <= 256, f"head_dim must be in [16, 256], got {head_dim}"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1, \
        "caches must share strides; head_dim must be contiguous"
    assert block_table.dim() == 2 and block_table.shape[0] == batch and block_table.dtype == torch.int32, \
        f"block_table must be [{batch}, max_blocks] int32, got {list(block_table.shape)} {block_table.dtype}"
    assert seq_lens.shape == (batch,) and seq_lens.dtype == torch.int32, \
        f"seq_lens must be [{batch}] int32, got {list(seq_lens.shape)} {seq_lens.dtype}"
    fp8 = is_fp8(k_cache.dtype)
    if fp8:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            assert isinstance(s, torch.Tensor) and s.dtype == torch.float32 and s.shape in ((), (kv_heads,)), \
                f"{name} must be an fp32 tensor of shape [] or [{kv_heads}], got {s!r:.80}"
    # qk_fp8 quantised Q into the cache's format; e5m2 (2 mantissa bits) failed the 2x-torch agreement test with
    # per-tensor scales on an H100 (kernels/BENCHMARKS.md, session 4). q_scale="dynamic" is always e4m3.
    assert not qk_fp8 or k_cache.dtype == torch.float8_e4m3fn, "qk_fp8 needs an e4m3 cache"
    assert not (qk_fp8 and q_scale is not None), "give qk_fp8 or q_scale, not both"
    q_scale = "dynamic" if qk_fp8 else q_scale
    device = q.device
    q_quant = _check_attention_scales(q_scale, prob_scale, q_heads, device)
    assert device.type == "cuda" or interpreting(), f"Triton kernels need CUDA tensors, got {device}"
    e4m3 = k_cache.dtype == torch.float8_e4m3fn
    kind = "gqa_fp8" if fp8 else "gqa_bf16"
    # under the interpreter (CPU tensors): the default table's entry, the plain layout, no inline assembly
    cfg = launch_config("gqa_fp8_pv" if e4m3 and prob_scale is not None else kind, device) if device.type == "cuda" \
        else dict(DEFAULT_CONFIGS[kind], swap=False, widen=False)
    for key, value in (("block_n", block_n), ("num_warps", num_warps), ("num_stages", num_stages),
                       ("prefetch", prefetch), ("swap", swap), ("programs_per_sm", programs_per_sm),
                       ("widen", widen), ("whole_waves", whole_waves)):
        if value is not None:
            cfg[key] = value
    assert cfg.get("widen", False) in (False, True, "v"), f"widen must be a bool or 'v', got {cfg['widen']!r}"
    if prefetch and swap is None:   # an explicit register prefetch means the plain layout (see the assert below)
        cfg["swap"] = False
    block_n = cfg["block_n"]
    assert not (cfg["swap"] and cfg["prefetch"]), \
        "swap with prefetch is refused: it produced NaN on an H100 with Triton 3.6 (kernels/BENCHMARKS.md)"
    assert block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n must be a power of two >= 16, got {block_n}"
    assert num_splits is None or num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    scales = [s for s in (k_scale, v_scale) if s is not None and fp8]
    assert all(t.device == device for t in (k_cache, v_cache, block_table, seq_lens, *scales)), \
        "all tensors must be on one device"
    assert softcap is None or softcap > 0, f"softcap must be > 0, got {softcap}"
    assert first_key is None or (first_key.shape == (batch,) and first_key.dtype == torch.int32
                                 and first_key.device == device), \
        f"first_key must be [{batch}] int32 on {device}, got {first_key!r:.80}"
    assert impl in (None, *gqa_decode_cuda.IMPLS), f"impl must be one of {gqa_decode_cuda.IMPLS} or None, got {impl!r}"
    if fp8 and (impl or cfg.get("impl")) == "cuda":
        element = "e4m3" if e4m3 else "e5m2"
        why = ("FP8 attention (q_scale / prob_scale) runs in the Triton kernel" if q_quant or prob_scale is not None
               else "soft-capping and windows run in the Triton kernel" if softcap is not None or first_key is not None
               else gqa_decode_cuda.cuda_refusal(q, k_cache, None, element, "none", head_dim, v_cache))
        if why is None:
            for key, value in (("cuda_warps", cuda_warps), ("ctas", ctas), ("cuda_prefetch", cuda_prefetch)):
                if value is not None:
                    cfg[key] = value
            try:
                return gqa_decode_cuda.decode(q, k_cache, v_cache, None, None, block_table, seq_lens, k_scale, v_scale,
                                              sm_scale, num_splits, dict(cfg, layout=(element, "none", head_dim)),
                                              sinks)
            except nvrtc.BuildError as e:
                why = str(e)
                if impl is None:
                    gqa_decode_cuda.warn_fallback("decode_attention", why)
        if impl == "cuda":
            raise ValueError(f"decode_attention(impl='cuda'): the CUDA kernel does not serve this call: {why}")

    num_splits, tokens_per_split = plan_splits(block_table.shape[1] * page_size, batch * kv_heads, block_n,
                                               cfg["programs_per_sm"], device, num_splits,
                                               whole_waves=cfg.get("whole_waves", False))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    part_out, part_lse = partials(out, num_splits)
    group = q_heads // kv_heads
    # fp8 Q.K only where it reaches wgmma (swap): in the plain 16-row layout it gave no speed (0.2536 vs 0.2485 ms,
    # batch 8, 32k) and failed the agreement test with its emulation (q dynamic, H100, session 5), so there the e4m3
    # Q and the K codes are widened to fp16 (exact) as over an e5m2 cache.
    k_as_fp8 = e4m3 and q_quant > 0 and cfg["swap"]
    # P.V on the fp8 codes (fp8 MMA operands) unless the V tile is widened (widen True / "v"): then P is widened too
    v_as_fp8 = e4m3 and prob_scale is not None and cfg.get("widen", False) not in (True, "v")
    _decode_attention_kernel[(kv_heads, batch, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens,
        k_scale if fp8 else seq_lens, v_scale if fp8 else seq_lens,
        q_scale if q_quant == 2 else seq_lens, prob_scale if prob_scale is not None else seq_lens, part_out, part_lse,
        first_key if first_key is not None else seq_lens, sm_scale * LOG2E, (softcap or 1.0) * LOG2E, tokens_per_split,
        int(fp8 and k_scale.dim() == 1), int(fp8 and v_scale.dim() == 1), int(q_quant == 2 and q_scale.dim() == 1),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), PAGE_SIZE=page_size, BLOCK_N=block_n, CACHE_IS_FP8=fp8,
        COMPUTE_DTYPE=tl.float16 if fp8 else (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16),
        PREFETCH=cfg["prefetch"], SWAP=cfg["swap"], Q_QUANT=q_quant, P_FP8=prob_scale is not None,
        K_AS_FP8=k_as_fp8, V_AS_FP8=v_as_fp8, FP8_MAX=FP8_MAX["e4m3"],
        QK_ACC=min(FP8_ACC_CHUNK, triton.next_power_of_2(head_dim)) if k_as_fp8 else None,
        PV_ACC=min(FP8_ACC_CHUNK, block_n) if v_as_fp8 else None,
        WIDEN=(1 if e4m3 else 2) if fp8 and cfg.get("widen", False) is True else 0,
        WIDEN_V=(1 if e4m3 else 2) if fp8 and cfg.get("widen", False) in (True, "v") else 0,
        SOFTCAP=softcap is not None, WINDOWED=first_key is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, merge_splits(part_out, part_lse, out, sinks)


def _check_attention_scales(q_scale, prob_scale, q_heads: int, device: torch.device) -> int:
    """The kernel's Q_QUANT (0 none, 1 dynamic, 2 given scale) after checking both scales' types and shapes."""
    if isinstance(q_scale, str):
        assert q_scale == "dynamic", f'q_scale must be "dynamic", an fp32 tensor or None, got {q_scale!r}'
    for name, s, shapes in (("q_scale", q_scale, ((), (q_heads,))), ("prob_scale", prob_scale, ((),))):
        if isinstance(s, torch.Tensor):
            assert s.dtype == torch.float32 and s.shape in shapes and s.device == device, \
                f"{name} must be an fp32 tensor of shape {' or '.join(str(list(x)) for x in shapes)} on {device}, " \
                f"got {list(s.shape)} {s.dtype} on {s.device}"
        else:
            assert s is None or (name == "q_scale" and s == "dynamic"), f"{name} must be an fp32 tensor, got {s!r:.80}"
    return 0 if q_scale is None else 1 if isinstance(q_scale, str) else 2
