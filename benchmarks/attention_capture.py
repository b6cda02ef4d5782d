"""Attention-capture cost on an 8B-shaped Llama (random weights, built from a config: no download).

Prints, per context length: the time of a plain teacher-forced pass of an FP8 path (prompt chunk +
continuation chunk, what `score` runs), the reference + path pair a run already makes for its
teacher-forced metrics, and capture in isolated and end-to-end mode (which includes its own reference
pass), torch only and with the path's Triton decode kernel run on the sampled rows (`kernel=triton`: what
a run of this path on CUDA captures), with ratios against both baselines and peak GPU memory of each.
CUDA only.

    python benchmarks/attention_capture.py [--contexts 2048,8192] [--reply 64] [--heads 8] [--rows 16]
"""

from __future__ import annotations

import argparse
import time

import torch

from harness.kv_paths import attention
from harness.kv_paths.capture import CaptureSample
from harness.kv_paths.spec import parse_path
from harness.replay.attention import AttentionOptions, chunks_for, measure_turn
from harness.kv_paths.cache import build_cache, cache_kwargs, unit_scales

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=16384,
                rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


VARIANTS = (("isolated", None), ("end-to-end", None), ("isolated", "triton"), ("end-to-end", "triton"))


def build_model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    attention.register()
    config = LlamaConfig(**(LLAMA_8B | {"num_hidden_layers": layers}))
    config._attn_implementation = attention.ATTENTION_NAME
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # initialise in bf16: no fp32 copy of 8B weights
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    return model


@torch.inference_mode()
def plain_pass(model, kv_path, scales, prompt, reply) -> None:
    cache = build_cache(model.config, kv_path, scales)
    for chunk in chunks_for(kv_path, prompt, reply):
        model(input_ids=torch.tensor([chunk], device="cuda"), **cache_kwargs(model, cache), use_cache=True,
              logits_to_keep=1)


def timed(fn, repeat: int) -> tuple[float, float]:
    """(median seconds, peak GiB above what was allocated before)."""
    fn()  # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return sorted(times)[len(times) // 2], peak


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--reply", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    model = build_model(args.layers)
    weights = torch.cuda.memory_allocated() / 2**30
    kv_path = parse_path("fp8_e4m3")
    scales = unit_scales(model.config)
    print(f"model: Llama 8B shape, {args.layers} layers, random bf16 weights {weights:.1f} GiB on "
          f"{torch.cuda.get_device_name()}; path {kv_path.canonical}; sample {args.heads} heads x {args.rows} rows")
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        ids = torch.randint(3, 128000, (context,), generator=torch.Generator().manual_seed(context)).tolist()
        prompt, reply = ids[: context - args.reply], ids[context - args.reply:]
        sample = CaptureSample(args.heads, args.rows)
        plain_t, plain_m = timed(lambda: plain_pass(model, kv_path, scales, prompt, reply), args.repeat)
        pair_t, pair_m = timed(lambda: (plain_pass(model, None, None, prompt, reply),
                                        plain_pass(model, kv_path, scales, prompt, reply)), args.repeat)
        row = {"context": context, "plain_s": plain_t, "plain_gib": plain_m, "pair_s": pair_t, "variants": []}
        for mode, kernel in VARIANTS:
            options = AttentionOptions(mode=mode, sample=sample)
            result = {}

            def capture():
                result["turn"] = measure_turn(model, torch.device("cuda"), kv_path, scales, prompt, reply, options,
                                              kernel=kernel)

            t, m = timed(capture, args.repeat)
            print(f"  {context} {mode} kernel={kernel or '-'}: {t:.3f} s ({t / plain_t:.2f}x plain)", flush=True)
            summary = result["turn"].summary
            row["variants"].append((mode, kernel or "-", t, m, summary.get("attn_out_rel_err_max"),
                                    summary.get("attn_kernel_vs_torch_max", float("nan")), len(result["turn"].rows)))
        rows.append(row)
        torch.cuda.empty_cache()
    print(f"\n{'context':>7} {'plain s':>8} {'plain GiB':>9} {'ref+path s':>10} | {'mode':>10} {'kernel':>6} "
          f"{'capture s':>9} {'x plain':>7} {'x ref+path':>10} {'peak GiB':>8} {'rows':>6} {'out_err max':>11} "
          f"{'kern vs torch':>13}")
    for row in rows:
        for mode, kernel, t, m, err, vs_torch, n in row["variants"]:
            print(f"{row['context']:>7} {row['plain_s']:>8.3f} {row['plain_gib']:>9.2f} {row['pair_s']:>10.3f} | "
                  f"{mode:>10} {kernel:>6} {t:>9.3f} {t / row['plain_s']:>7.2f} {t / row['pair_s']:>10.2f} {m:>8.2f} "
                  f"{n:>6} {err:>11.4g} {vs_torch:>13.3g}")
    print(f"peak GiB: above the {weights:.1f} GiB of weights; capture keeps the reference's attention outputs "
          f"in isolated mode (the activation size of one chunk per layer)")


if __name__ == "__main__":
    main()
