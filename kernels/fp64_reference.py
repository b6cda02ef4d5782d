"""The kernel check's truth on CUDA for a GQA cache of plain FP8 codes: fp64 attention over the codes a paged cache
holds, without an fp64 copy of the cache. Each code is read once and made its value through a 256-entry fp64 table
that torch's own cast of every byte builds (`code_values`: what `codes.double()` gives), so the truth shares no FP8
arithmetic with the kernels it judges; the products and sums are fp64.

Torch's way (`harness.kv_paths.attention.PagedKV._exact_rows` on the CPU) widens K and V to fp64 (8 bytes a code
written, then read by fp64 GEMMs): at a 16 x 8k prompt's end (8B shape, H200) 43.9 ms of widening and 21.2 ms of
fp64 GEMMs of an FP8 prefill's check work (BENCHMARKS.md, sessions 29-30); these kernels took 17.6 + 11.3 ms there
(session 43).

    scores = code_scores(q, k_codes, rows, span, table)       # [n, Hkv, G, span]: q . K over the stored values
    out = weighted_codes(weights, v_codes, rows, span, table)  # [n, Hkv, G, D]: weights . V

q: [n, Hkv, G, D] fp64 (the query heads of each KV head, any scale applied), codes: [R, slots, Hkv, D] FP8 (a row's
slots in order; `rows[i]` is query row i's), weights: [n, Hkv, G, span] fp64. Both sum in a fixed order (the same bits
each run): scores over D in one program, the weighted sum over the span in parts of SPLIT_TOKENS (each part a sum per
key slot of its loop, then over the slots), the parts added by torch.
Every product is computed, as a GEMM does: a NaN code past a row's length reaches its sums as it would there."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.decode_attention import on_tensor_device
from kernels.reference import is_fp8
from kernels.store_kv import _check_cuda

SCORE_TOKENS = 32     # keys a program of `code_scores`
SPLIT_TOKENS = 256    # keys a program of `weighted_codes` (its partial sums, added in a fixed order)
SUM_TOKENS = 8        # keys a step of that program's loop (a [G, 8, D] fp64 sum, added over the keys at the end)


def code_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256] fp64: the value of each FP8 byte as torch's cast gives it (NaN codes NaN, e5m2's inf codes inf)."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(dtype).double()


@triton.jit
def _code_scores_kernel(Q, CODES, ROWS, TABLE, OUT, span,
                        sq0, sq1, sq2, sq3, sc0, sc1, sc2, sc3, so0, so1, so2, so3,
                        G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    row = tl.load(ROWS + i).to(tl.int64)
    m = (offs_s < span)[:, None] & (offs_d < D)[None, :]
    codes = tl.load(CODES + row * sc0 + offs_s[:, None].to(tl.int64) * sc1 + h * sc2 + offs_d[None, :] * sc3,
                    mask=m, other=0)
    values = tl.load(TABLE + codes.to(tl.int32), mask=m, other=0.0)   # [S, D] fp64
    for g in tl.static_range(G):
        qg = tl.load(Q + i * sq0 + h * sq1 + g * sq2 + offs_d * sq3, mask=offs_d < D, other=0.0)
        tl.store(OUT + i * so0 + h * so1 + g * so2 + offs_s * so3, tl.sum(values * qg[None, :], axis=1),
                 mask=offs_s < span)


@triton.jit
def _weighted_codes_kernel(W, CODES, ROWS, TABLE, PARTS, span,
                           sw0, sw1, sw2, sw3, sc0, sc1, sc2, sc3,
                           G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                           SPLIT: tl.constexpr, BLOCK_S: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    row = tl.load(ROWS + i).to(tl.int64)
    acc = tl.zeros((BLOCK_G, BLOCK_S, BLOCK_D), dtype=tl.float64)   # summed over its keys once, at the end
    for s0 in range(split * SPLIT, tl.minimum(split * SPLIT + SPLIT, span), BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        in_s = offs_s < span
        m = in_s[:, None] & (offs_d < D)[None, :]
        codes = tl.load(CODES + row * sc0 + offs_s[:, None].to(tl.int64) * sc1 + h * sc2 + offs_d[None, :] * sc3,
                        mask=m, other=0)
        values = tl.load(TABLE + codes.to(tl.int32), mask=m, other=0.0)   # [S, D]
        w = tl.load(W + i * sw0 + h * sw1 + offs_g[:, None] * sw2 + offs_s[None, :] * sw3,
                    mask=(offs_g < G)[:, None] & in_s[None, :], other=0.0)  # [G, S]
        acc += w[:, :, None] * values[None, :, :]
    out = PARTS + ((i * tl.num_programs(1) + h) * tl.num_programs(2) + split) * BLOCK_G * BLOCK_D
    tl.store(out + offs_g[:, None] * BLOCK_D + offs_d[None, :], tl.sum(acc, axis=1))


def _codes_args(codes: torch.Tensor, rows: torch.Tensor, span: int, table: torch.Tensor) -> torch.Tensor:
    assert is_fp8(codes.dtype) and codes.dim() == 4, f"codes must be [R, slots, Hkv, D] FP8, got {codes.dtype}"
    assert span <= codes.shape[1], f"span {span} is past the {codes.shape[1]} slots a row holds"
    assert table.dtype == torch.float64 and table.numel() == 256, "table: code_values(codes.dtype, device)"
    assert rows.dim() == 1 and not rows.is_floating_point(), "rows: [n] integer indices into codes' first dim"
    return codes.view(torch.uint8)


@on_tensor_device
def code_scores(q: torch.Tensor, codes: torch.Tensor, rows: torch.Tensor, span: int,
                table: torch.Tensor) -> torch.Tensor:
    """[n, Hkv, G, span] fp64: q [n, Hkv, G, D] fp64 times the stored values of row rows[i]'s first `span` keys."""
    raw = _codes_args(codes, rows, span, table)
    n, kv_heads, group, dim = q.shape
    assert q.dtype == torch.float64 and (kv_heads, dim) == tuple(codes.shape[2:]) and rows.shape[0] == n, \
        f"q must be [{rows.shape[0]}, {codes.shape[2]}, G, {codes.shape[3]}] fp64, got {list(q.shape)} {q.dtype}"
    _check_cuda(q, raw, rows, table)
    out = torch.empty(n, kv_heads, group, span, dtype=torch.float64, device=q.device)
    if out.numel():
        _code_scores_kernel[(n, kv_heads, triton.cdiv(span, SCORE_TOKENS))](
            q, raw, rows, table, out, span, *q.stride(), *raw.stride(), *out.stride(), G=group, D=dim,
            BLOCK_D=triton.next_power_of_2(dim), BLOCK_S=SCORE_TOKENS, num_warps=4)
    return out


