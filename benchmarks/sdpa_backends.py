"""SDPA per call with and without torch's cuDNN attention backend, for the shapes the harness gives it (CUDA).

    python benchmarks/sdpa_backends.py

Why `harness/kv_paths/attention.py` leaves cuDNN out: cuDNN builds an execution plan for every new shape, and a
decode step over a growing cache, a prefill chunk or a scoring call is a new shape almost every time. Rows: a
decode query (batch 12, 8 query / 2 KV heads, head dim 32, a bool mask) over a key length that grows by one
per call (50 calls), the same with no mask, one shape repeated 50 times, and the first call of three prefill
shapes. Milliseconds per call, wall clock with the device synchronised.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def _timed(fn, calls: int = 1) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / calls


def rows(batch: int = 12, heads: int = 8, kv_heads: int = 2, dim: int = 32) -> list[tuple[str, float, float]]:
    def decode(length: int, mask: bool):
        q = torch.randn(batch, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16)
        m = torch.ones(batch, 1, 1, length, device="cuda", dtype=torch.bool) if mask else None
        return F.scaled_dot_product_attention(q, k, k, attn_mask=m, enable_gqa=True)

    def prefill(length: int):
        q = torch.randn(batch, heads, length, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16)
        m = torch.ones(batch, 1, length, length, device="cuda", dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, k, attn_mask=m, enable_gqa=True)

    cases = [("decode, key length +1 per call, mask", lambda i: decode(300 + i, True), 50),
             ("decode, key length +1 per call, no mask", lambda i: decode(400 + i, False), 50),
             ("decode, one shape repeated, mask", lambda i: decode(256, True), 50)]
    cases += [(f"prefill {n} tokens, first call", lambda i, n=n: prefill(n), 1) for n in (128, 129, 130)]
    found = {}
    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        decode(256, True)  # the repeated shape's plan (or kernel) exists before it is timed
        for label, fn, calls in cases:
            found.setdefault(label, {})[cudnn] = _timed(fn, calls)
    torch.backends.cuda.enable_cudnn_sdp(True)
    return [(label, times[True], times[False]) for label, times in found.items()]


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| call | ms with cuDNN | ms without |\n|---|---:|---:|")
    for label, with_cudnn, without in rows():
        print(f"| {label} | {with_cudnn:.3f} | {without:.3f} |")


if __name__ == "__main__":
    main()
