"""A few-kernel torch gated delta rule for training the hybrid canary without fla kernels.

transformers' torch fallback for Qwen3-Next's Gated-DeltaNet scans the sequence in 64-token chunks and,
in some versions, solves each chunk's triangular system by a 63-step Python loop: hundreds of tiny
kernels per layer. On the lent H100 a kernel launch cost ~100-200 us, so the hybrid ran ~1 s per step.
This is the same chunked algorithm (Yang et al., "Gated Delta Networks", 2024; transformers'
`torch_chunk_gated_delta_rule`) with one `solve_triangular` per chunk system and 256-token chunks, so a
2k-token sequence takes 9 scan steps. Training only: inference uses the library's own function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TRAIN_CHUNK = 256  # tokens per chunk: [.., 256, 256] fp32 systems, 9 scan steps for 2k tokens


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = TRAIN_CHUNK, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, **kwargs):
    """query, key: [B, T, Hk, Dk]; value: [B, T, Hv, Dv]; g (log decay <= 0), beta: [B, T, Hv].
    Returns ([B, T, Hv, Dv] output in the input dtype, final state [B, Hv, Dk, Dv] or None)."""
    chunk_size = max(chunk_size, TRAIN_CHUNK)
    dtype = query.dtype
    batch, length, k_heads, _ = key.shape
    v_heads = value.shape[2]
    if k_heads != v_heads:  # each key head serves v_heads // k_heads consecutive value heads
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    query, key, value, beta, g = (x.transpose(1, 2).float().contiguous() for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6)
        key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    query = query * query.shape[-1] ** -0.5

    pad = (chunk_size - length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    chunks = (length + pad) // chunk_size
    # [B, H, chunks, C, D]
    query, key, value = (x.reshape(batch, v_heads, chunks, chunk_size, -1) for x in (query, key, value))
    beta, g = (x.reshape(batch, v_heads, chunks, chunk_size) for x in (beta, g))
    k_beta, v_beta = key * beta.unsqueeze(-1), value * beta.unsqueeze(-1)

    # log of the decay from the chunk start to each position: a cumulative sum as a matmul with an upper
    # triangle of ones, because Inductor (torch 2.11, CUDA) fails to generate code for this cumsum's scan
    cum = g @ torch.ones(chunk_size, chunk_size, device=g.device).triu()
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    pair_decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ key.transpose(-1, -2)) * pair_decay  # unit lower-triangular (I + strictly lower)
    intra = (query @ key.transpose(-1, -2)) * pair_decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False,
                                               unitriangular=True)

    state = (torch.zeros(batch, v_heads, key.shape[-1], value.shape[-1], device=query.device)
             if initial_state is None else initial_state.float())
    query = query * cum.exp().unsqueeze(-1)
    key = key * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outputs = []
    for i in range(chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outputs.append(query[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outputs, dim=2).reshape(batch, v_heads, -1, value.shape[-1])[:, :, :length]
    return out.transpose(1, 2).to(dtype).contiguous(), (state if output_final_state else None)


def install(model) -> None:
    """Route the hybrid's Gated-DeltaNet layers through `chunk_gated_delta_rule` (training only)."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    modeling_qwen3_next.torch_chunk_gated_delta_rule = chunk_gated_delta_rule  # called as a global (5.2x)
    for module in model.modules():
        if hasattr(module, "chunk_gated_delta_rule"):  # bound at init (older 5.x)
            module.chunk_gated_delta_rule = chunk_gated_delta_rule
