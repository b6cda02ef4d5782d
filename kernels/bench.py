"""Decode benchmarks on the GPU: `python -m kernels.bench [--quick] [--no-sweep]`. Prints markdown tables.

GQA (32 query / 8 KV heads, head_dim 128, page 16): our FP8 decode vs torch SDPA on a contiguous BF16 cache
(the 4 query heads of a KV head passed as 4 query rows, so SDPA reads each KV head once) vs the workaround
"dequantise the whole FP8 cache to BF16 (fp8 -> fp32 -> bf16), then SDPA"; plus our kernel on a paged BF16 cache.
MLA (16 heads, latent 512 + RoPE 64, page 64): our FP8 vs our BF16 vs "dequantise everything, then our BF16".
Columns: median ms (triton.testing.do_bench, L2 flushed between runs); GB/s of the cache bytes that the row's
attention must read (for the workaround: its FP8 input); that as a fraction of the measured device-to-device
copy bandwidth ((read + write) bytes / s of a 1 GiB copy); speed-up against the BF16 row.
Unless --no-sweep, launch configurations are first swept at batch 8, context 32k and the fastest is used for
the tables (the launchers' defaults are the result of that sweep on an H100; see kernels/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import datetime
import itertools

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from kernels import reference as ref
from kernels.decode_attention import decode_attention
from kernels.mla_decode import mla_decode

BATCHES = (1, 8, 32)
CONTEXTS = (1024, 8192, 32768, 131072)
Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
MLA_HEADS, LATENT_DIM, ROPE_DIM, MLA_PAGE = 16, 512, 64, 64
FP8 = torch.float8_e4m3fn
GIB = 1 << 30


def _ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting read + write."""
    src = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * GIB / (_ms(lambda: dst.copy_(src)) * 1e-3)


def _fits(needed_bytes: float) -> bool:
    torch.cuda.empty_cache()
    return needed_bytes < 0.85 * torch.cuda.mem_get_info()[0]


def _fill_fp8(cache: torch.Tensor) -> torch.Tensor:
    """Random codes in range (chunked, no big fp32 temporary)."""
    flat = cache.view(-1)
    for i in range(0, flat.numel(), 1 << 28):
        chunk = flat[i:i + (1 << 28)]
        chunk.copy_(torch.randn(chunk.shape, device="cuda", dtype=torch.bfloat16).mul_(16))
    return cache