@on_tensor_device
def weighted_codes(weights: torch.Tensor, codes: torch.Tensor, rows: torch.Tensor, span: int,
                   table: torch.Tensor) -> torch.Tensor:
    """[n, Hkv, G, D] fp64: weights [n, Hkv, G, span] fp64 times the stored values of row rows[i]'s first `span`
    values, summed over the span in parts of SPLIT_TOKENS (each in one program's order), the parts added in order."""
    raw = _codes_args(codes, rows, span, table)
    n, kv_heads, group, length = weights.shape
    dim = codes.shape[3]
    assert weights.dtype == torch.float64 and length == span and kv_heads == codes.shape[2] and rows.shape[0] == n, \
        f"weights must be [{rows.shape[0]}, {codes.shape[2]}, G, {span}] fp64, got {list(weights.shape)}"
    _check_cuda(weights, raw, rows, table)
    block_g, block_d = triton.next_power_of_2(group), triton.next_power_of_2(dim)
    splits = triton.cdiv(span, SPLIT_TOKENS)
    parts = torch.empty(n, kv_heads, max(splits, 1), block_g, block_d, dtype=torch.float64, device=weights.device)
    if span == 0:
        return torch.zeros(n, kv_heads, group, dim, dtype=torch.float64, device=weights.device)
    if n:
        _weighted_codes_kernel[(n, kv_heads, splits)](
            weights, raw, rows, table, parts, span, *weights.stride(), *raw.stride(), G=group, D=dim,
            BLOCK_G=block_g, BLOCK_D=block_d, SPLIT=SPLIT_TOKENS, BLOCK_S=SUM_TOKENS, num_warps=4)
    return parts.sum(2)[:, :, :group, :dim]
