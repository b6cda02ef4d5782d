"""MLA weight absorption, the one place it is written: engines decode DeepSeek-style MLA over the cached latent c
by folding kv_b_proj into the query and the output (DeepSeek-V2, section 2.1.2):

    q_latent = q_nope W_UK          scores = q_latent . c + q_pe . k_pe
    out      = (softmax(scores) . c) W_UV

with kv_b_proj.weight [H * (nope + v), Dc] split per head into W_UK [H, nope, Dc] and W_UV [H, v, Dc].
Used by every paged-cache decode (one sequence or a batch), its fp64 check, and attention capture's kernel rows.
"""

from __future__ import annotations

import torch


def absorbed_weights(module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [H, nope, Dc], W_UV [H, v, Dc]) of an MLA attention module's kv_b_proj, in `dtype`."""
    nope = module.qk_nope_head_dim
    weight = module.kv_b_proj.weight.view(-1, nope + module.v_head_dim, module.kv_b_proj.weight.shape[-1])
    return weight[:, :nope].to(dtype), weight[:, nope:].to(dtype)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [..., H, nope] -> q_latent [..., H, Dc], in the operands' dtype."""
    return torch.einsum("...hn,hnc->...hc", q_nope, w_uk)


def expand_latent(latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Attention output in latent space [..., H, Dc] -> per-head values [..., H, v], in the operands' dtype."""
    return torch.einsum("...hc,hvc->...hv", latent, w_uv)
