"""Where the per-call host cost of the decode launchers goes: `python -m kernels.host_cost` (CUDA machine).

Times eager calls (GPU idle before each, as kernels.tune.host_us) of the MLA and GQA FP8 launchers at batch 8,
8k, then profiles 200 calls with cProfile and prints the functions with the largest own time."""

from __future__ import annotations

import cProfile
import pstats

import torch

from kernels.bench import _identity_table
from kernels.decode_attention import decode_attention
from kernels.mla_decode import mla_decode
from kernels.tune import host_us


def main() -> None:
    batch, ctx = 8, 8192
    table, lens = _identity_table(batch, ctx, 64)
    cache = torch.randn(batch * ctx // 64, 64, 576, device="cuda").to(torch.float8_e4m3fn)
    ql = torch.randn(batch, 16, 512, device="cuda", dtype=torch.bfloat16)
    qp = torch.randn(batch, 16, 64, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(0.01, device="cuda")
    mla = lambda: mla_decode(ql, qp, cache, table, lens, scale, 0.072)  # noqa: E731
    gtable, glens = _identity_table(batch, ctx, 16)
    k, v = (torch.randn(batch * ctx // 16, 16, 8, 128, device="cuda").to(torch.float8_e4m3fn) for _ in range(2))
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    gqa = lambda: decode_attention(q, k, v, gtable, glens, scale, scale, 128 ** -0.5)  # noqa: E731
    empty = lambda: torch.empty(batch, 16, 512, device="cuda")  # noqa: E731
    for name, fn in (("mla_decode fp8 16 heads", mla), ("decode_attention fp8", gqa), ("torch.empty", empty)):
        print(f"host us/call, {name}: {host_us(fn, 200):.1f}", flush=True)
    for name, fn in (("mla_decode", mla), ("decode_attention", gqa)):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"--- {name}: cProfile of 200 calls (GPU queue may fill: own times are host times)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
