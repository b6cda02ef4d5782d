"""A static prefill pass's attention, the two ways the attention function computes it (CUDA): under the pass's mask
(transformers' SDPA call: K and V repeated to every query head, torch's memory-efficient kernel over every key it is
handed), and, where the engine offers it, under torch's lower-right causal bias (`attention._causal_prefix_sdpa`:
flash attention over the KV heads as they are, a call per run of rows with one start).

    python benchmarks/prefill_attention.py [--shapes 16x2048x8192,...] [--heads 32] [--kv-heads 8] [--dim 128]

A shape is ROWSxWIDTHxPROMPT: ROWS prompts of PROMPT tokens in passes of WIDTH columns, each pass reading the
columns up to its own (`StaticColumns.attended`) out of a cache of PROMPT + 16. The default shapes are the engine's
multi-pass prefills (ROWS x WIDTH = its 32,768-token budget), the first the 8B-shaped scale bench's 8k row
(`scale_bench.py --configs 8b-8k`), the last also one pass of a batch of 32 1k prompts (`--configs 8b-1k`). Each
shape runs twice: unpadded, and left-padded by 0-63 tokens a row (the scale bench's ragged prompts; a pad's query
attends to itself alone). One row a pass: ms per call (CUDA events, median of 10 after 2), the ratio, and each way's
largest error against fp64 attention of the last row (the two must err alike: same inputs, bf16 out, fp32 sums);
then each shape's passes summed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.kv_paths import attention  # noqa: E402


def median_ms(fn, calls: int = 10) -> float:
    times = []
    for _ in range(calls + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def passes(rows: int, width: int, prompt: int, pads: tuple[int, ...], heads: int, kv_heads: int, dim: int,
           module) -> list[tuple[int, float, float, float, float]]:
    """(keys, ms under the mask, ms under the bias, err under the mask, err under the bias) of each pass."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    device, columns, scale = torch.device("cuda"), prompt + 16, dim ** -0.5
    keys_all = torch.arange(columns, device=device)
    first = torch.tensor(pads, device=device)[:, None, None, None]
    found = []
    for end in range(width, prompt + 1, width):
        query = torch.randn(rows, heads, width, dim, device=device, dtype=torch.bfloat16)
        key, value = (torch.randn(rows, kv_heads, columns, dim, device=device, dtype=torch.bfloat16)[:, :, :end]
                      for _ in range(2))
        queries = torch.arange(end - width, end, device=device)
        # materialised, as the engine's `static_attend` is, and cut to the keys the pass reads
        own = keys_all[None, :] == queries[:, None]
        mask = (((keys_all[None, :] <= queries[:, None]) & (keys_all >= first)) | own).contiguous()[..., :end]

        def masked():
            with attention.sdpa_backends(query):
                return sdpa_attention_forward(module, query, key, value, mask, scaling=scale)[0]

        def causal():
            with attention.sdpa_backends(query):
                return attention._causal_prefix_sdpa(query, key, value, scale, pads)

        group = module.num_key_value_groups
        k, v = (t[-1].double().repeat_interleave(group, 0) for t in (key, value))
        exact = torch.softmax((query[-1].double() @ k.transpose(-1, -2) * scale).masked_fill(~mask[-1], float("-inf")),
                              -1) @ v
        errors = [(fn()[-1].transpose(0, 1).double() - exact).abs().max().item() for fn in (masked, causal)]
        found.append((end, median_ms(masked), median_ms(causal), *errors))
        del exact, k, v
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="16x2048x8192,32x1024x4096,64x512x2048,128x256x1024,32x1024x1024")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("prefill_attention: needs a CUDA device")
    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=args.heads // args.kv_heads, is_causal=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.heads} query / {args.kv_heads} KV heads, "
          f"head {args.dim}")
    print("| rows x width x prompt | pads | keys | under the mask ms | lower-right causal ms | x | err (mask) | "
          "err (causal) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(1)
    summary = []
    for shape in args.shapes.split(","):
        rows, width, prompt = (int(n) for n in shape.split("x"))
        for padded in (False, True):
            pads = tuple(int(torch.randint(0, 64, (1,), generator=g)) if padded else 0 for _ in range(rows))
            found = passes(rows, width, prompt, pads, args.heads, args.kv_heads, args.dim, module)
            for end, slow, fast, err_mask, err_causal in found:
                print(f"| {shape} | {'0-63' if padded else 'none'} | {end} | {slow:.3f} | {fast:.3f} | "
                      f"{slow / fast:.2f} | {err_mask:.3g} | {err_causal:.3g} |")
            slow, fast = sum(f[1] for f in found), sum(f[2] for f in found)
            summary.append(f"| {shape} | {'0-63' if padded else 'none'} | passes {len(found)} | {slow:.3f} | "
                           f"{fast:.3f} | {slow / max(fast, 1e-9):.2f} | | |")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
