"""Paged GQA decode attention over block-scaled KV caches (NVFP4, MXFP8, MXFP4, INT8 / INT4 per token-head): the
split-KV flash-decoding of kernels/decode_attention.py (same partials, same merge kernel), with the stored codes
and block scales read as they are and widened to fp16 in registers (Hopper has no FP4 tensor cores).

Cache layout: kernels/reference.py ("Block-scaled caches"): per token and KV head, packed codes, block scales
(e4m3 or e8m0 bits, one per BLOCK values; or one fp32 scale for the whole head) and a static scale [] / [Hkv].
The torch mirror is `reference.decode_attention_block_scaled`.

Where each scale goes, for token j of a tile, block b of its head (everything but the codes in fp32):
- e4m3 block scales (NVFP4): K and V tiles = element x block scale in fp16, exact (|element| <= 6 has 2
  significant bits, the scale 4: the product has at most 6 and lies in [2^-10, 2688], fp16's normal range);
  the static scale is folded into the softmax scale (K) and the output (V), as the FP8 kernel folds its scales.
- e8m0 block scales (MX): with E_j the token's largest block exponent, the tile holds
  element x 2^(e_jb - E_j) in fp16 (exact while e_jb - E_j >= -12 for e4m3 and >= -23 for e2m1 elements; a block
  2^12 below its token's largest rounds at 2^-24 of it) and 2^E_j is folded per token: the score s_j x 2^E_j
  (K); P's column j x 2^(E_j - E_t) and the tile's P.V x 2^E_t, E_t the tile's largest E_j, so P stays <= 1 (V).
- fp32 per token-head scales (INT8, INT4, FP8 per token-head): the codes are exact in fp16; the score s_j x
  k_scale_j (K); P's column j x v_scale_j / m_t and the tile's P.V x m_t, m_t the tile's largest v_scale (V).
P is rounded to fp16 for P.V (underflowing below 2^-24 of the running max, or of the tile's largest V scale
where V's scales are folded into it); Q is rounded to fp16 (exact for bf16 q in fp16's normal range); scores and
accumulation are fp32.

4-bit values: q . k = q_even . k_even + q_odd . k_odd (and P.V into even / odd accumulators), so each byte's two
values go to separate dots and are never shuffled together; hence heads of 32 values or more.

Widening, per kernels/configs.py's entry (`asm`): inline PTX, one 32-bit word of codes at a time: e2m1 by a byte-table
lookup (prmt) of each magnitude's fp16 high byte plus its sign bit; int4 and int8 by the fp16 magic-number trick
((1024 + code) - 1024 as f16x2); e4m3 by cvt.rn.f16x2.e4m3x2 (`decode_attention._widen_fp8`). asm=False: the same
values by plain Triton integer ops (the Triton interpreter, which has no inline assembly; on an H200 the faster for
e2m1, kernels/BENCHMARKS.md session 16).

Every layout runs the CUDA kernel kernels/gqa_decode_block_scaled.cu (its launcher: kernels/gqa_decode_cuda.py)
where its entry says impl="cuda" and `cuda_refusal` finds nothing against the call (head sizes 64 / 128, and 256 for
NVFP4 and INT4; up to 16 query heads per KV head, above 8 at head sizes 64 / 128; pages of a multiple of 16 tokens;
sm_89 and later; NVRTC present); elsewhere the Triton kernel below runs.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from kernels import gqa_decode_cuda, mla_block_scaled_cuda, nvrtc
from kernels.configs import launch_config
from kernels.decode_attention import (LOG2E, _decode_attention_pages, _widen_fp8, interpreting, merge_splits,
                                      on_tensor_device, partials, plan_splits)
from kernels.gqa_decode_cuda import IMPLS, cuda_refusal, cuda_serves  # noqa: F401 - cuda_serves re-exported
from kernels.reference import BLOCK_SCALE_TYPES, ELEMENT_BITS

ELEMENTS = {"e2m1": 0, "e4m3": 1, "int8": 2, "int4": 3}   # the kernel's ELEMENT
SCALES = {"e4m3": 0, "e8m0": 1, "fp32": 2}                   # the kernel's BLOCK_SCALE
CONFIG_KINDS = {"e2m1": "gqa_fp4", "int4": "gqa_int4", "e4m3": "gqa_fp8_blocks", "int8": "gqa_int8"}
# e2m1 magnitudes' fp16 high bytes (0, 0.5, 1, 1.5 | 2, 3, 4, 6), the table prmt indexes (the low bytes are 0)
E2M1_F16_HIGH = (0x3E3C3800, 0x46444240)


@triton.jit
def _e2m1_widen_asm(x):
    """Packed e2m1 codes (uint8, two a byte, low nibble first) -> (low, high) fp16 of x's shape: each byte's low and
    high nibble's value. Per 32 bits (4 bytes): prmt looks each magnitude's fp16 high byte up in a table (a code's
    sign bit is prmt's mode bit, hence the mask) and interleaves zero low bytes; a second prmt replicates the byte
    holding each value's sign bit, and lop3 ORs the sign into bit 15."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 m, mh, h0, h1, y, w, s, t0, t1;\n"
        "mov.b32 t0, 0x3E3C3800; mov.b32 t1, 0x46444240;\n"
        "and.b32 m, $4, 0x77777777; shr.b32 mh, m, 16;\n"
        "prmt.b32 h0, t0, t1, m; prmt.b32 h1, t0, t1, mh; shl.b32 y, $4, 4;\n"
        "prmt.b32 w, h0, 0, 0x2404; prmt.b32 s, y, $4, 0x9080; lop3.b32 $0, w, s, 0x80008000, 0xF8;\n"
        "prmt.b32 w, h1, 0, 0x2404; prmt.b32 s, y, $4, 0xB0A0; lop3.b32 $1, w, s, 0x80008000, 0xF8;\n"
        "prmt.b32 w, h0, 0, 0x3414; prmt.b32 s, y, $4, 0xD0C0; lop3.b32 $2, w, s, 0x80008000, 0xF8;\n"
        "prmt.b32 w, h1, 0, 0x3414; prmt.b32 s, y, $4, 0xF0E0; lop3.b32 $3, w, s, 0x80008000, 0xF8; }",
        "=r,=r,=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _int4_widen_asm(x):
    """Packed int4 codes (two's-complement nibbles) -> (low, high) as `_e2m1_widen_asm`: each nibble n placed in
    an fp16 1024 + (n ^ 8) (exponent bits 0x64), then (1024 + 8) subtracted: n as a signed value, exactly."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 x4, u, w, c;\n"
        "mov.b32 c, 0x64086408; shr.b32 x4, $4, 4;\n"
        "prmt.b32 u, $4, 0, 0x0100; lop3.b32 w, u, 0x000F000F, 0x64086408, 0x6A; sub.f16x2 $0, w, c;\n"
        "prmt.b32 u, $4, 0, 0x0302; lop3.b32 w, u, 0x000F000F, 0x64086408, 0x6A; sub.f16x2 $1, w, c;\n"
        "prmt.b32 u, x4, 0, 0x0100; lop3.b32 w, u, 0x000F000F, 0x64086408, 0x6A; sub.f16x2 $2, w, c;\n"
        "prmt.b32 u, x4, 0, 0x0302; lop3.b32 w, u, 0x000F000F, 0x64086408, 0x6A; sub.f16x2 $3, w, c; }",
        "=r,=r,=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _int8_widen_asm(x):
    """int8 codes -> fp16, exactly: each byte's sign bit flipped (offset binary), placed in an fp16 1024 + u, then
    (1024 + 128) subtracted."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, u, c;\n"
        "mov.b32 c, 0x64806480; xor.b32 t, $2, 0x80808080;\n"
        "prmt.b32 u, t, 0x64646464, 0x4140; sub.f16x2 $0, u, c;\n"
        "prmt.b32 u, t, 0x64646464, 0x4342; sub.f16x2 $1, u, c; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _nibble_values(n, ELEMENT: tl.constexpr):
    """4-bit codes (int32, 0-15) -> fp16 values: e2m1 as fp16 bits (magnitude << 9 is value x 2^-14, subnormals
    included; the sign to bit 15) times 2^14, exact; int4 as (n ^ 8) - 8."""
    if ELEMENT == 0:
        bits = ((n & 7) << 9) | ((n & 8) << 12)
        return bits.to(tl.int16).to(tl.float16, bitcast=True) * 16384.0
    else:
        return ((n ^ 8) - 8).to(tl.float16)


@triton.jit
def _widen_bytes(codes, ELEMENT: tl.constexpr, ASM: tl.constexpr):
    """8-bit codes [BLOCK_N, HEAD_DIM] uint8 -> values fp16 (exact): e4m3 or int8."""
    if ELEMENT == 1:
        if ASM:
            values = _widen_fp8(codes, False)
        else:
            values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        if ASM:
            values = _int8_widen_asm(codes)
        else:
            values = codes.to(tl.int8, bitcast=True).to(tl.float16)
    return values


@triton.jit
def _widen_nibbles(codes, ELEMENT: tl.constexpr, ASM: tl.constexpr):
    """Packed 4-bit codes [BLOCK_N, HEAD_DIM / 2] uint8 -> (values at even head_dim indices, at odd ones), fp16."""
    if ASM:
        if ELEMENT == 0:
            low, high = _e2m1_widen_asm(codes)
        else:
            low, high = _int4_widen_asm(codes)
    else:
        wide = codes.to(tl.int32)
        low = _nibble_values(wide & 15, ELEMENT)
        high = _nibble_values(wide >> 4, ELEMENT)
    return low, high


@triton.jit
def _load_tile(CODES, SCALES, page, tok, t_mask, head, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
               stride_sh, CODE_BYTES: tl.constexpr, NUM_BLOCKS: tl.constexpr, PAGE_SIZE: tl.constexpr,
               BLOCK_SCALE: tl.constexpr):
    """The stored bytes of tokens `tok` ([BLOCK_N]) on pages `page`: codes [BLOCK_N, CODE_BYTES] uint8 and scales
    ([BLOCK_N, NUM_BLOCKS] uint8 bits, or [BLOCK_N] fp32 per token-head)."""
    offs_c = tl.arange(0, CODE_BYTES)
    slot = page * stride_cb + (tok % PAGE_SIZE) * stride_cs + head * stride_ch                     # [BLOCK_N]
    codes = tl.load(CODES + slot[:, None] + offs_c[None, :], mask=t_mask[:, None], other=0)
    row = page * stride_sb + (tok % PAGE_SIZE) * stride_ss + head * stride_sh
    if BLOCK_SCALE == 2:
        scales = tl.load(SCALES + row, mask=t_mask, other=0.0)
    else:
        offs_b = tl.arange(0, NUM_BLOCKS)
        scales = tl.load(SCALES + row[:, None] + offs_b[None, :], mask=t_mask[:, None], other=0)
    return codes, scales


@triton.jit
def _block_scales(scales, BLOCK_N: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCK_SCALE: tl.constexpr):
    """Stored scales -> (multiplier [BLOCK_N, NUM_BLOCKS] fp16 for the tile, the per-token factor [BLOCK_N] fp32
    still to apply): e4m3 (the block scales, 1), e8m0 (2^(e_jb - E_j), 2^E_j), fp32 per token-head (1, the
    token's scale)."""
    if BLOCK_SCALE == 2:
        multiplier = tl.full([BLOCK_N, NUM_BLOCKS], 1.0, tl.float16)
        factor = scales
    elif BLOCK_SCALE == 0:    # e4m3: exact in fp16
        multiplier = scales.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        factor = tl.full([BLOCK_N], 1.0, tl.float32)
    else:                     # e8m0, from the exponent bits: fp32 2^(e_jb - E_j) rounded to fp16 (0 below 2^-24)
        bits = scales.to(tl.int32)
        top = tl.maximum(tl.max(bits, axis=1), 1)                                               # E_j + 127, >= 1
        relative = tl.maximum(bits - top[:, None] + 127, 1)
        multiplier = (relative << 23).to(tl.float32, bitcast=True)
        multiplier = tl.where(bits == 255, float("nan"), multiplier).to(tl.float16)             # 255: a NaN scale
        factor = (top << 23).to(tl.float32, bitcast=True)                                       # 255: inf, then NaN
    return multiplier, factor


@triton.jit
def _scaled(values, multiplier, BLOCK_N: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCK_SCALE: tl.constexpr):
    """values [BLOCK_N, W] times their block's multiplier ([BLOCK_N, NUM_BLOCKS]: W / NUM_BLOCKS values a block)."""
    if BLOCK_SCALE != 2:
        W: tl.constexpr = values.shape[1]
        blocks = tl.reshape(values, BLOCK_N, NUM_BLOCKS, W // NUM_BLOCKS) * multiplier[:, :, None]
        values = tl.reshape(blocks, BLOCK_N, W)
    return values


@triton.jit
def _decode_attention_block_scaled_kernel(
    Q,                           # [B, Hq, D] bf16/fp16
    K_CODES, V_CODES,            # [num_blocks, page, Hkv, D * bits / 8] uint8
    K_BLOCK_SCALES, V_BLOCK_SCALES,   # [num_blocks, page, Hkv, D / BLOCK] uint8 bits, or [num_blocks, page, Hkv] fp32
    BLOCK_TABLE, SEQ_LENS,       # [B, max_blocks] int32, [B] int32
    K_SCALE, V_SCALE,            # fp32 [] or [Hkv] static scales (unread when HAS_SCALE is False)
    PART_OUT, PART_LSE,          # [B, Hq, splits, D] fp32, [B, Hq, splits] fp32 (base 2)
    sm_scale_log2, tokens_per_split, group, k_scale_stride, v_scale_stride,
    stride_qb, stride_qh,
    stride_cb, stride_cs, stride_ch,          # codes, shared by K and V (asserted)
    stride_sb, stride_ss, stride_sh,          # block scales, shared by K and V (asserted)
    stride_tb, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    Q_PE, K_PE,                  # MLA: [B, Hq, ROPE_DIM] and [num_blocks, page, ROPE_DIM] 16-bit (read when MLA)
    stride_pb, stride_ph, stride_eb, stride_es,
    BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, CODE_BYTES: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, ELEMENT: tl.constexpr, BLOCK_SCALE: tl.constexpr, BLOCK: tl.constexpr,
    HAS_SCALE: tl.constexpr, ASM: tl.constexpr, MLA: tl.constexpr = False, ROPE_DIM: tl.constexpr = 16,
):
    # MLA (`mla_decode_block_scaled`): K = [latent | k_pe], V = the latent (its widened tile reused), the latent's
    # "KV heads" are head blocks of BLOCK_G query heads over one latent (head strides 0); k_pe unscaled, it and q_pe
    # rounded to fp16 as q is (exact for bf16 values in fp16's normal range)
    kv_head = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    # 4-bit elements, two a byte: q . k = q_even . k_even + q_odd . k_odd, each byte's two values in separate dots
    # (no shuffle; head_dim >= 32, so each dot is at least 16 deep)
    PACKED: tl.constexpr = CODE_BYTES < HEAD_DIM
    NUM_BLOCKS: tl.constexpr = HEAD_DIM // BLOCK

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < group
    heads = kv_head * group + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None],
                other=0.0).to(tl.float16)                                                     # [BLOCK_G, D]
    if PACKED:
        q_even, q_odd = tl.split(tl.reshape(q, BLOCK_G, CODE_BYTES, 2))                      # [BLOCK_G, D / 2]
    qk_scale = sm_scale_log2
    v_scale = 1.0
    if HAS_SCALE:
        qk_scale = sm_scale_log2 * tl.load(K_SCALE + kv_head * k_scale_stride)
        v_scale = tl.load(V_SCALE + kv_head * v_scale_stride)
    if MLA:
        offs_r = tl.arange(0, ROPE_DIM)
        q_pe = tl.load(Q_PE + b * stride_pb + heads[:, None] * stride_ph + offs_r[None, :], mask=g_mask[:, None],
                       other=0.0).to(tl.float16)                                              # [BLOCK_G, ROPE_DIM]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)       # running max, base 2
    l_i = tl.zeros([BLOCK_G], tl.float32)                     # running sum of 2^(s - m)
    ACC_D: tl.constexpr = CODE_BYTES if PACKED else HEAD_DIM
    acc = tl.zeros([BLOCK_G, ACC_D], tl.float32)              # packed: the even head_dim indices
    acc_odd = tl.zeros([BLOCK_G, ACC_D], tl.float32)          # packed: the odd ones (unused otherwise)
    table_row = BLOCK_TABLE + b * stride_tb
    for n0 in range(start, end, BLOCK_N):
        t_mask = n0 + offs_n < end
        page = _decode_attention_pages(table_row, n0 + offs_n, t_mask, PAGE_SIZE)
        k_codes, k_scales = _load_tile(K_CODES, K_BLOCK_SCALES, page, n0 + offs_n, t_mask, kv_head, stride_cb,
                                       stride_cs, stride_ch, stride_sb, stride_ss, stride_sh, CODE_BYTES, NUM_BLOCKS,
                                       PAGE_SIZE, BLOCK_SCALE)
        if not MLA:
            v_codes, v_scales = _load_tile(V_CODES, V_BLOCK_SCALES, page, n0 + offs_n, t_mask, kv_head, stride_cb,
                                           stride_cs, stride_ch, stride_sb, stride_ss, stride_sh, CODE_BYTES,
                                           NUM_BLOCKS, PAGE_SIZE, BLOCK_SCALE)
        k_mult, k_factor = _block_scales(k_scales, BLOCK_N, NUM_BLOCKS, BLOCK_SCALE)
        if PACKED:
            k_even, k_odd = _widen_nibbles(k_codes, ELEMENT, ASM)                             # [BLOCK_N, D / 2]
            k_even = _scaled(k_even, k_mult, BLOCK_N, NUM_BLOCKS, BLOCK_SCALE)
            k_odd = _scaled(k_odd, k_mult, BLOCK_N, NUM_BLOCKS, BLOCK_SCALE)
            s = tl.dot(q_odd, tl.trans(k_odd), tl.dot(q_even, tl.trans(k_even)))             # [BLOCK_G, BLOCK_N]
        else:
            k = _scaled(_widen_bytes(k_codes, ELEMENT, ASM), k_mult, BLOCK_N, NUM_BLOCKS, BLOCK_SCALE)
            s = tl.dot(q, tl.trans(k))
        if BLOCK_SCALE == 0:
            s = s * qk_scale
        else:
            s = s * (k_factor * qk_scale)[None, :]
        if MLA:   # + q_pe . k_pe, unscaled
            pe_rows = page * stride_eb + ((n0 + offs_n) % PAGE_SIZE) * stride_es                      # [BLOCK_N]
            pe = tl.load(K_PE + pe_rows[:, None] + offs_r[None, :], mask=t_mask[:, None], other=0.0).to(tl.float16)
            s += tl.dot(q_pe, tl.trans(pe)) * sm_scale_log2
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MLA:
            v_factor = k_factor
        else:
            v_mult, v_factor = _block_scales(v_scales, BLOCK_N, NUM_BLOCKS, BLOCK_SCALE)
        tile_max = 1.0
        if BLOCK_SCALE != 0:   # V's per-token factor into P's columns, relative to the tile's largest
            v_factor = tl.where(t_mask, v_factor, 0.0)
            tile_max = tl.max(v_factor, axis=0)
            tile_max = tl.where(tile_max > 0, tile_max, 1.0)
            p = p * (v_factor / tile_max)[None, :]
        p16 = p.to(tl.float16)
        if PACKED:
            if MLA:   # V is the latent: K's widened, block-scaled halves
                v_even, v_odd = k_even, k_odd
            else:
                v_even, v_odd = _widen_nibbles(v_codes, ELEMENT, ASM)
                v_even = _scaled(v_even, v_mult, BLOCK_N, NUM_BLOCKS, BLOCK_SCALE)
                v_odd = _scaled(v_odd, v_mult, BLOCK_N, NUM_BLOCKS, BLOCK_SCALE)
            acc = acc * alpha[:, None] + tl.dot(p16, v_even) * tile_max
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p16, v_odd) * tile_max
        else:
            if MLA:
                v = k
            else:
                v = _scaled(_widen_bytes(v_codes, ELEMENT, ASM), v_mult, BLOCK_N, NUM_BLOCKS, BLOCK_SCALE)
            acc = acc * alpha[:, None] + tl.dot(p16, v) * tile_max
        m_i = m_new

    if PACKED:
        out = tl.reshape(tl.join(acc, acc_odd), BLOCK_G, HEAD_DIM)
    else:
        out = acc
    empty = l_i == 0.0                                       # split past the end of this sequence
    out = out * (v_scale / tl.where(empty, 1.0, l_i))[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_i))
    out_rows = PART_OUT + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(out_rows, out, mask=g_mask[:, None])
    tl.store(PART_LSE + b * stride_lb + heads * stride_lh + split, lse2, mask=g_mask)


