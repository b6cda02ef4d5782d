"""Fault injectors (path option `fault=NAME`): the attention-arithmetic ones here, the zoo's subtlest faults; the
cache-format ones (a block-scaled or FP4 cache written or read wrong) in harness/kv_paths/format_faults.py.

Each one is a plausible kernel bug in the attention arithmetic itself, not in the cache or its scales, and
each is small: on short text its token-level divergence sits inside a healthy path's noise, so the default
divergence checks cannot see it. What sees it is the implementation check (`harness.kv_paths.impl_check`):
the path's attention output against fp64 attention over the same stored K/V and the path's declared Q/P
quantisation, relative to torch's own error at the attention dtype.

A faulty path computes attention here, in fp32 as `kernels.reference.attention_fp8` does (same Q/P
quantisation when the path declares it), with the one fault put in at its step; the output is cast to the
model dtype once. They are fault injectors: never a default, never a choice a user makes for speed.
"""

from __future__ import annotations

import math

import torch

from harness.kv_paths.format_faults import FORMAT_FAULTS
from harness.kv_paths.format_faults import check as check_format_fault
from kernels import reference as fp8

# name -> what goes wrong (shown in the path's description and the zoo)
ATTENTION_FAULTS: dict[str, str] = {
    "scores_bf16": "attention scores rounded to bf16 before the softmax's max subtraction (a kernel that keeps "
                   "S in the input dtype)",
    "scale_off": "softmax scale 1/sqrt(d) off by 1% (a head dim or a folded constant slightly wrong)",
    "exp_poly": "exp in the softmax from a degree-2 polynomial after range reduction to [0, ln 2) (a fast-exp "
                "shortcut, up to 3.3% low)",
    "pv_bf16": "P.V accumulated in bf16, key by key: a bf16 accumulator",
    "k_scale_swap": "KV head 0's keys dequantised with KV head 1's k_scale (per-head scales indexed wrong)",
    "p_e5m2": "the probabilities cast to e5m2 where the path declares e4m3 (fp8_p)",
    "scale_dropped": "K and V read as codes x 1.0: the k_scale / v_scale not delivered to the read (TensorRT-LLM#16916, "
                     "vllm#34863)",
}
FAULTS: dict[str, str] = {**ATTENTION_FAULTS, **FORMAT_FAULTS}
SCALE_ERROR = 2.0 ** -7  # scale_off: the softmax scale times (1 + 2^-7), 0.8%
PV_TILE = 1  # pv_bf16: keys per fp32 partial sum (1: the running sum is rounded to bf16 after every key)


def check(spec: str, name: str, fmt: str, granularity: str, fp8_prob: bool, v_fmt: str = "") -> str | None:
    """Why `fault=name` cannot apply to this path (None: it can)."""
    if name not in FAULTS:
        return f"unknown fault {name!r}; fault injectors are {', '.join(FAULTS)}"
    if name in FORMAT_FAULTS:
        return check_format_fault(name, fmt, v_fmt)
    if name == "p_e5m2" and not fp8_prob:
        return (f"fault=p_e5m2 changes how FP8 probabilities are cast and needs a path that declares them: "
                f"add fp8_p, e.g. '{spec}:fp8_p'")
    if name == "scale_dropped" and (fmt == "bf16" or granularity == "per_token"):
        return ("fault=scale_dropped drops stored k/v scales at the read and needs an fp8 cache with per_tensor or "
                "per_head scales, e.g. 'fp8_e4m3:calibrated:fault=scale_dropped'")
    if name == "k_scale_swap" and (fmt == "bf16" or granularity != "per_head"):
        return ("fault=k_scale_swap swaps per-head k_scales and needs an fp8 cache with per_head scales, e.g. "
                "'fp8_e4m3:per_head:calibrated:fault=k_scale_swap'")
    return None


def attention_fault(kv_path) -> str:
    """The path's attention-arithmetic fault ("" none: no fault, or a cache-format one, which attention reads
    through the cache as it is)."""
    name = getattr(kv_path, "fault", "")
    return name if name in ATTENTION_FAULTS else ""


