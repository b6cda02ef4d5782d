"""A Hadamard rotation of K (and Q) over head_dim before the cache quantises K (the path option `hadamard`), as
QuaRot (arXiv 2404.00456) and SpinQuant rotate attention, and vLLM's TurboQuant rotates K before its codebooks.

    rotate(x) = x H_n / sqrt(n), per block of n consecutive head_dim values,

H_n the Sylvester Hadamard matrix (H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]) and n the largest power of two
dividing head_dim (the whole head for 64, 128, 256; blocks of 16 for 80). H_n / sqrt(n) is orthogonal and symmetric,
so (q R)(k R)^T = q k^T: the attention scores are those of the unrotated query and key in exact arithmetic, while
an outlier channel of K is spread over the n values of its block before the quantiser picks a scale.

The cache stores rotated K (`QuantizedKVLayer`) and attention rotates Q (`harness_attention`), as an engine whose
kernels take rotated operands. V is not rotated: the output would then be (P V R) R^T, one more rotation per layer
that engines fold into the output projection's weights (QuaRot's W_O), not into the cache; and it is K whose channels
carry the outliers a per-token or per-block scale suffers from (KIVI, arXiv 2402.02750), V's do not.
"""

from __future__ import annotations

import torch


def hadamard_block(dim: int) -> int:
    """The rotation's block size for a head of `dim` values: the largest power of two dividing it."""
    assert dim > 0, f"head_dim must be positive, got {dim}"
    return dim & -dim


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> x R in fp32 [..., D]: the fast Walsh-Hadamard transform (log2 n butterfly
    passes of sums and differences) per block of n = `hadamard_block(D)` values, then the 1 / sqrt(n) normalisation.
    Its own inverse: rotate(rotate(x)) = x up to fp32 rounding."""
    dim = x.shape[-1]
    n = hadamard_block(dim)
    y = x.float().reshape(*x.shape[:-1], dim // n, n)  # [..., blocks, n]
    half = 1
    while half < n:
        pairs = y.unflatten(-1, (n // (2 * half), 2, half))  # [..., blocks, groups, 2, half]
        low, high = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((low + high, low - high), dim=-2).flatten(-3)
        half *= 2
    return (y * n ** -0.5).reshape(x.shape)
