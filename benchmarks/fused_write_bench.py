"""The fused FP8 cache write (`kernels.store_kv.quantize_store`) at 8B prefill shape, whole and in parts (CUDA only).

    python benchmarks/fused_write_bench.py [--tokens-per-program 16,32,64]

K of one layer (8 heads of 128, bf16, laid out as transformers hands it: [rows, heads, tokens, dim] over a [rows,
tokens, heads, dim] buffer) for a 32 x 1k and a 16 x 8k prefill chunk; per row of the table, `triton.testing.do_bench`
medians (us) of the whole write (round trip, paged store and statistics), without the statistics, without the store,
and the round trip alone, beside a bf16 copy of the same tensor (the bytes' floor). Then a decode step's write of
one layer at batch 32 (one token a row, K and V in one launch, the read-back into a static storage column, as
`QuantizedKVLayer._fused_round_trip` writes it), timed as the median of a CUDA graph of 32 such launches (a decode
step's, one a layer) over 32: a launch this small is mostly its latency, which only a graph shows as a step sees it.
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
    _decode_step_row(do_bench)


def _decode_step_row(do_bench, rows: int = 32, heads: int = 8, dim: int = 128, max_len: int = 1040,
                     layers: int = 32) -> None:
    """The table's decode row: µs a layer of `layers` pair launches captured in one CUDA graph."""
    key, value = (torch.randn(rows, 1, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                  for _ in range(2))
    scale = torch.tensor(0.05, device="cuda")
    outs = [torch.zeros(rows, heads, max_len, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    caches = [torch.zeros(rows * -(-max_len // 16), 16, heads, dim, dtype=torch.uint8, device="cuda")
              for _ in range(2)]
    column = torch.tensor([max_len - 1], device="cuda")
    store = dict(k_cache=caches[0], v_cache=caches[1], slots=torch.arange(rows, device="cuda") * max_len + max_len - 1,
                 cache_strides=caches[0].stride()[:3])
    stats = dict(counts=torch.zeros(rows, 3, dtype=torch.int64, device="cuda"), amax=torch.zeros(rows, device="cuda"),
                 live=torch.arange(rows, device="cuda"), valid=torch.ones(rows, 1, dtype=torch.long, device="cuda"))
    us = []
    for kw in ({**store, **stats}, store, stats, {}):
        def step(kw=kw):
            for _ in range(layers):
                store_kv.quantize_store_pair(key, value, scale, scale, "e4m3", True, k_out=outs[0], v_out=outs[1],
                                             out_columns=column, **kw)
        step()   # compiled before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        us.append(do_bench(graph.replay, warmup=25, rep=200) * 1e3 / layers)
    print(f"| {rows} x 1, K and V, decode step (a graph of {layers}) | - | " + " | ".join(f"{u:.1f}" for u in us)
          + " | - |", flush=True)


if __name__ == "__main__":
    main()