def faulty_attention(name: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                     mask: torch.Tensor | None, quant=None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with the fault `name`: query [B, Hq, T, D], key/value [B, Hkv, L, D] (the last T positions
    are the queries), mask as `attention_fp8` takes it; quant an AttentionQuant or None; k_scale / v_scale the
    layer's stored scales ([] or [Hkv]; an MLA latent's one scale reaches its expanded K and V alike).
    -> [B, T, Hq, Dv]."""
    q = _declared_query(query.float(), quant)
    k, v = key.float(), value.float()
    if name == "scale_dropped" and k_scale is not None and v_scale is not None:
        k, v = k / _per_head(k_scale, k), v / _per_head(v_scale, v)  # codes x s read as codes x 1
    if name == "k_scale_swap" and k_scale is not None and k_scale.numel() > 1:
        scale = k_scale.float().reshape(-1).to(k.device)
        k = k.clone()
        k[:, 0] *= scale[1] / scale[0]  # the codes of head 0 times head 1's scale
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    logits = (q @ k.transpose(-1, -2)) * (scaling * (1 + SCALE_ERROR) if name == "scale_off" else scaling)
    logits = _masked(logits, mask, key.shape[2], query.shape[2])
    if name == "scores_bf16":
        logits = logits.bfloat16().float()
    shifted = logits - logits.amax(dim=-1, keepdim=True).clamp_min(-3e38)
    weights = poly_exp(shifted) if name == "exp_poly" else torch.exp(shifted)
    probs = weights / weights.sum(dim=-1, keepdim=True)
    if quant is not None and quant.prob_scale is not None:
        fmt = "e5m2" if name == "p_e5m2" else quant.fmt
        probs = fp8.dequantize(fp8.quantize(probs, quant.prob_scale, fmt), quant.prob_scale)
    out = bf16_accumulated(probs, v) if name == "pv_bf16" else probs @ v
    return out.transpose(1, 2).to(query.dtype)


def _per_head(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A stored scale ([] or [heads]) shaped to x [B, heads, L, D]."""
    scale = scale.float().to(x.device)
    return scale.view(1, -1, 1, 1) if scale.numel() > 1 else scale.reshape(())


def _declared_query(q: torch.Tensor, quant) -> torch.Tensor:
    """The query as the path declares it (`attention_fp8`'s Q quantisation), fp32."""
    if quant is None or quant.q_scale is None:
        return q
    if isinstance(quant.q_scale, str):
        scale = fp8.per_token_scale(q, quant.fmt)
        return fp8.dequantize(fp8.quantize(q, scale, quant.fmt), scale)
    return fp8.dequantize(fp8.quantize(q, quant.q_scale, quant.fmt), quant.q_scale)


def _masked(logits: torch.Tensor, mask: torch.Tensor | None, length: int, chunk: int) -> torch.Tensor:
    if mask is None:  # causal: the chunk's queries are the last `chunk` positions
        rows = torch.arange(chunk, device=logits.device).unsqueeze(1) + (length - chunk)
        mask = torch.arange(length, device=logits.device).unsqueeze(0) <= rows
    if mask.dtype == torch.bool:
        return logits.masked_fill(~mask[..., :length], float("-inf"))
    return logits + mask[..., :length].float()


def poly_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for x <= 0 as 2^n * (1 + f + f^2 / 2), n = floor(x / ln 2), f = x - n ln 2 in [0, ln 2): the
    truncated Taylor series is low by up to 1 - (1 + f + f^2/2) / e^f = 3.3% at f -> ln 2; exp(-inf) = 0."""
    finite = torch.isfinite(x)
    safe = torch.where(finite, x, torch.zeros_like(x)).clamp_min(-1000.0)
    n = torch.floor(safe / math.log(2.0))
    f = safe - n * math.log(2.0)
    return torch.where(finite, torch.ldexp(1.0 + f + 0.5 * f * f, n), torch.zeros_like(x))


def bf16_accumulated(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """probs [..., T, L] @ v [..., L, D] with the running sum held in bf16 between tiles of PV_TILE keys."""
    acc = torch.zeros((*probs.shape[:-1], v.shape[-1]), dtype=torch.float32, device=probs.device)
    for start in range(0, probs.shape[-1], PV_TILE):
        part = probs[..., start:start + PV_TILE] @ v[..., start:start + PV_TILE, :]
        acc = (acc + part).bfloat16().float()
    return acc
