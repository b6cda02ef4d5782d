"""Decode benchmarks on the GPU: `python -m kernels.bench [--quick] [--sweep]`. Prints markdown tables.

GQA (32 query / 8 KV heads, head_dim 128, page 16): our FP8 decode vs torch SDPA on a contiguous BF16 cache
(the 4 query heads of a KV head passed as 4 query rows, so SDPA reads each KV head once) vs the workaround
"dequantise the whole FP8 cache to BF16 (fp8 -> fp32 -> bf16), then SDPA"; plus our kernel on a paged BF16 cache.
A "qk_fp8" row: our FP8 kernel with Q quantised per head and Q.K on fp8 tensor cores (an option; extra error).
FP8 attention rows: P (and Q) in e4m3 (prob_scale 1/448, q_scale per head), P.V on the e4m3 V codes; a table
of each option's extra error against fp64 follows the GQA table.
MLA (16 and 128 heads, latent 512 + RoPE 64, page 64): our FP8 (and its fp8_mma option: Q and P in e4m3 on fp8
tensor cores) vs our BF16 (and session 4's BF16 kernel) vs "dequantise everything, then our BF16".
Columns: median GPU ms of one call replayed from a CUDA graph (triton.testing.do_bench, L2 flushed between
replays; as in graph decode, the host cost stays out); host µs: median CPU time of one eager call with the GPU
idle (Python checks, allocations, Triton's launcher and its per-call TMA descriptor encoding), which an eager
step pays on top unless the GPU work behind it is longer; GB/s of the cache bytes that the row's attention must
read (for the workaround: its FP8 input); that as a fraction of the measured device-to-device copy bandwidth
((read + write) bytes / s of a 1 GiB copy); speed-up against the BF16 row; err: the row's kernel (its launch
configuration) on kernels.tune's check inputs (ragged lengths, shuffled pages): max error against fp64 attention
of the stored values over torch bf16 SDPA's max error on the same inputs (the GPU tests' measure; the FP8 rows'
ratio is what FP8 costs against BF16; fp8_mma and FP8 attention rows: against the unquantised Q / P).
Block-scaled rows (NVFP4, MXFP8, INT4 / INT8 per token-head, MXFP4 against torch SDPA BF16): kernels/bench_block_scaled.py,
after the GQA table (--no-block-scaled skips them).
Launch configurations: this GPU's entry in kernels/configs.py (printed before the tables); with --sweep, first
swept by kernels.tune at batch 8, context 32k (each candidate checked against fp64) and the fastest used.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from kernels import reference as ref
from kernels.configs import KINDS, describe, launch_config
from kernels.decode_attention import decode_attention
from kernels.mla_decode import CUDA_FALLBACK, mla_decode
from kernels.tune_mla import check_fp8_mma
from kernels.tune import (FP8_ATTENTION_OPTIONS, GQA_QUICK, _ms, attention_kwargs, check_fp8_attention, check_gqa,
                          check_mla, host_us)

BATCHES = (1, 8, 32)
CONTEXTS = (1024, 8192, 32768, 131072)
Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
LATENT_DIM, ROPE_DIM, MLA_PAGE = 512, 64, 64
FP8 = torch.float8_e4m3fn
GIB = 1 << 30
# The qk_fp8 row (Q quantised per head, Q.K on fp8 tensor cores): tokens as M, so Hopper's fp8 wgmma applies.
QK_FP8 = dict(swap=True, num_stages=3)
# FP8 attention rows (kernels/decode_attention.py; the gqa_fp8_pv entry of kernels/configs.py): P in e4m3 for P.V
# over the e4m3 V codes, and Q too; their extra error against fp64 is the table printed after these.
FP8_ATTENTION_ROWS = (("ours FP8, fp8 P.V (prob_scale)", "p"), ("ours FP8, fp8 Q + P (q_scale, prob_scale)", "q+p"))
# The session-4 MLA BF16 configurations (the old kernel), kept as a row: [16 heads, >= 64 heads].
MLA_SESSION4 = [dict(block_n=32, num_warps=8, num_stages=2, prefetch=False, swap=False, programs_per_sm=2, block_h=16,
                     tma=False),
                dict(block_n=32, num_warps=8, num_stages=2, prefetch=False, swap=False, programs_per_sm=4, block_h=64,
                     tma=False)]


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting read + write."""
    src = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * GIB / (do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median") * 1e-3)


ERRORS: dict[tuple, float] = {}


def _err(key: tuple, check) -> float:
    """The row's error ratio (module docstring), computed once per (check, configuration)."""
    if key not in ERRORS:
        torch.manual_seed(1)
        ERRORS[key] = check()
    return ERRORS[key]


def _key(cfg: dict) -> tuple:
    return tuple(sorted(cfg.items()))


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


SPREAD: list[tuple[float, str]] = []   # (relative difference, what) of round 1 vs round 2, printed under the table


def _two_rounds(fns: dict, where: str) -> dict[str, float]:
    """Each function timed in two round-robin rounds (so no row is always first after a warm-up or a
    compile); returns round 2 and notes the largest |round 1 - round 2| / round 2 in SPREAD."""
    first = {label: _ms(fn) for label, fn in fns.items()}
    second = {label: _ms(fn) for label, fn in fns.items()}
    worst = max(fns, key=lambda label: abs(first[label] - second[label]) / second[label])
    SPREAD.append((abs(first[worst] - second[worst]) / second[worst],
                   f"{where} {worst}: {first[worst]:.4f} -> {second[worst]:.4f} ms"))
    return second


def _pv_default() -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = launch_config("gqa_fp8_pv", device)
    return {key: cfg[key] for key in ("block_n", "num_warps", "num_stages", "prefetch", "swap", "widen") if key in cfg}


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
    cfg = tuned.get("gqa_fp8", {})
    pv_cfg = tuned.get("gqa_fp8_pv", {})
    fns = {"ours FP8": lambda: decode_attention(q, k_cache, v_cache, table, seq_lens, scale, scale, sm_scale, **cfg)}
    errs = {"ours FP8": lambda: _err(("gqa", "e4m3", _key(cfg)), lambda: check_gqa(cfg, "e4m3"))}
    if QK_FP8:
        fns["ours FP8, qk_fp8 (Q in fp8)"] = lambda: decode_attention(
            q, k_cache, v_cache, table, seq_lens, scale, scale, sm_scale, qk_fp8=True, **dict(cfg, **QK_FP8))
        errs["ours FP8, qk_fp8 (Q in fp8)"] = lambda: _err(("gqa_qk", _key(cfg)),
                                                           lambda: check_gqa(dict(cfg, **QK_FP8), "e4m3", True))
    for label, option in FP8_ATTENTION_ROWS:
        fns[label] = functools.partial(decode_attention, q, k_cache, v_cache, table, seq_lens, scale, scale, sm_scale,
                                       **pv_cfg, **attention_kwargs(option, q))
        errs[label] = functools.partial(_err, ("gqa_attn", option, _key(pv_cfg)), functools.partial(
            lambda o: check_fp8_attention(pv_cfg or _pv_default(), o)["kernel"], option))
    rows = [(label, ms, fp8_bytes, host_us(fns[label]), errs[label]())
            for label, ms in _two_rounds(fns, f"batch {batch}, {ctx}").items()]
    fns = None
    def workaround():   # peak: fp8 caches + one fp32 temporary (2x) + both bf16 copies (2x) + SDPA copies
        k = ref.dequantize(k_cache, scale, torch.bfloat16).view(batch, ctx, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = ref.dequantize(v_cache, scale, torch.bfloat16).view(batch, ctx, KV_HEADS, HEAD_DIM).transpose(1, 2)
        return F.scaled_dot_product_attention(q_rows, k, v, scale=sm_scale)

    rows.append(("dequantise all + SDPA", _ms(workaround), fp8_bytes, None, None))
    k_cache = v_cache = None                                              # free before the BF16 copies
    k_bf16, v_bf16 = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bf16_cfg = tuned.get("gqa_bf16", {})
    paged = lambda: decode_attention(q, k_bf16, v_bf16, table, seq_lens, None, None, sm_scale, **bf16_cfg)  # noqa: E731
    rows.append(("ours BF16 (paged)", _ms(paged), 2 * fp8_bytes, host_us(paged),
                 _err(("gqa", "bf16", _key(bf16_cfg)), lambda: check_gqa(bf16_cfg, "bf16"))))
    paged = None
    k_sdpa, v_sdpa = (t.view(batch, ctx, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous() for t in (k_bf16, v_bf16))
    k_bf16 = v_bf16 = None
    sdpa_fn = lambda: F.scaled_dot_product_attention(q_rows, k_sdpa, v_sdpa, scale=sm_scale)  # noqa: E731
    sdpa = _two_rounds({"torch SDPA BF16": sdpa_fn}, f"batch {batch}, {ctx}")
    rows.insert(0, ("torch SDPA BF16", sdpa["torch SDPA BF16"], 2 * fp8_bytes, host_us(sdpa_fn), 1.0))
    return rows


def bench_mla(batch: int, ctx: int, tuned: dict, heads: int = 16) -> list[tuple[str, float, float]] | None:
    fp8_bytes = batch * ctx * (LATENT_DIM + ROPE_DIM)
    if not _fits(9 * fp8_bytes):
        return None
    q_latent = torch.randn(batch, heads, LATENT_DIM, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, heads, ROPE_DIM, device="cuda", dtype=torch.bfloat16)
    table, seq_lens = _identity_table(batch, ctx, MLA_PAGE)
    shape = (batch * ctx // MLA_PAGE, MLA_PAGE, LATENT_DIM + ROPE_DIM)
    cache = _fill_fp8(torch.empty(shape, dtype=FP8, device="cuda"))
    scale, sm_scale = torch.tensor(0.01, device="cuda"), 192 ** -0.5
    suffix = "_many_heads" if heads >= 64 else ""

    def run(c, s, kind, **extra):
        return mla_decode(q_latent, q_pe, c, table, seq_lens, s, sm_scale, **tuned.get(kind + suffix, {}), **extra)

    def err(kind: str, fmt: str, cfg: dict | None = None) -> float:
        cfg = tuned.get(kind + suffix, {}) if cfg is None else cfg
        if kind == "mla_fp8_mma":
            return _err(("mla_mma", heads, _key(cfg)), lambda: check_fp8_mma(cfg, heads)["true_q"])
        return _err(("mla", fmt, heads, _key(cfg)), lambda: check_mla(cfg, fmt, heads))

    fp8_fn = lambda: run(cache, scale, "mla_fp8")  # noqa: E731
    mma_fn = lambda: run(cache, scale, "mla_fp8_mma", fp8_mma=True)  # noqa: E731
    rows = [("ours FP8", _ms(fp8_fn), fp8_bytes, host_us(fp8_fn), err("mla_fp8", "e4m3"))]
    fp8_entry = tuned.get("mla_fp8" + suffix) or launch_config("mla_fp8" + suffix, q_latent.device)
    if fp8_entry.get("impl") == "cuda":   # the Triton entry the CUDA kernel replaced
        tile = CUDA_FALLBACK["mla_fp8" + suffix]
        tile_fn = lambda: mla_decode(q_latent, q_pe, cache, table, seq_lens, scale, sm_scale, **tile)  # noqa: E731
        rows.append(("ours FP8, Triton tile kernel", _ms(tile_fn), fp8_bytes, host_us(tile_fn),
                     err("mla_fp8", "e4m3", tile)))
    rows.append(("ours FP8, fp8_mma (Q, P in e4m3)", _ms(mma_fn), fp8_bytes, host_us(mma_fn),
                 err("mla_fp8_mma", "e4m3")))
    cache_bf16 = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    bf16_fn = lambda: run(cache_bf16, None, "mla_bf16")  # noqa: E731
    s4 = MLA_SESSION4[bool(suffix)]
    s4_fn = lambda: mla_decode(q_latent, q_pe, cache_bf16, table, seq_lens, None, sm_scale, **s4)  # noqa: E731
    rows.insert(0, ("ours BF16", _ms(bf16_fn), 2 * fp8_bytes, host_us(bf16_fn), err("mla_bf16", "bf16")))
    rows.insert(1, ("ours BF16, session-4 kernel", _ms(s4_fn), 2 * fp8_bytes, host_us(s4_fn),
                    err("mla_bf16", "bf16", s4)))
    cache_bf16 = bf16_fn = s4_fn = None
    rows.append(("dequantise all + ours BF16",
                 _ms(lambda: run(ref.dequantize(cache, scale, torch.bfloat16), None, "mla_bf16")), fp8_bytes, None,
                 None))
    return rows


def _table(title: str, bench, copy_bw: float, batches, contexts, tuned: dict) -> list[str]:
    lines = [f"### {title}", "", "| batch | context | method | GPU ms (graph) | host µs/call | GB/s | of copy BW | "
             "speed-up vs BF16 | err vs torch bf16 |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for batch, ctx in itertools.product(batches, contexts):
        rows = bench(batch, ctx, tuned)
        if rows is None:
            lines.append(f"| {batch} | {ctx} | skipped: does not fit in GPU memory | | | | |")
            continue
        base_ms = rows[0][1]
        for method, ms, nbytes, host, err in rows:
            gbs = nbytes / (ms * 1e-3) / 1e9
            host_text = "-" if host is None else f"{host:.0f}"
            err_text = "-" if err is None else f"{err:.2f}x"
            lines.append(f"| {batch} | {ctx} | {method} | {ms:.4f} | {host_text} | {gbs:.0f} | "
                         f"{gbs * 1e9 / copy_bw:.0%} | "
                         f"{base_ms / ms:.2f}x | {err_text} |")
        print("\n".join(lines[-len(rows):]), flush=True)
        torch.cuda.empty_cache()
    return lines + [""]


def fp8_attention_errors(tuned: dict) -> list[str]:
    """The extra error of each FP8 attention option against fp64 attention of the unquantised Q and P, over
    torch bf16 SDPA's own error on the same data (kernels.tune.check_fp8_attention; e4m3 cache, ragged lengths)."""
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = tuned.get("gqa_fp8_pv") or launch_config("gqa_fp8_pv", device)
    cfg = {key: cfg[key] for key in ("block_n", "num_warps", "num_stages", "prefetch", "swap", "widen") if key in cfg}
    lines = ["### FP8 attention options: max error against fp64 (unquantised Q and P) over torch bf16 SDPA's", "",
             f"e4m3 cache, 32 q / 8 kv heads, lengths 1/300/4099/77, 5 splits, config {cfg}; emulation = "
             "reference.decode_attention_fp8 (the kernel's definition in fp64); normalised = P quantised after "
             "normalisation (reference.attention_fp8's definition, in fp64).", "",
             "| option | kernel | emulation | normalised | kernel vs emulation |", "|---|---:|---:|---:|---:|"]
    for option in FP8_ATTENTION_OPTIONS:
        e = check_fp8_attention(cfg, option)
        lines.append(f"| {option} | {e['kernel']:.2f}x | {e['emulation']:.2f}x | {e['normalised']:.2f}x | "
                     f"{e['kernel_vs_emulation']:.2f}x |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 8, context 32k only")
    parser.add_argument("--sweep", action="store_true",
                        help="first sweep launch configurations (kernels.tune) and use the fastest correct ones")
    parser.add_argument("--sweep-kinds", default=",".join(KINDS), help="the kinds --sweep sweeps (comma-separated)")
    parser.add_argument("--quick-sweep", action="store_true",
                        help="GQA kinds: sweep only kernels.tune.GQA_QUICK (the default and the 1-stage variants)")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--mla-heads", default="16,128", help="MLA head counts ('' for GQA only)")
    parser.add_argument("--no-gqa", action="store_true", help="MLA tables only")
    parser.add_argument("--no-block-scaled", action="store_true",
                        help="without the GQA rows over block-scaled caches (kernels/bench_block_scaled.py)")
    args = parser.parse_args()
    batches, contexts = ((8,), (32768,)) if args.quick else (
        tuple(int(x) for x in args.batches.split(",")), tuple(int(x) for x in args.contexts.split(",")))
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    device = torch.device("cuda", torch.cuda.current_device())
    header = [f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}; "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
              f"measured D2D copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)", ""]
    print("\n".join(header), flush=True)
    tuned = {}
    if args.sweep:
        from kernels.tune import sweep
        for kind in (k for k in args.sweep_kinds.split(",") if "fp8_mma" not in k):  # fp8_mma: kernels.tune_mla
            quick = GQA_QUICK if args.quick_sweep and kind.startswith("gqa") else None
            lines, tuned[kind] = sweep(kind, mla_heads=128 if kind.endswith("many_heads") else 16, candidates=quick)
            print("\n".join(lines), flush=True)
            torch.cuda.empty_cache()
    header += ["launch configurations that ran" + (" (swept at batch 8, context 32k where marked; the rest "
                                                   "kernels/configs.py):" if args.sweep else " (kernels/configs.py):")]
    header += [f"- {kind}: {tuned[kind]} (swept)" if kind in tuned else f"- {describe(kind, device)}"
               for kind in KINDS]
    header += [f"- qk_fp8 row: the FP8 config with {QK_FP8}", ""]
    print("\n".join(header[-len(KINDS) - 3:]), flush=True)
    out = list(header)
    if not args.no_gqa:
        out += _table(f"GQA decode, {Q_HEADS} q / {KV_HEADS} kv heads, head_dim {HEAD_DIM}, e4m3 cache",
                      bench_gqa, copy_bw, batches, contexts, tuned)
        spread = max(SPREAD, default=(0.0, "none"))
        out += [f"Rows timed twice (round robin), round 2 shown; the largest round-1 vs round-2 difference: "
                f"{spread[0]:.1%} ({spread[1]})", ""]
        out += fp8_attention_errors(tuned)
        print("\n".join(out[-len(FP8_ATTENTION_OPTIONS) - 6:]), flush=True)
    if not args.no_block_scaled:
        from kernels import bench_block_scaled
        out += bench_block_scaled.table_lines(batches, contexts, tuned, copy_bw)
    for heads in (int(h) for h in args.mla_heads.split(",") if h):
        out += _table(f"MLA decode, {heads} heads, latent {LATENT_DIM} + rope {ROPE_DIM}, e4m3 cache",
                      functools.partial(bench_mla, heads=heads), copy_bw, batches, contexts, tuned)
    print("\n" + "\n".join(out))


if __name__ == "__main__":
    main()
