"""The write check's sums (`harness.kv_paths.cache.KVWriteStats.check_write`): per row of a cache write, the squared
error of two read-backs of the same values, in one pass over the three tensors. Torch's ops
(`reference.square_error_sums`, the CPU's) made ~20 passes over fp32 copies: at 8B shape, a 16 x 8k prefill, ~0.4 s of
FP8's prefill on an H200 (session 23)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.decode_attention import on_tensor_device
from kernels.store_kv import TOKENS_PER_PROGRAM, _check_cuda, _warps


@triton.jit(do_not_specialize=["C", "stride_vr"])
def _square_error_sums_kernel(
    X, A, B, VALID, PARTS,       # [R, H, C, D] x and two read-backs (any strides); [R, C] int (0 = pad); fp64 out
    C, stride_vr,
    sx0, sx1, sx2, sx3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, HAS_VALID: tl.constexpr,
):
    tiles = tl.cdiv(C, BLOCK_T)
    pid = tl.program_id(0)
    r = (pid // tiles).to(tl.int64)
    tile = pid % tiles
    head = tl.program_id(1)
    offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_mask = offs_t < C
    if HAS_VALID:
        t_mask &= tl.load(VALID + r * stride_vr + offs_t, mask=t_mask, other=0) != 0
    m2 = t_mask[:, None] & (offs_d < D)[None, :]
    x = tl.load(X + r * sx0 + head * sx1 + offs_t[:, None] * sx2 + offs_d[None, :] * sx3, mask=m2, other=0.0)
    a = tl.load(A + r * sa0 + head * sa1 + offs_t[:, None] * sa2 + offs_d[None, :] * sa3, mask=m2, other=0.0)
    b = tl.load(B + r * sb0 + head * sb1 + offs_t[:, None] * sb2 + offs_d[None, :] * sb3, mask=m2, other=0.0)
    x = x.to(tl.float32)
    out = PARTS + ((r * tl.num_programs(1) + head) * tiles + tile) * 2
    ea = a.to(tl.float32) - x
    ea = ea * ea
    ea = tl.where((ea == ea) & (ea != float("inf")), ea, 0.0)      # torch.nan_to_num(nan=0, posinf=0)
    eb = b.to(tl.float32) - x
    eb = eb * eb
    eb = tl.where((eb == eb) & (eb != float("inf")), eb, 0.0)
    tl.store(out, tl.sum(tl.sum(ea.to(tl.float64), axis=1), axis=0))
    tl.store(out + 1, tl.sum(tl.sum(eb.to(tl.float64), axis=1), axis=0))


@on_tensor_device
def square_error_sums(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      valid: torch.Tensor | None = None) -> torch.Tensor:
    """[R, 2] fp64: per row r, the sums over (H, C, D) of (a - x)^2 and of (b - x)^2, each difference and square in
    fp32 and summed in fp64 (torch's `(a.float() - x.float()).square_()` then `.sum(dtype=torch.float64)`), NaN and
    +inf squares counted 0 (`torch.nan_to_num(nan=0, posinf=0)`), tokens with valid[r, c] == 0 not counted.
    x, a, b: [R, H, C, D] bf16/fp16/fp32, any strides; valid: [R, C] (last dim contiguous) or None. Deterministic:
    one fp64 partial a program, summed by torch in a fixed order."""
    assert x.dim() == 4 and a.shape == x.shape and b.shape == x.shape, \
        f"x, a, b must be one [R, H, C, D] shape, got {list(x.shape)}, {list(a.shape)}, {list(b.shape)}"
    rows, heads, chunk, dim = x.shape
    assert valid is None or (valid.shape == (rows, chunk) and valid.stride(1) == 1), \
        f"valid must be [{rows}, {chunk}] with a contiguous last dim, got {None if valid is None else list(valid.shape)}"
    _check_cuda(x, a, b, *([valid] if valid is not None else []))
    block_t = min(TOKENS_PER_PROGRAM, triton.next_power_of_2(max(chunk, 2)))
    tiles = triton.cdiv(chunk, block_t)
    parts = torch.zeros(rows, heads * tiles, 2, dtype=torch.float64, device=x.device)
    if x.numel():
        block_d = triton.next_power_of_2(dim)
        _square_error_sums_kernel[(rows * tiles, heads)](
            x, a, b, valid if valid is not None else parts, parts, chunk, valid.stride(0) if valid is not None else 0,
            *x.stride(), *a.stride(), *b.stride(), D=dim, BLOCK_D=block_d, BLOCK_T=block_t,
            HAS_VALID=valid is not None, num_warps=_warps(block_t * block_d))
    return parts.sum(1)
