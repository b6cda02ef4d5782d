"""Torch reference for the FP8 KV-cache ops: the CPU truth that kernels and the harness agree with.

Convention (vLLM, SGLang, TRT-LLM): stored = fp8(x / scale), read = fp8 * scale, math in fp32.
e4m3 is OCP `float8_e4m3fn` (max 448, no inf); e5m2 is `float8_e5m2` (max 57344, has inf).
Kernel launchers in this folder mirror the op names defined here.
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}  # largest finite value of each format
# Smallest scale we hand out for an all-zero tensor: keeps x / scale finite and reads back zeros.
MIN_SCALE = 1e-12


def fp8_dtype(fmt: str) -> torch.dtype:
    assert fmt in FP8_DTYPES, f"unknown fp8 format {fmt!r}; expected one of {sorted(FP8_DTYPES)}"
    return FP8_DTYPES[fmt]


# |x / s| beyond which a non-saturating cast overflows: max + half an ulp (448 + 16, 57344 + 4096).
# At exactly that value e4m3 ties to even (448), e5m2 ties to even (inf), hence > and >= below.
OVERFLOW_AT = {"e4m3": 464.0, "e5m2": 61440.0}


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: str, saturate: bool = True) -> torch.Tensor:
    """fp8(x / scale), round to nearest even. Saturating clamps finite overflow and +-inf to +-max (NaN
    stays NaN); non-saturating overflows as the OCP cast without saturation: e4m3 (no inf) to NaN, e5m2 to
    +-inf. Written out rather than left to torch's plain cast, which saturates e4m3 from torch 2.12 on
    (pytorch#178817) and gave NaN before; in-range values are torch's cast either way."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.dim():
        # x widened as the division reads it (a dimensioned fp32 divisor promotes the op to fp32): x.float() / scale
        # to the bit, without the widened copy; a new tensor, never x
        scaled = x / (scale.reshape(1) if scale.dim() == 0 else scale)
    else:
        scaled = x.float() / scale
    limit = FP8_MAX[fmt]
    if saturate:
        scaled.clamp_(-limit, limit)   # NaN stays NaN, sign and payload (torch's clamp); in place: one pass, no copy
    elif fmt == "e4m3":
        scaled = torch.where(scaled.abs() > OVERFLOW_AT[fmt], torch.copysign(torch.tensor(float("nan")), scaled), scaled)
    else:
        scaled = torch.where(scaled.abs() >= OVERFLOW_AT[fmt], torch.copysign(torch.tensor(float("inf")), scaled), scaled)
    return scaled.to(fp8_dtype(fmt))


def dequantize(codes: torch.Tensor, scale: torch.Tensor | float, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 * scale, multiplied in fp32, cast once to `out_dtype`."""
    return (codes.float() * torch.as_tensor(scale, dtype=torch.float32, device=codes.device)).to(out_dtype)


def amax_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """Scale that maps `amax` onto the format's largest value: amax / 448 (e4m3) or amax / 57344 (e5m2).
    Divided by a tensor: on CUDA torch divides by a Python scalar as a multiplication by its reciprocal, one bit
    off IEEE division for 71 of the 128 bf16 mantissas, which moves e4m3 ties (and the kernels divide exactly)."""
    amax = amax.float()
    return (amax / torch.full_like(amax, FP8_MAX[fmt])).clamp_min(MIN_SCALE)


def per_token_scale(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Dynamic per-token scale over the last dim: x [..., D] -> scale [..., 1]."""
    return amax_scale(x.float().abs().amax(dim=-1, keepdim=True), fmt)


# ---------------------------------------------------------------------------------------------------
# Paged-cache ops. Layouts (vLLM-style paging: slot = block * block_size + offset):
#   k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]   fp8 codes, or bf16/fp16 values
#   latent cache:     [num_blocks, block_size, latent_dim + rope_dim] (MLA: kv_c_normed then k_pe)
#   block_table:      [batch, max_blocks] int32, seq_lens: [batch] int32, slot_mapping: [tokens] int64
# An fp8 cache is read as codes * scale; a bf16/fp16 cache is read as is and its scales are ignored
# (failure class 3: a checkpoint's k_scale must never touch a BF16 cache).
# ---------------------------------------------------------------------------------------------------

def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES.values()


def fp8_format(dtype: torch.dtype) -> str:
    return next(fmt for fmt, d in FP8_DTYPES.items() if d == dtype)


def _head_scale(scale: torch.Tensor | float | None, trailing_dims: int) -> torch.Tensor:
    """Scale [] or [heads] -> broadcastable over [..., heads, *trailing] (a [] scale stays [])."""
    s = torch.as_tensor(1.0 if scale is None else scale, dtype=torch.float32)
    return s.reshape(s.shape + (1,) * trailing_dims) if s.dim() else s


def _encode(x: torch.Tensor, cache_dtype: torch.dtype, scale, saturate: bool) -> torch.Tensor:
    """Bytes to write: fp8(x / scale) for an fp8 cache, a plain cast otherwise (scale ignored)."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    return quantize(x, scale.to(x.device), fp8_format(cache_dtype), saturate)


def _write_slots(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """cache.flatten(0, 1)[slot] = row for every slot >= 0 (fp8 written through a uint8 view)."""
    assert cache.is_contiguous(), "reference writes need a contiguous cache"
    keep = slot_mapping >= 0
    flat = cache.view(-1, *cache.shape[2:])                          # [num_blocks * block_size, ...]
    if is_fp8(cache.dtype):
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat[slot_mapping[keep].to(flat.device)] = rows[keep.to(rows.device)].to(flat.device)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale, v_scale, saturate: bool = True) -> None:
    """Write token n's K/V ([N, kv_heads, head_dim]) into slot slot_mapping[n]; slot -1 skips the token.
    fp8 cache: fp8(x / scale) with scale [] (per tensor) or [kv_heads] (per head); bf16 cache: copy."""
    _write_slots(k_cache, slot_mapping, _encode(key, k_cache.dtype, _head_scale(k_scale, 1), saturate))
    _write_slots(v_cache, slot_mapping, _encode(value, v_cache.dtype, _head_scale(v_scale, 1), saturate))


def store_latent(latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                 slot_mapping: torch.Tensor, scale, saturate: bool = True) -> None:
    """MLA: write [latent | k_pe] ([N, Dc] and [N, Dr]) as one cache row, one scale [] for both."""
    rows = torch.cat([latent, k_pe], dim=-1)                          # [N, Dc + Dr]
    _write_slots(cache, slot_mapping, _encode(rows, cache.dtype, _head_scale(scale, 0), saturate))


def square_error_sums(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      valid: torch.Tensor | None = None) -> torch.Tensor:
    """The write check's sums (`kernels/write_check.py`): [R, 2] fp64, per row the sums over (H, C, D) of
    (a - x)^2 and (b - x)^2, each in fp32 (NaN and +inf squares 0), summed in fp64; tokens with valid[r, c] == 0
    not counted. x, a, b: [R, H, C, D]; valid: [R, C] or None."""
    sums = []
    for read in (a, b):  # float32, one tensor at a time: a long prefill's write is large
        error = torch.nan_to_num((read.float() - x.float()).square_(), nan=0.0, posinf=0.0)
        if valid is not None:
            error = torch.where(valid.bool()[:, None, :, None], error, 0.0)
        sums.append(error.sum((1, 2, 3), dtype=torch.float64))
    return torch.stack(sums, 1)


def _read_sequence(cache: torch.Tensor, table_row: torch.Tensor, seq_len: int, scale, trailing_dims: int):
    """The first seq_len cache rows of one sequence, in token order, as fp32 values."""
    num_pages = -(-seq_len // cache.shape[1])
    pages = table_row[:num_pages].long().to(cache.device)
    raw = cache.view(torch.uint8)[pages].view(cache.dtype) if is_fp8(cache.dtype) else cache[pages]
    rows = raw.flatten(0, 1)[:seq_len]                                # [seq_len, ...]
    if not is_fp8(cache.dtype):
        return rows.float()
    return dequantize(rows, _head_scale(scale, trailing_dims).to(rows.device))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, k_scale, v_scale, sm_scale: float,
                     num_splits: int | None = None, *, q_scale: torch.Tensor | str | None = None,
                     prob_scale: torch.Tensor | None = None, block_n: int = 128,
                     tokens_per_split: int | None = None, sinks: torch.Tensor | None = None,
                     softcap: float | None = None,
                     first_key: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged GQA decode: for query head h of sequence b, over its cached tokens j in first_key[b] .. seq_lens[b] - 1
    (first_key None: 0),
        s_j = sm_scale * q[b, h] . K_j[h // group]   (softcap: softcap * tanh(s_j / softcap)),
        out = sum_j exp(s_j - lse) V_j[h // group],
        lse = log(exp(sinks[h]) + sum_j exp(s_j))   (natural log; no sink term without sinks; -inf for no token).
    q: [B, Hq, D] -> (out [B, Hq, D] in q.dtype, lse [B, Hq] fp32). num_splits is a kernel knob only.
    With q_scale / prob_scale: the FP8 attention of `kernels/decode_attention.py` (`decode_attention_fp8`),
    whose P quantisation depends on the kernel's tiles (block_n) and splits (tokens_per_split; None: one)."""
    del num_splits
    if q_scale is not None or prob_scale is not None:
        assert sinks is None and softcap is None and first_key is None, \
            "the FP8 attention mirror has no sinks, soft-capping or window"
        out, lse = decode_attention_fp8(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, sm_scale,
                                        q_scale, prob_scale, block_n, tokens_per_split)
        return out.to(q.dtype), lse.float()
    batch, q_heads, _ = q.shape
    group = q_heads // k_cache.shape[2]
    out = torch.zeros_like(q)
    lse = torch.empty(batch, q_heads, dtype=torch.float32, device=q.device)
    for b in range(batch):
        seq_len, first = int(seq_lens[b]), int(first_key[b]) if first_key is not None else 0
        k = _read_sequence(k_cache, block_table[b], seq_len, k_scale, 1).repeat_interleave(group, dim=1)[first:]
        v = _read_sequence(v_cache, block_table[b], seq_len, v_scale, 1).repeat_interleave(group, dim=1)[first:]
        scores = torch.einsum("hd,lhd->hl", q[b].float().to(k.device), k) * sm_scale  # [Hq, tokens]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        total = scores if sinks is None else torch.cat([scores, sinks.float().to(k.device)[:, None]], dim=-1)
        row_lse = torch.logsumexp(total, dim=-1, keepdim=True)  # [Hq, 1]
        lse[b] = row_lse[:, 0].to(lse.device)
        # no token: -inf - -inf, an empty sum; a NaN code's NaN stays NaN, as in the kernel
        weights = torch.exp(scores - row_lse).masked_fill(torch.isneginf(row_lse), 0.0)
        out[b] = torch.einsum("hl,lhd->hd", weights, v).to(q.dtype).to(q.device)
    return out, lse


def quantize_query(q: torch.Tensor, q_scale: torch.Tensor | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel's Q in e4m3: (codes as fp64 values, scale [..., Hq, 1] fp64) for q [..., Hq, D];
    q_scale "dynamic" (per head: amax / 448, 1 where amax is 0) or fp32 [] / [Hq]."""
    qf = q.float()
    if isinstance(q_scale, str):
        amax = qf.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax_scale(amax, "e4m3"), torch.ones_like(amax))   # IEEE division, as the kernel
    else:
        scale = torch.as_tensor(q_scale, dtype=torch.float32, device=q.device)
        scale = scale.reshape(-1, 1) if scale.dim() else scale
    return quantize(qf, scale, "e4m3").double(), torch.as_tensor(scale, device=q.device).double()


def decode_attention_fp8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, k_scale, v_scale, sm_scale: float,
                         q_scale: torch.Tensor | str | None, prob_scale: torch.Tensor | None,
                         block_n: int = 128, tokens_per_split: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 emulation of the decode kernel's FP8 attention (definition in kernels/decode_attention.py):
    Q rounded to e4m3 under q_scale; P rounded as the online softmax holds it, p_j = exp(s_j - m_t(j)) with
    m_t the running max of j's split up to the end of j's tile (tiles of block_n tokens; splits of
    tokens_per_split, a multiple of block_n, None: one split), p8_j = e4m3(p_j * fp32(1 / prob_scale)):
        out = prob_scale * sum_j exp(m_t(j) - M) p8_j V_j / sum_j exp(s_j - M)   (exact split merge).
    Returns (out [B, Hq, D] fp64, lse [B, Hq] fp64)."""
    batch, q_heads, head_dim = q.shape
    group = q_heads // k_cache.shape[2]
    q64 = _query_fp64(q, q_scale)
    out = torch.zeros(batch, q_heads, head_dim, dtype=torch.float64, device=q.device)
    lse = torch.full((batch, q_heads), float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        k = (_read_sequence(k_cache, block_table[b], n, None, 1).double() if not is_fp8(k_cache.dtype) else
             _read_sequence(k_cache, block_table[b], n, 1.0, 1).double() *
             _head_scale(k_scale, 1).double().to(k_cache.device))
        v = (_read_sequence(v_cache, block_table[b], n, None, 1).double() if not is_fp8(v_cache.dtype) else
             _read_sequence(v_cache, block_table[b], n, 1.0, 1).double() *
             _head_scale(v_scale, 1).double().to(v_cache.device))
        k, v = k.repeat_interleave(group, dim=1).to(q.device), v.repeat_interleave(group, dim=1).to(q.device)
        scores = torch.einsum("hd,lhd->hl", q64[b], k) * sm_scale                        # [Hq, n]
        lse[b] = torch.logsumexp(scores, dim=-1)
        if prob_scale is None:
            out[b] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v)
            continue
        weights, denominator = _fp8_prob_weights(scores, prob_scale, block_n, tokens_per_split)
        out[b] = torch.einsum("hl,lhd->hd", weights, v) / denominator
    return out, lse


def _query_fp64(q: torch.Tensor, q_scale: torch.Tensor | str | None) -> torch.Tensor:
    """The query the FP8-attention kernels multiply, in fp64: q itself, or its e4m3 codes x q_scale."""
    if q_scale is None:
        return q.double()
    codes, scale = quantize_query(q, q_scale)
    return codes * scale.to(codes.device)


def _fp8_prob_weights(scores: torch.Tensor, prob_scale: torch.Tensor, block_n: int,
                      tokens_per_split: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' tile-relative FP8 P for scores [H, n] fp64: (weights [H, n], denominator [H, 1]) with
    out = weights @ V / denominator; p8_j = e4m3(exp(s_j - m_t(j)) * fp32(1 / prob_scale)), the reciprocal an
    IEEE division (computed on the CPU), weights_j = p8_j exp(m_t(j) - M) prob_scale."""
    n = scores.shape[-1]
    m_tile = _running_tile_max(scores, block_n, tokens_per_split or -(-n // block_n) * block_n)
    scale = torch.as_tensor(prob_scale, dtype=torch.float32).cpu()
    inv = (torch.ones(()) / scale).double().to(scores.device)
    p8 = quantize(torch.exp(scores - m_tile) * inv, 1.0, "e4m3").double()
    top = scores.amax(dim=-1, keepdim=True)
    weights = p8 * torch.exp(m_tile - top) * scale.double().to(scores.device)
    return weights, torch.exp(scores - top).sum(-1, keepdim=True)


def _running_tile_max(scores: torch.Tensor, block_n: int, tokens_per_split: int) -> torch.Tensor:
    """For each token j of scores [H, n]: the max of its split's scores up to the end of its tile."""
    assert tokens_per_split % block_n == 0, f"tokens_per_split {tokens_per_split} is not a multiple of {block_n}"
    heads, n = scores.shape
    tiles = -(-n // block_n)
    per_split = tokens_per_split // block_n
    splits = -(-tiles // per_split)
    padded = torch.full((heads, splits * per_split * block_n), float("-inf"), dtype=scores.dtype, device=scores.device)
    padded[:, :n] = scores
    tile_max = padded.view(heads, splits, per_split, block_n).amax(-1)                  # [H, splits, tiles/split]
    running = tile_max.cummax(dim=-1).values.reshape(heads, -1)                          # [H, tiles]
    return running.repeat_interleave(block_n, dim=1)[:, :n]


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale, sm_scale: float, num_splits: int | None = None, *,
               q_scale: torch.Tensor | str | None = None, prob_scale: torch.Tensor | None = None, block_n: int = 32,
               tokens_per_split: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode with absorbed projections over a latent cache row [c (Dc) | k_pe (Dr)]:
        s_j = sm_scale * (q_latent . c_j + q_pe . k_pe_j),   out = sum_j softmax(s)_j c_j  (latent space),
        lse = log sum_j exp(s_j). q_latent: [B, H, Dc], q_pe: [B, H, Dr] -> (out [B, H, Dc], lse [B, H]).
    With q_scale / prob_scale: the FP8 attention of `kernels/mla_decode.py` (`mla_decode_fp8`; block_n and
    tokens_per_split as the kernel's launch tiles and splits the sequence)."""
    del num_splits
    if q_scale is not None or prob_scale is not None:
        out, lse = mla_decode_fp8(q_latent, q_pe, cache, block_table, seq_lens, scale, sm_scale, q_scale, prob_scale,
                                  block_n, tokens_per_split)
        return out.to(q_latent.dtype), lse.float()
    batch, heads, latent_dim = q_latent.shape
    out = torch.zeros_like(q_latent)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=q_latent.device)
    for b in range(batch):
        rows = _read_sequence(cache, block_table[b], int(seq_lens[b]), scale, 0)   # [seq_len, Dc + Dr]
        c, pe = rows[:, :latent_dim], rows[:, latent_dim:]
        scores = (q_latent[b].float().to(c.device) @ c.T + q_pe[b].float().to(c.device) @ pe.T) * sm_scale
        lse[b] = torch.logsumexp(scores, dim=-1).to(lse.device)
        out[b] = (torch.softmax(scores, dim=-1) @ c).to(q_latent.dtype).to(q_latent.device)
    return out, lse


# ---------------------------------------------------------------------------------------------------
# FP8 attention (engines' q_scale / prob_scale): the query and/or the softmax probabilities rounded to
# FP8 before their matmuls, as vLLM's attention quantisation and FP8 FlashAttention-3 / FlashMLA do.
# ---------------------------------------------------------------------------------------------------

def attention_fp8(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                  mask: torch.Tensor | None, q_scale: torch.Tensor | str | None,
                  prob_scale: torch.Tensor | None, fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """query [B, Hq, T, D], key [B, Hkv, L, D], value [B, Hkv, L, Dv] (L >= T; the T queries are the last T
    positions). mask: None (causal), bool [B, 1|Hq, T, L] (True = attend) or additive float. q_scale: a
    scale, "dynamic" (per query token: amax / fp8 max) or None (query kept); prob_scale: a scale or None.
    Math in fp32: q' = fp8(q / sq) * sq; P = softmax(q' K^T * scaling); P' = fp8(P / sp) * sp; O = P' V.
    Returns (O [B, T, Hq, Dv] in query's dtype, the query actually used, in query's dtype)."""
    q = query.float()
    if isinstance(q_scale, str):
        q = dequantize(quantize(q, per_token_scale(q, fmt), fmt), per_token_scale(q, fmt))
    elif q_scale is not None:
        q = dequantize(quantize(q, q_scale, fmt), q_scale)
    group = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    logits = (q @ k.transpose(-1, -2)) * scaling  # [B, Hq, T, L]
    length, chunk = key.shape[2], query.shape[2]
    if mask is None:
        rows = torch.arange(chunk, device=q.device).unsqueeze(1) + (length - chunk)
        mask = torch.arange(length, device=q.device).unsqueeze(0) <= rows
    if mask.dtype == torch.bool:
        logits = logits.masked_fill(~mask, float("-inf"))
    else:
        logits = logits + mask.float()
    probs = torch.softmax(logits, dim=-1)
    if prob_scale is not None:
        probs = dequantize(quantize(probs, prob_scale, fmt), prob_scale)
    out = (probs @ v).transpose(1, 2).to(query.dtype)
    return out, q.to(query.dtype)


def mla_decode_fp8(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, scale, sm_scale: float, q_scale: torch.Tensor | str | None,
                   prob_scale: torch.Tensor | None, block_n: int = 32,
                   tokens_per_split: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 emulation of the MLA kernel's FP8 attention (kernels/mla_decode.py; the definition of
    `decode_attention_fp8` with one latent "kv head"): Q = [q_latent | q_pe] rounded to e4m3 under q_scale
    ("dynamic": per head over both parts; fp32 [] or [H]); P rounded tile-relative, p8_j = e4m3(exp(s_j - m_t(j))
    * fp32(1 / prob_scale)) with m_t the running max of j's split up to the end of j's tile (tiles of block_n
    tokens, splits of tokens_per_split, None: one split):
        out = scale * prob_scale * sum_j exp(m_t(j) - M) p8_j c_codes_j / sum_j exp(s_j - M)   (latent space).
    Returns (out [B, H, Dc] fp64, lse [B, H] fp64)."""
    batch, heads, latent_dim = q_latent.shape
    q = torch.cat([q_latent, q_pe], dim=-1)                                              # [B, H, Dc + Dr]
    q64 = _query_fp64(q, q_scale)
    out = torch.zeros(batch, heads, latent_dim, dtype=torch.float64, device=q.device)
    lse = torch.full((batch, heads), float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        rows = _read_sequence(cache, block_table[b], n, 1.0 if is_fp8(cache.dtype) else None, 0).double()
        rows = (rows * float(scale) if is_fp8(cache.dtype) else rows).to(q.device)        # [n, Dc + Dr]
        scores = (q64[b] @ rows.T) * sm_scale                                            # [H, n]
        lse[b] = torch.logsumexp(scores, dim=-1)
        c = rows[:, :latent_dim]
        if prob_scale is None:
            out[b] = torch.softmax(scores, dim=-1) @ c
            continue
        weights, denominator = _fp8_prob_weights(scores, prob_scale, block_n, tokens_per_split)
        out[b] = (weights @ c) / denominator
    return out, lse


# ---------------------------------------------------------------------------------------------------
# Block-scaled caches (NVFP4, MXFP8, MXFP4, INT8 / INT4 per token-head): the paged layout our kernels read
# (kernels/decode_attention_block_scaled.py, kernels/store_kv_block_scaled.py). For each of K and V:
#   codes:        [num_blocks, block_size, kv_heads, head_dim * bits / 8] uint8: 8-bit elements one a byte (int8
#                 as its two's-complement byte), 4-bit elements two a byte, the even index in the low nibble (e2m1
#                 as OCP's sign-magnitude nibble, int4 as a two's-complement nibble)
#   block scales: [num_blocks, block_size, kv_heads, head_dim / B] uint8 (e4m3 or e8m0 bits, one per B values) or
#                 [num_blocks, block_size, kv_heads] fp32 (one per token and head: B = head_dim), or
#                 [num_blocks, block_size, kv_heads, head_dim / B] fp32 (fp8_ds_mla's latent: B = 128)
#   scale:        fp32 [] or [kv_heads], static (NVFP4's global scale), or None (1.0)
# value = element(code) x (block scale x scale), multiplied in fp32 in that order (harness/kv_paths/formats.py's
# decode, which this layout stores; the harness maps its KVFormat onto (element, block scale, B)).
# ---------------------------------------------------------------------------------------------------

ELEMENT_BITS = {"e2m1": 4, "e4m3": 8, "int8": 8, "int4": 4}
BLOCK_SCALE_TYPES = ("e4m3", "e8m0", "fp32")
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 7 -> |value| (OCP MX v1.0)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] uint8 -> [..., 2n] uint8 nibbles, the low nibble first."""
    packed = packed.view(torch.uint8)
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def element_values(codes: torch.Tensor, element: str) -> torch.Tensor:
    """Stored codes [..., bytes] uint8 -> element values [..., head_dim] fp32 (exact)."""
    assert element in ELEMENT_BITS, f"unknown element {element!r}; expected one of {sorted(ELEMENT_BITS)}"
    codes = codes.view(torch.uint8)
    if element == "e4m3":
        return codes.view(torch.float8_e4m3fn).float()
    if element == "int8":
        return codes.view(torch.int8).float()
    nibbles = unpack_nibbles(codes)
    if element == "int4":
        return ((nibbles ^ 8).float() - 8.0)
    magnitude = torch.tensor(E2M1_VALUES, device=codes.device)[(nibbles & 7).long()]
    return torch.where((nibbles & 8).bool(), -magnitude, magnitude)


def block_scale_values(block_scales: torch.Tensor, block_scale: str) -> torch.Tensor:
    """Stored block scales -> fp32: e4m3 bits, e8m0 bits (2^(bits - 127); 255 NaN) or fp32 as stored."""
    assert block_scale in BLOCK_SCALE_TYPES, f"unknown block scale {block_scale!r}; expected {BLOCK_SCALE_TYPES}"
    if block_scale == "fp32":
        return block_scales.float()
    bits = block_scales.view(torch.uint8)
    if block_scale == "e4m3":
        return bits.view(torch.float8_e4m3fn).float()
    value = torch.ldexp(torch.ones(bits.shape, device=bits.device), bits.int() - 127)   # 2^-127: fp32 subnormal
    return torch.where(bits == 255, torch.full_like(value, float("nan")), value)


def dequantize_block_scaled(codes: torch.Tensor, block_scales: torch.Tensor, scale, element: str,
                            block_scale: str, block_size: int) -> torch.Tensor:
    """codes [..., heads, bytes] + block scales [..., heads, D / B] (fp32: that or [..., heads]) + static scale [] or
    [heads] (None: 1.0) -> values [..., heads, D] fp32: element x (block scale x scale)."""
    values = element_values(codes, element)                                     # [..., heads, D]
    blocks = block_scale_values(block_scales, block_scale)
    per_token = block_scale == "fp32" and blocks.dim() < values.dim()          # one fp32 scale per token and head
    blocks = blocks.unsqueeze(-1) if per_token else blocks                      # [..., heads, D / B]
    block = values.shape[-1] if per_token or not block_size else block_size
    assert values.shape[-1] == blocks.shape[-1] * block, \
        f"{values.shape[-1]} values per head do not make {blocks.shape[-1]} blocks of {block}"
    # block scale x scale, fp32; without a static scale the blocks as they are (x 1.0 changes no bit), so no host
    # scalar is copied to the device (a CUDA graph capture refuses that copy)
    whole = blocks if scale is None else blocks * _head_scale(scale, 1).to(blocks.device)
    per_value = whole.repeat_interleave(values.shape[-1] // whole.shape[-1], dim=-1)
    return values * per_value


def decode_attention_block_scaled(q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor,
                                  k_block_scales: torch.Tensor, v_block_scales: torch.Tensor,
                                  block_table: torch.Tensor, seq_lens: torch.Tensor, k_scale, v_scale,
                                  sm_scale: float, num_splits: int | None = None, *, element: str,
                                  block_scale: str, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_attention` over a block-scaled paged cache (layout above): the cache dequantised to fp32 values
    (`dequantize_block_scaled`), then the same fp32 attention. Returns (out [B, Hq, D] q.dtype, lse [B, Hq] fp32)."""
    layout = dict(element=element, block_scale=block_scale, block_size=block_size)
    k = dequantize_block_scaled(k_codes, k_block_scales, k_scale, **layout)    # [num_blocks, page, Hkv, D]
    v = dequantize_block_scaled(v_codes, v_block_scales, v_scale, **layout)
    return decode_attention(q, k, v, block_table, seq_lens, None, None, sm_scale, num_splits)


def mla_decode_block_scaled(q_latent: torch.Tensor, q_pe: torch.Tensor, codes: torch.Tensor,
                            block_scales: torch.Tensor, k_pe: torch.Tensor, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, scale, sm_scale: float, num_splits: int | None = None, *,
                            element: str, block_scale: str, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_decode` over a block-scaled latent (one KV head of the layout above) and a 16-bit k_pe [num_blocks, page,
    Dr]: the latent dequantised to fp32, joined to k_pe, then the same fp32 attention."""
    latent = dequantize_block_scaled(codes, block_scales, scale, element=element, block_scale=block_scale,
                                     block_size=block_size)[:, :, 0]                  # [num_blocks, page, Dc]
    cache = torch.cat([latent, k_pe.float().to(latent.device)], dim=-1)
    return mla_decode(q_latent, q_pe, cache, block_table, seq_lens, None, sm_scale, num_splits)
