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


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: str, saturate: bool = True) -> torch.Tensor:
    """fp8(x / scale). Saturating clamps finite overflow to +-max (NaN stays NaN); non-saturating is
    torch's plain cast, under which e4m3 overflow becomes NaN and e5m2 overflow becomes inf."""
    scaled = x.float() / torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if saturate:
        limit = FP8_MAX[fmt]
        scaled = torch.where(scaled.isnan(), scaled, scaled.clamp(-limit, limit))
    return scaled.to(fp8_dtype(fmt))


def dequantize(codes: torch.Tensor, scale: torch.Tensor | float, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 * scale, multiplied in fp32, cast once to `out_dtype`."""
    return (codes.float() * torch.as_tensor(scale, dtype=torch.float32, device=codes.device)).to(out_dtype)


def amax_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """Scale that maps `amax` onto the format's largest value: amax / 448 (e4m3) or amax / 57344 (e5m2)."""
    return (amax.float() / FP8_MAX[fmt]).clamp_min(MIN_SCALE)


def per_token_scale(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Dynamic per-token scale over the last dim: x [..., D] -> scale [..., 1]."""
    return amax_scale(x.float().abs().amax(dim=-1, keepdim=True), fmt)