def _identity_table(batch: int, ctx: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b owns pages [b * pages, (b + 1) * pages): the workaround can view the cache per sequence."""
    pages = ctx // page
    table = torch.arange(batch * pages, dtype=torch.int32, device="cuda").view(batch, pages)
    return table, torch.full((batch,), ctx, dtype=torch.int32, device="cuda")


def _splits(ctas_per_sm: float | None, programs: int, ctx: int) -> int | None:
    """num_splits giving about ctas_per_sm programs per SM (None: the launcher's own choice)."""
    if ctas_per_sm is None:
        return None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return max(1, min(triton.cdiv(int(ctas_per_sm * sms), programs), triton.cdiv(ctx, 256)))


def bench_gqa(batch: int, ctx: int, tuned: dict) -> list[tuple[str, float, float]] | None:
    """[(method, ms, bytes that must be read)], or None when the shape does not fit."""
    fp8_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM                     # K + V, 1 byte each
    if not _fits(7 * fp8_bytes):                                            # workaround peak: see below
        return None
    sm_scale = HEAD_DIM ** -0.5
    group = Q_HEADS // KV_HEADS
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q_rows = q.view(batch, KV_HEADS, group, HEAD_DIM)                      # GQA group as query rows
    table, seq_lens = _identity_table(batch, ctx, PAGE)
    shape = (batch * ctx // PAGE, PAGE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (_fill_fp8(torch.empty(shape, dtype=FP8, device="cuda")) for _ in range(2))
    scale = torch.tensor(0.01, device="cuda")
    cfg, ctas = tuned.get("gqa", ({}, None))
    splits = _splits(ctas, batch * KV_HEADS, ctx)
    rows = [("ours FP8", _ms(lambda: decode_attention(q, k_cache, v_cache, table, seq_lens, scale, scale, sm_scale,
                                                      splits, **cfg)), fp8_bytes)]

    def workaround():   # peak: fp8 caches + one fp32 temporary (2x) + both bf16 copies (2x) + SDPA copies
        k = ref.dequantize(k_cache, scale, torch.bfloat16).view(batch, ctx, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = ref.dequantize(v_cache, scale, torch.bfloat16).view(batch, ctx, KV_HEADS, HEAD_DIM).transpose(1, 2)
        return F.scaled_dot_product_attention(q_rows, k, v, scale=sm_scale)

    rows.append(("dequantise all + SDPA", _ms(workaround), fp8_bytes))
    k_cache = v_cache = None                                              # free before the BF16 copies
    k_bf16, v_bf16 = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rows.append(("ours BF16 (paged)", _ms(lambda: decode_attention(q, k_bf16, v_bf16, table, seq_lens, None, None,
                                                                   sm_scale, splits, **cfg)), 2 * fp8_bytes))
    k_sdpa, v_sdpa = (t.view(batch, ctx, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous() for t in (k_bf16, v_bf16))
    k_bf16 = v_bf16 = None
    rows.insert(0, ("torch SDPA BF16", _ms(lambda: F.scaled_dot_product_attention(q_rows, k_sdpa, v_sdpa, scale=sm_scale)),
                    2 * fp8_bytes))
    return rows


def bench_mla(batch: int, ctx: int, tuned: dict) -> list[tuple[str, float, float]] | None:
    fp8_bytes = batch * ctx * (LATENT_DIM + ROPE_DIM)
    if not _fits(9 * fp8_bytes):
        return None
    q_latent = torch.randn(batch, MLA_HEADS, LATENT_DIM, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, MLA_HEADS, ROPE_DIM, device="cuda", dtype=torch.bfloat16)
    table, seq_lens = _identity_table(batch, ctx, MLA_PAGE)
    shape = (batch * ctx // MLA_PAGE, MLA_PAGE, LATENT_DIM + ROPE_DIM)
    cache = _fill_fp8(torch.empty(shape, dtype=FP8, device="cuda"))
    scale, sm_scale = torch.tensor(0.01, device="cuda"), 192 ** -0.5
    programs = batch * triton.cdiv(MLA_HEADS, 16)

    def run(c, s, kind):
        cfg, ctas = tuned.get(kind, ({}, None))
        return mla_decode(q_latent, q_pe, c, table, seq_lens, s, sm_scale, _splits(ctas, programs, ctx), **cfg)

    rows = [("ours FP8", _ms(lambda: run(cache, scale, "mla")), fp8_bytes)]
    cache_bf16 = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    rows.insert(0, ("ours BF16", _ms(lambda: run(cache_bf16, None, "mla_bf16")), 2 * fp8_bytes))
    cache_bf16 = None
    rows.append(("dequantise all + ours BF16",
                 _ms(lambda: run(ref.dequantize(cache, scale, torch.bfloat16), None, "mla_bf16")), fp8_bytes))
    return rows


GQA_CONFIGS = [dict(block_n=64, num_warps=4, num_stages=2, prefetch=False),
               dict(block_n=128, num_warps=4, num_stages=2, prefetch=False),
               dict(block_n=32, num_warps=4, num_stages=1, prefetch=True),
               dict(block_n=64, num_warps=4, num_stages=1, prefetch=True),
               dict(block_n=64, num_warps=8, num_stages=1, prefetch=True),
               dict(block_n=128, num_warps=8, num_stages=1, prefetch=True),
               dict(block_n=32, num_warps=2, num_stages=1, prefetch=True)]
MLA_CONFIGS = [dict(block_n=32, num_warps=4, num_stages=2, prefetch=False),
               dict(block_n=32, num_warps=8, num_stages=2, prefetch=False),
               dict(block_n=64, num_warps=8, num_stages=1, prefetch=False),
               dict(block_n=16, num_warps=4, num_stages=1, prefetch=True),
               dict(block_n=32, num_warps=8, num_stages=1, prefetch=True),
               dict(block_n=64, num_warps=8, num_stages=1, prefetch=True)]
CTA_TARGETS = (None, 2, 3, 4, 8)   # programs per SM; None = the launcher's default


def sweep(kind: str, batch: int = 8, ctx: int = 32768) -> tuple[list[str], tuple[dict, float | None]]:
    """Median ms of launch configurations for one shape; returns the lines and the fastest (config, CTAs/SM)."""
    table, seq_lens = _identity_table(batch, ctx, PAGE if kind == "gqa" else MLA_PAGE)
    scale = torch.tensor(0.01, device="cuda")
    if kind == "gqa":
        q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        shape = (batch * ctx // PAGE, PAGE, KV_HEADS, HEAD_DIM)
        k, v = (_fill_fp8(torch.empty(shape, dtype=FP8, device="cuda")) for _ in range(2))
        call = lambda splits, **kw: decode_attention(q, k, v, table, seq_lens, scale, scale, 0.088, splits, **kw)  # noqa: E731
        configs, programs = GQA_CONFIGS, batch * KV_HEADS
    else:
        q_latent = torch.randn(batch, MLA_HEADS, LATENT_DIM, device="cuda", dtype=torch.bfloat16)
        q_pe = torch.randn(batch, MLA_HEADS, ROPE_DIM, device="cuda", dtype=torch.bfloat16)
        shape = (batch * ctx // MLA_PAGE, MLA_PAGE, LATENT_DIM + ROPE_DIM)
        if kind == "mla":
            cache, s = _fill_fp8(torch.empty(shape, dtype=FP8, device="cuda")), scale
        else:
            cache, s = torch.randn(shape, device="cuda", dtype=torch.bfloat16), None
        call = lambda splits, **kw: mla_decode(q_latent, q_pe, cache, table, seq_lens, s, 0.072, splits, **kw)  # noqa: E731
        configs, programs = MLA_CONFIGS, batch * triton.cdiv(MLA_HEADS, 16)
    lines = [f"sweep {kind} batch {batch} ctx {ctx}: block_n num_warps num_stages prefetch, CTAs/SM -> ms"]
    best = (float("inf"), {}, None)
    for cfg in configs:
        timings = []
        for ctas in CTA_TARGETS:
            try:
                ms = _ms(lambda: call(_splits(ctas, programs, ctx), **cfg))
            except Exception as e:   # noqa: BLE001 - an out-of-resources config is a result, not a failure
                timings.append(f"{ctas}:{type(e).__name__}")
                continue
            timings.append(f"{ctas}:{ms:.4f}")
            best = min(best, (ms, cfg, ctas), key=lambda t: t[0])
        lines.append(f"  {cfg['block_n']:4d} {cfg['num_warps']:2d} {cfg['num_stages']:2d} {cfg['prefetch']!s:5s} | "
                     + "  ".join(timings))
    lines.append(f"  best: {best[1]} CTAs/SM {best[2]} -> {best[0]:.4f} ms")
    return lines, (best[1], best[2])


def _table(title: str, bench, copy_bw: float, batches, contexts, tuned: dict) -> list[str]:
    lines = [f"### {title}", "", "| batch | context | method | ms (median) | GB/s | of copy BW | speed-up vs BF16 |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for batch, ctx in itertools.product(batches, contexts):
        rows = bench(batch, ctx, tuned)
        if rows is None:
            lines.append(f"| {batch} | {ctx} | skipped: does not fit in GPU memory | | | | |")
            continue
        base_ms = rows[0][1]
        for method, ms, nbytes in rows:
            gbs = nbytes / (ms * 1e-3) / 1e9
            lines.append(f"| {batch} | {ctx} | {method} | {ms:.4f} | {gbs:.0f} | {gbs * 1e9 / copy_bw:.0%} | "
                         f"{base_ms / ms:.2f}x |")
        print("\n".join(lines[-len(rows):]), flush=True)
        torch.cuda.empty_cache()
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 8, context 32k only")
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweep")
    args = parser.parse_args()
    batches, contexts = ((8,), (32768,)) if args.quick else (BATCHES, CONTEXTS)
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    header = [f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}; "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
              f"measured D2D copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)", ""]
    print("\n".join(header), flush=True)
    tuned = {}
    if not args.no_sweep:
        for kind in ("gqa", "mla", "mla_bf16"):
            lines, tuned[kind] = sweep(kind)
            print("\n".join(lines), flush=True)
            torch.cuda.empty_cache()
    header += [f"launch configurations (swept at batch 8, context 32k; CTAs/SM None = launcher default): "
               f"{ {k: v for k, v in tuned.items()} }", ""]
    out = header + _table(f"GQA decode, {Q_HEADS} q / {KV_HEADS} kv heads, head_dim {HEAD_DIM}, e4m3 cache",
                          bench_gqa, copy_bw, batches, contexts, tuned)
    out += _table(f"MLA decode, {MLA_HEADS} heads, latent {LATENT_DIM} + rope {ROPE_DIM}, e4m3 cache",
                  bench_mla, copy_bw, batches, contexts, tuned)
    print("\n" + "\n".join(out))


if __name__ == "__main__":
    main()