def code_bytes(element: str, head_dim: int) -> int:
    return head_dim * ELEMENT_BITS[element] // 8


def _check_layout(codes, block_scales, scale, name: str, element: str, block_scale: str, block: int,
                  kv_heads: int, head_dim: int) -> None:
    expected = code_bytes(element, head_dim)
    assert codes.dim() == 4 and codes.shape[2:] == (kv_heads, expected) and codes.element_size() == 1, \
        f"{name} codes must be [num_blocks, page, {kv_heads}, {expected}] bytes, got {list(codes.shape)} {codes.dtype}"
    assert codes.stride(-1) == 1, f"{name} codes: the last dim must be contiguous"
    if block_scale == "fp32" and block < head_dim:   # fp32 scales per block (fp8_ds_mla's tiles of 128)
        shape = (*codes.shape[:3], head_dim // block)
        assert block_scales.dtype == torch.float32 and block_scales.shape == shape and block_scales.stride(-1) == 1, \
            f"{name} block scales must be fp32 {list(shape)}, contiguous last dim, got {list(block_scales.shape)} " \
            f"{block_scales.dtype}"
    elif block_scale == "fp32":
        assert block_scales.dtype == torch.float32 and block_scales.shape in (codes.shape[:3], (*codes.shape[:3], 1)), \
            f"{name} block scales must be fp32 [num_blocks, page, {kv_heads}], got {list(block_scales.shape)} " \
            f"{block_scales.dtype}"
    else:
        shape = (*codes.shape[:3], head_dim // block)
        assert block_scales.element_size() == 1 and block_scales.shape == shape and block_scales.stride(-1) == 1, \
            f"{name} block scales must be {list(shape)} bytes ({block_scale} bits), contiguous last dim, got " \
            f"{list(block_scales.shape)} {block_scales.dtype}"
    assert scale is None or (isinstance(scale, torch.Tensor) and scale.dtype == torch.float32
                             and scale.shape in ((), (kv_heads,))), \
        f"{name} scale must be None or an fp32 tensor of shape [] or [{kv_heads}], got {scale!r:.80}"


def _configuration(element: str, head_dim: int, device: torch.device, overrides: dict) -> dict:
    """The launch configuration: this GPU's entry (kernels/configs.py, measured at head_dim 128), the keywords
    given over it. Above head_dim 128 the entry's tile shrinks to the same bytes (block_n x head_dim): 128 x 256
    runs out of registers (Triton 3.9's sm_90 build of MXFP8's at 64 x 256 already holds 255)."""
    cfg = launch_config(CONFIG_KINDS[element], device) if device.type == "cuda" else dict(
        block_n=16, num_warps=4, num_stages=1, programs_per_sm=1, whole_waves=False, asm=False)
    if head_dim > 128 and device.type == "cuda":
        cfg.update(block_n=max(16, cfg["block_n"] * 128 // head_dim))
    cfg.update({key: value for key, value in overrides.items() if value is not None})
    return cfg


@on_tensor_device
def decode_attention_block_scaled(q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor,
                                  k_block_scales: torch.Tensor, v_block_scales: torch.Tensor,
                                  block_table: torch.Tensor, seq_lens: torch.Tensor, k_scale: torch.Tensor | None,
                                  v_scale: torch.Tensor | None, sm_scale: float, num_splits: int | None = None, *,
                                  element: str, block_scale: str, block_size: int, block_n: int | None = None,
                                  num_warps: int | None = None, num_stages: int | None = None,
                                  programs_per_sm: int | None = None, whole_waves: bool | None = None,
                                  asm: bool | None = None, impl: str | None = None, cuda_warps: int | None = None,
                                  ctas: int | None = None, cuda_prefetch: int | None = None,
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Hq, D] bf16/fp16, D a power of two in [16, 256]; codes / block scales / scales: the layout of
    kernels/reference.py ("Block-scaled caches"), K's and V's of one layout and strides; element: e2m1 | e4m3 |
    int8 | int4; block_scale: e4m3 | e8m0 | fp32 (one per token and head: block_size is D); block_table: [B,
    max_blocks] int32; seq_lens: [B] int32. Returns (out [B, Hq, D] q.dtype, lse [B, Hq] fp32 natural log).
    num_splits=None fills the GPU (kernels/decode_attention.py `plan_splits`); the launch keywords override this
    GPU's entry in kernels/configs.py; asm=False widens with plain Triton ops (the interpreter always does).
    impl: "cuda" (the CUDA kernel; a call it cannot serve raises ValueError saying why), "triton", or None: the
    entry's, the CUDA kernel where it serves the call and builds, else the Triton kernel; cuda_warps (warps a block),
    ctas (blocks an SM: its register budget and the split plan's programs per SM) and cuda_prefetch (tiles loaded
    ahead: 1 or 2) are the CUDA kernel's."""
    assert q.dim() == 3 and q.dtype in (torch.bfloat16, torch.float16), \
        f"q must be [B, Hq, D] bf16/fp16, got {list(q.shape)} {q.dtype}"
    batch, q_heads, head_dim = q.shape
    assert element in ELEMENTS and block_scale in BLOCK_SCALE_TYPES, \
        f"element {element!r} / block scale {block_scale!r}: expected one of {sorted(ELEMENTS)} / {BLOCK_SCALE_TYPES}"
    assert 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two in [16, 256], got {head_dim}"
    assert ELEMENT_BITS[element] == 8 or head_dim >= 32, f"4-bit elements need head_dim >= 32, got {head_dim}"
    block = head_dim if block_scale == "fp32" else block_size
    assert block_scale == "fp32" or (block in (16, 32) and head_dim % block == 0), \
        f"block_size must be 16 or 32 and divide head_dim {head_dim}, got {block_size}"
    kv_heads = k_codes.shape[2] if k_codes.dim() == 4 else -1
    assert kv_heads > 0 and q_heads % kv_heads == 0 and q_heads // kv_heads <= 16, \
        f"Hq={q_heads} must be 1-16 times Hkv={kv_heads}"
    for name, codes, scales, scale in (("k", k_codes, k_block_scales, k_scale), ("v", v_codes, v_block_scales, v_scale)):
        _check_layout(codes, scales, scale, name, element, block_scale, block, kv_heads, head_dim)
    assert k_codes.shape == v_codes.shape and k_codes.stride() == v_codes.stride() and \
        k_block_scales.stride() == v_block_scales.stride() and k_block_scales.dtype == v_block_scales.dtype, \
        "K and V must share one layout: shapes, strides and scale dtypes"
    assert (k_scale is None) == (v_scale is None), "give both static scales or neither"
    assert q.stride(-1) == 1, "q: head_dim must be contiguous"
    assert block_table.dim() == 2 and block_table.shape[0] == batch and block_table.dtype == torch.int32, \
        f"block_table must be [{batch}, max_blocks] int32, got {list(block_table.shape)} {block_table.dtype}"
    assert seq_lens.shape == (batch,) and seq_lens.dtype == torch.int32, \
        f"seq_lens must be [{batch}] int32, got {list(seq_lens.shape)} {seq_lens.dtype}"
    device = q.device
    assert device.type == "cuda" or interpreting(), f"Triton kernels need CUDA tensors, got {device}"
    scales = [s for s in (k_scale, v_scale) if s is not None]
    assert all(t.device == device for t in (k_codes, v_codes, k_block_scales, v_block_scales, block_table, seq_lens,
                                            *scales)), "all tensors must be on one device"
    cfg = _configuration(element, head_dim, device, dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                                               programs_per_sm=programs_per_sm, whole_waves=whole_waves, asm=asm,
                                               cuda_warps=cuda_warps, ctas=ctas, cuda_prefetch=cuda_prefetch))
    assert impl in (None, *IMPLS), f"impl must be one of {IMPLS} or None, got {impl!r}"
    if (impl or cfg.get("impl")) == "cuda":
        why = cuda_refusal(q, k_codes, k_block_scales, element, block_scale, block, v_codes, v_block_scales)
        if why is None:
            try:
                return gqa_decode_cuda.decode(q, k_codes, v_codes, k_block_scales, v_block_scales, block_table,
                                              seq_lens, k_scale, v_scale, sm_scale, num_splits,
                                              dict(cfg, layout=(element, block_scale, block)))
            except nvrtc.BuildError as e:
                why = str(e)
                if impl is None:
                    gqa_decode_cuda.warn_fallback("decode_attention_block_scaled", why)
        if impl == "cuda":
            raise ValueError(f"decode_attention_block_scaled(impl='cuda'): the CUDA kernel does not serve this call: "
                             f"{why}")
    assert not (cfg["asm"] and interpreting()), "the Triton interpreter runs no inline assembly: asm=False"
    block_n = cfg["block_n"]
    assert block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n must be a power of two >= 16, got {block_n}"
    page_size = k_codes.shape[1]
    max_tokens = block_table.shape[1] * page_size
    if device.type != "cuda" and num_splits is None:
        num_splits = 2                            # the interpreter: two splits, so the merge runs
    num_splits, tokens_per_split = plan_splits(max_tokens, batch * kv_heads, block_n, cfg["programs_per_sm"], device,
                                               num_splits, whole_waves=cfg.get("whole_waves", False))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    part_out, part_lse = partials(out, num_splits)
    s_strides = (k_block_scales.stride(0), k_block_scales.stride(1), k_block_scales.stride(2))
    _decode_attention_block_scaled_kernel[(kv_heads, batch, num_splits)](
        q, k_codes.view(torch.uint8), v_codes.view(torch.uint8),
        k_block_scales if block_scale == "fp32" else k_block_scales.view(torch.uint8),
        v_block_scales if block_scale == "fp32" else v_block_scales.view(torch.uint8),
        block_table, seq_lens, k_scale if scales else seq_lens, v_scale if scales else seq_lens,
        part_out, part_lse, sm_scale * LOG2E, tokens_per_split, q_heads // kv_heads,
        int(bool(scales) and k_scale.dim() == 1), int(bool(scales) and v_scale.dim() == 1),
        q.stride(0), q.stride(1), k_codes.stride(0), k_codes.stride(1), k_codes.stride(2), *s_strides,
        block_table.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0),
        part_lse.stride(1), q, q, 0, 0, 0, 0,
        BLOCK_G=16, HEAD_DIM=head_dim, CODE_BYTES=code_bytes(element, head_dim), PAGE_SIZE=page_size,
        BLOCK_N=block_n, ELEMENT=ELEMENTS[element], BLOCK_SCALE=SCALES[block_scale], BLOCK=block,
        HAS_SCALE=bool(scales), ASM=bool(cfg["asm"]), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, merge_splits(part_out, part_lse, out)



@on_tensor_device
def mla_decode_block_scaled(q_latent: torch.Tensor, q_pe: torch.Tensor, codes: torch.Tensor,
                            block_scales: torch.Tensor, k_pe: torch.Tensor, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, scale: torch.Tensor | None, sm_scale: float,
                            num_splits: int | None = None, *, element: str, block_scale: str, block_size: int,
                            block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                            asm: bool | None = None, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode (absorbed projections) over a block-scaled latent: the latent c_j in the paged layout of
    kernels/reference.py ("Block-scaled caches") with one KV head (codes [num_blocks, page, 1, Dc * bits / 8], block
    scales [num_blocks, page, 1, Dc / B] bits or fp32 [num_blocks, page, 1]), k_pe [num_blocks, page, Dr] in
    q_pe's 16-bit type, unscaled (the engines keep the RoPE part in 16 bits; the kernel rounds both to fp16, as it
    does q_latent):
        s_j = sm_scale * (q_latent . c_j + q_pe . k_pe_j),   out = sum_j softmax(s)_j c_j   (latent space).
    The GQA kernel above runs it: K = [c | k_pe], V = c (its widened tile reused), head blocks of up to 16 query
    heads as its "KV heads" over the one latent. q_latent: [B, H, Dc], q_pe: [B, H, Dr]; scale: the latent's static
    scale (fp32 [] or None). Returns (out [B, H, Dc] q_latent.dtype, lse [B, H] fp32 natural log). Mirror:
    `reference.mla_decode_block_scaled`.
    impl: None runs the CUDA kernel (kernels/mla_block_scaled_cuda.py: NVFP4, MX and fp8_ds_mla, latent 512 + 64, sm_90)
    where it serves the call and this Triton kernel elsewhere; "triton" this one; "cuda" the CUDA kernel or ValueError
    with the reason it cannot. fp32 scales per block (fp8_ds_mla: block_size 128; block_size 0 is one scale per token)
    only the CUDA kernel reads: elsewhere (impl None) the latent is dequantised to q's type and our BF16 MLA kernel
    runs, with a warning naming why."""
    batch, heads, latent_dim = q_latent.shape
    rope_dim = q_pe.shape[-1]
    assert q_latent.dtype in (torch.bfloat16, torch.float16) and q_pe.shape == (batch, heads, rope_dim), \
        f"q_latent [B, H, Dc] bf16/fp16 and q_pe [B, H, Dr], got {list(q_latent.shape)} {q_latent.dtype}, " \
        f"{list(q_pe.shape)}"
    assert k_pe.dim() == 3 and k_pe.shape[:2] == codes.shape[:2] and k_pe.shape[2] == rope_dim and \
        k_pe.dtype == q_pe.dtype and k_pe.stride(-1) == 1, \
        f"k_pe must be [num_blocks, page, {rope_dim}] {q_pe.dtype}, contiguous last dim, got {list(k_pe.shape)} " \
        f"{k_pe.dtype}"
    assert 16 <= rope_dim and rope_dim & (rope_dim - 1) == 0, f"rope_dim must be a power of two >= 16, got {rope_dim}"
    assert latent_dim & (latent_dim - 1) == 0 and 32 <= latent_dim <= 1024, \
        f"latent_dim must be a power of two in [32, 1024], got {latent_dim}"
    block = latent_dim if block_scale == "fp32" and not block_size else block_size
    _check_layout(codes, block_scales, scale, "latent", element, block_scale, block, 1, latent_dim)
    assert scale is None or scale.dim() == 0, "the latent's static scale is one value"
    assert impl in (None, "triton", "cuda"), f"impl must be None, 'triton' or 'cuda', got {impl!r}"
    scale_per_block = block_scale == "fp32" and block < latent_dim   # the Triton kernel reads one fp32 scale a token
    assert not (scale_per_block and impl == "triton"), \
        f"the Triton kernel reads one fp32 scale per token, not one per {block} values (fp8_ds_mla): impl None or " \
        "'cuda'"
    if impl != "triton":
        why = mla_block_scaled_cuda.refusal(q_latent, q_pe, codes, block_scales, k_pe, element, block_scale, block,
                                            scale)
        if why is None:
            try:
                return mla_block_scaled_cuda.decode(q_latent, q_pe, codes, block_scales, k_pe, block_table, seq_lens,
                                                    scale, sm_scale, num_splits, (element, block_scale, block))
            except nvrtc.BuildError as error:   # this machine's NVRTC or driver refused it: another kernel runs
                if impl == "cuda":
                    raise
                why = str(error)
                gqa_decode_cuda.warn_fallback("mla_decode_block_scaled", why, "kernels/mla_decode_block_scaled.cu")
        elif impl == "cuda":
            raise ValueError(f"impl='cuda' cannot run: {why}")
        if scale_per_block:
            return _mla_dequantised(q_latent, q_pe, codes, block_scales, k_pe, block_table, seq_lens, scale, sm_scale,
                                    num_splits, why, element=element, block_scale=block_scale, block_size=block)
    assert q_latent.stride(-1) == 1 and q_pe.stride(-1) == 1, "q_latent / q_pe: the last dim must be contiguous"
    device = q_latent.device
    assert device.type == "cuda" or interpreting(), f"Triton kernels need CUDA tensors, got {device}"
    cfg = _configuration(element, latent_dim, device, dict(block_n=block_n, num_warps=num_warps,
                                                           num_stages=num_stages, asm=asm))
    assert not (cfg["asm"] and interpreting()), "the Triton interpreter runs no inline assembly: asm=False"
    block_n = cfg["block_n"]
    # head blocks of up to 16 heads (the kernel's BLOCK_G rows), each a divisor of H: no block reaches past H
    block_h = max(d for d in range(1, 17) if heads % d == 0)
    head_blocks = heads // block_h
    page_size = codes.shape[1]
    if device.type != "cuda" and num_splits is None:
        num_splits = 2                            # the interpreter: two splits, so the merge runs
    num_splits, tokens_per_split = plan_splits(block_table.shape[1] * page_size, batch * head_blocks, block_n,
                                               cfg["programs_per_sm"], device, num_splits,
                                               whole_waves=cfg.get("whole_waves", False))
    out = torch.empty_like(q_latent, memory_format=torch.contiguous_format)
    part_out, part_lse = partials(out, num_splits)
    scales = block_scales if block_scale == "fp32" else block_scales.view(torch.uint8)
    latent = codes.view(torch.uint8)
    _decode_attention_block_scaled_kernel[(head_blocks, batch, num_splits)](
        q_latent, latent, latent, scales, scales, block_table, seq_lens,
        scale if scale is not None else seq_lens, scale if scale is not None else seq_lens,
        part_out, part_lse, sm_scale * LOG2E, tokens_per_split, block_h, 0, 0,
        q_latent.stride(0), q_latent.stride(1), latent.stride(0), latent.stride(1), 0,
        scales.stride(0), scales.stride(1), 0,
        block_table.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0),
        part_lse.stride(1), q_pe, k_pe, q_pe.stride(0), q_pe.stride(1), k_pe.stride(0), k_pe.stride(1),
        BLOCK_G=16, HEAD_DIM=latent_dim, CODE_BYTES=code_bytes(element, latent_dim), PAGE_SIZE=page_size,
        BLOCK_N=block_n, ELEMENT=ELEMENTS[element], BLOCK_SCALE=SCALES[block_scale], BLOCK=block,
        HAS_SCALE=scale is not None, ASM=bool(cfg["asm"]), MLA=True, ROPE_DIM=rope_dim,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out, merge_splits(part_out, part_lse, out)


_DEQUANTISED_WARNED: set = set()


def _mla_dequantised(q_latent, q_pe, codes, block_scales, k_pe, block_table, seq_lens, scale, sm_scale: float,
                     num_splits: int | None, why: str, **layout) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode over a latent the CUDA kernel refused and the Triton kernel cannot read (fp32 scales per block):
    the latent dequantised (kernels/reference.py) to q's type beside k_pe, then our BF16 MLA kernel (kernels/
    mla_decode.py; CPU tensors: its torch mirror): the error yardstick of the kernel tests, so within 1.0x of it by
    definition, and slower (the whole cache is widened each call). Warns once per reason."""
    from kernels import reference
    from kernels.mla_decode import mla_decode as bf16_mla_decode

    mla_decode = bf16_mla_decode if q_latent.device.type == "cuda" else reference.mla_decode
    if why not in _DEQUANTISED_WARNED:
        _DEQUANTISED_WARNED.add(why)
        warnings.warn(f"mla_decode_block_scaled: the CUDA kernel cannot run ({why}); the latent is dequantised to "
                      f"{q_latent.dtype} and our BF16 MLA kernel runs instead", RuntimeWarning, stacklevel=3)
    latent = reference.dequantize_block_scaled(codes, block_scales, scale, **layout)[:, :, 0]
    cache = torch.cat([latent, k_pe.float()], dim=-1).to(q_latent.dtype)
    return mla_decode(q_latent, q_pe, cache, block_table, seq_lens, None, sm_scale, num_splits)
