"""The dequantise-everything workaround (failure class 4), written to the decode-kernel contract.

Before every decode step the whole paged FP8 cache, every block, is dequantised (fp8 -> fp32 -> q's dtype),
then each sequence's pages are gathered and attended with torch SDPA in q's dtype. Its cost grows with the
cache size, not with the tokens attended: that is the point of shipping it, as the slow-but-plausible
implementation a harness must rank against a real kernel. Pure torch: runs on any device. Same signatures
as `kernels.decode_attention.decode_attention` and `kernels.mla_decode.mla_decode` (docs/CONTRACTS.md,
"Decode-kernel plug-ins"); returns the output only (the contract allows that).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference import dequantize, is_fp8


def _dequantise_all(cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, head_dim: bool) -> torch.Tensor:
    """Every block of the cache in `dtype` (an fp8 cache times its scale, [] or per head; others as they are)."""
    if not is_fp8(cache.dtype):
        return cache.to(dtype)
    s = scale.float()
    if head_dim and s.dim() == 1:
        s = s.view(1, 1, -1, 1)                                   # [Hkv] over [blocks, page, Hkv, D]
    return dequantize(cache, s, dtype)


def _rows(values: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` rows of one sequence from dequantised pages, in token order."""
    page = values.shape[1]
    return values[table_row[: -(-length // page)].long()].flatten(0, 1)[:length]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                     sm_scale: float) -> torch.Tensor:
    """GQA decode: q [B, Hq, D] -> out [B, Hq, D] in q's dtype (query head h reads KV head h // (Hq / Hkv))."""
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    k_all = _dequantise_all(k_cache, k_scale, q.dtype, True)
    v_all = _dequantise_all(v_cache, v_scale, q.dtype, True)
    out = torch.empty_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        k = _rows(k_all, block_table[b], length).transpose(0, 1)          # [Hkv, L, D]
        v = _rows(v_all, block_table[b], length).transpose(0, 1)
        rows = q[b].view(kv_heads, q_heads // kv_heads, head_dim)         # a KV head's query heads as query rows
        out[b] = F.scaled_dot_product_attention(rows, k, v, scale=sm_scale).reshape(q_heads, head_dim)
    return out


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: torch.Tensor | None, sm_scale: float) -> torch.Tensor:
    """MLA decode (absorbed): q_latent [B, H, Dc], q_pe [B, H, Dr] -> out [B, H, Dc] (latent space)."""
    latent_dim = q_latent.shape[2]
    values = _dequantise_all(cache, scale, q_latent.dtype, False)          # [blocks, page, Dc + Dr]
    out = torch.empty_like(q_latent)
    for b, length in enumerate(seq_lens.tolist()):
        rows = _rows(values, block_table[b], length)                       # [L, Dc + Dr]
        query = torch.cat([q_latent[b], q_pe[b]], dim=-1)[:, None]         # [H, 1, Dc + Dr]
        keys = rows[None].expand(query.shape[0], -1, -1)
        out[b] = F.scaled_dot_product_attention(query, keys, keys[..., :latent_dim], scale=sm_scale)[:, 0]
    return out
