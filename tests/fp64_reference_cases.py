"""The cases of kernels/fp64_reference.py's tests, shared by the interpreter's run (tests/fp64_reference_interpreted.py)
and the GPU's (tests/test_fp64_reference.py): each builds a paged FP8 cache, computes scores and a weighted sum by the
kernels and by torch's fp64 GEMMs over `codes.double()` (the torch way `PagedKV._exact_rows` takes on the CPU), and
returns the largest difference of each over its bound.

The bound: both sides are fp64 sums of the same exact products in different orders, so an element differs by at most
~n u sum|terms| (n terms, u = 2^-53; Higham, the error of recursive or pairwise summation is below (n - 1) u sum|terms|
for each side). The tests ask for <= 1 of 2 n u sum|terms|; a wrong code, head, row or key in a sum moves it by a
whole term (|q k| >= 2^-9 x 2^-9 here, 2^37 times that bound for the largest sums), so it cannot pass."""

from __future__ import annotations

import torch

U = 2.0 ** -53
# name: rows the cache holds, slots a row, KV heads, query heads a KV head, head size, format, span, query rows,
# a stale NaN code past one row's length
CASES = {
    "e4m3-g4-d128": dict(rows=6, slots=320, kv_heads=2, group=4, dim=128, fmt="e4m3", span=300, picked=(5, 0, 3)),
    "e5m2-g1-d64": dict(rows=3, slots=64, kv_heads=4, group=1, dim=64, fmt="e5m2", span=37, picked=(2, 0, 2)),
    "e4m3-g3-d96": dict(rows=4, slots=600, kv_heads=1, group=3, dim=96, fmt="e4m3", span=530, picked=(1, 3)),
}
# the GPU's alone (the interpreter takes ~20 s over them): a long span and a large head
GPU_CASES = {**CASES, "e4m3-g8-d256-8k": dict(rows=2, slots=8192, kv_heads=2, group=8, dim=256, fmt="e4m3", span=8192,
                                              picked=(1, 0))}


def measure(device: str, rows: int, slots: int, kv_heads: int, group: int, dim: int, fmt: str, span: int,
            picked: tuple) -> dict:
    from kernels import fp64_reference

    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    gen = torch.Generator().manual_seed(rows * 1000 + dim)
    k = (torch.randn(rows, slots, kv_heads, dim, generator=gen) * 8).to(dtype)
    v = (torch.randn(rows, slots, kv_heads, dim, generator=gen) * 8).to(dtype)
    stale = picked[0]   # (the other picked rows keep finite sums)
    k.view(torch.uint8)[stale, span - 3:] = 0x7F   # NaN codes at one row's last keys: NaN scores, NaN sums
    v.view(torch.uint8)[stale, span - 3:] = 0x7F
    index = torch.tensor(picked, dtype=torch.int64)
    n = len(picked)
    q = torch.randn(n, kv_heads, group, dim, dtype=torch.float64, generator=gen)
    weights = torch.softmax(torch.randn(n, kv_heads, group, span, dtype=torch.float64, generator=gen) * 3, dim=-1)
    k, v, index, q, weights = (t.to(device) for t in (k, v, index, q, weights))
    table = fp64_reference.code_values(dtype, k.device)
    scores = fp64_reference.code_scores(q, k, index, span, table)
    out = fp64_reference.weighted_codes(weights, v, index, span, table)
    k64, v64 = (c[index, :span].transpose(1, 2).double() for c in (k, v))
    want_scores = torch.matmul(q, k64.transpose(-1, -2))
    want_out = torch.matmul(weights, v64)
    score_bound = 2 * dim * U * torch.matmul(q.abs(), k64.abs().transpose(-1, -2))
    out_bound = 2 * span * U * torch.matmul(weights.abs(), v64.abs())
    finite = want_scores.isfinite()
    return {
        "scores_over_bound": ((scores - want_scores).abs()[finite] / score_bound[finite]).max().item(),
        "out_over_bound": ((out - want_out).abs()[want_out.isfinite()] / out_bound[want_out.isfinite()]).max().item(),
        "nan_where_torch_nan": bool(torch.equal(scores.isnan(), want_scores.isnan())
                                    and torch.equal(out.isnan(), want_out.isnan())),
        "nan_scores": int(want_scores.isnan().sum().item()),
        "largest_term": float((q.abs().amax() * k64[k64.isfinite()].abs().amax()).item()),
    }
