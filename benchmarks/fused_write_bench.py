"""The fused FP8 cache write (`kernels.store_kv.quantize_store`) at 8B prefill shape, whole and in parts (CUDA only).

    python benchmarks/fused_write_bench.py [--tokens-per-program 16,32,64]

K of one layer (8 heads of 128, bf16, laid out as transformers hands it: [rows, heads, tokens, dim] over a [rows,
tokens, heads, dim] buffer) for a 32 x 1k and a 16 x 8k prefill chunk; per row of the table, `triton.testing.do_bench`
medians (us) of the whole write (round trip, paged store and statistics), without the statistics, without the store,
and the round trip alone, beside a bf16 copy of the same tensor (the bytes' floor).
"""

from __future__ import annotations

import argparse
import sys

import torch

from kernels import store_kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens-per-program", default="32,64")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: fused_write_bench needs a CUDA device")
    from triton.testing import do_bench

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| rows x tokens | tokens/program | whole write us | no statistics | no store | round trip only | "
          "bf16 copy |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    torch.manual_seed(0)
    for rows, chunk in ((32, 1024), (16, 8192)):
        heads, dim = 8, 128
        x = torch.randn(rows, chunk, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        scale = torch.tensor(0.05, device="cuda")
        cache = torch.zeros(rows * -(-chunk // 16), 16, heads, dim, dtype=torch.uint8, device="cuda")
        store = dict(cache=cache, slots=torch.arange(rows * chunk, device="cuda"),
                     cache_strides=(cache.stride(0), cache.stride(1), cache.stride(2)))
        stats = dict(counts=torch.zeros(rows, 3, dtype=torch.int64, device="cuda"),
                     amax=torch.zeros(rows, device="cuda"), live=torch.arange(rows, device="cuda"),
                     valid=torch.ones(rows, chunk, dtype=torch.long, device="cuda"))
        copy = do_bench(lambda: x.clone(), warmup=25, rep=200) * 1e3
        for tokens in (int(t) for t in args.tokens_per_program.split(",")):
            store_kv.TOKENS_PER_PROGRAM = tokens
            us = [do_bench(lambda: store_kv.quantize_store(x, scale, "e4m3", True, **kw), warmup=25, rep=200) * 1e3
                  for kw in ({**store, **stats}, store, stats, {})]
            print(f"| {rows} x {chunk} | {tokens} | " + " | ".join(f"{u:.1f}" for u in us) + f" | {copy:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
