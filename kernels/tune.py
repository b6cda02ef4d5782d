"""Launch-configuration sweep of the decode kernels: `python -m kernels.tune [--kinds gqa_fp8,mla_bf16,...]`.

For each kind (kernels/configs.py KINDS) every candidate configuration is first checked against fp64 attention
on fresh random inputs (ragged lengths, shuffled pages, poisoned output buffers): a configuration whose error
exceeds 2x torch bf16 SDPA's own error on the same values is marked WRONG and never chosen. The rest are timed
(median of CUDA-graph replays under triton.testing.do_bench, L2 flushed: `_ms`) at one shape, by default batch 8, context 32k; the fastest is
printed as a `kernels/configs.py` entry. GQA: 32 q / 8 kv heads, head_dim 128, page 16. MLA: latent 512 +
rope 64, page 64, --mla-heads heads. gqa_fp8_pv (P in fp8) is checked against the fp64 emulation of its own
definition (reference.decode_attention_fp8) instead. `--fp8-attention` sweeps the FP8 attention options (Q and/or
P in e4m3): each option's error against fp64 (kernel, emulation, normalised-P reference) and its time at batch 8
and 32.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kernels import reference as ref
from kernels.configs import KINDS
from kernels.decode_attention import decode_attention, plan_splits
from kernels.mla_decode import mla_decode

GQA_CANDIDATES = [dict(block_n=bn, num_warps=w, num_stages=st, prefetch=False, swap=sw)
                  for bn, w, st, sw in [(128, 4, 2, False), (64, 4, 3, False), (128, 4, 3, False), (128, 8, 2, False),
                                        (64, 4, 2, True), (128, 4, 2, True), (128, 4, 3, True), (128, 8, 2, True),
                                        (256, 8, 2, True), (64, 4, 3, True)]]
# The default and 1-stage variants (no cp.async pipeline): 25% fewer instructions per 128-token tile in the
# Triton 3.6 SASS for sm_90 (1001 vs 1327), loads exposed unless other programs hide them (session 5).
GQA_QUICK = [dict(block_n=bn, num_warps=w, num_stages=st, prefetch=False, swap=False)
             for bn, w, st in [(128, 4, 2), (128, 4, 1), (128, 8, 1), (64, 4, 1), (256, 8, 1)]]
# Session 7: each fp8 tile widened once by inline PTX (`widen`); the V operand then comes by ldmatrix.trans from
# an fp16 tile instead of single-byte shared loads (Triton 3.6 sm_90 SASS: 128 LDS.U8 + 128 STS.U8 -> none).
GQA_QUICK += [dict(block_n=bn, num_warps=w, num_stages=st, prefetch=False, swap=False, widen=True)
              for bn, w, st in [(128, 4, 2), (128, 4, 3), (64, 4, 2), (128, 8, 2), (256, 8, 2)]]
# Session 4's MLA kernel (tma=False); the tile kernel and the fp8_mma option are swept by kernels/tune_mla.py.
MLA_CANDIDATES = [dict(block_n=bn, num_warps=w, num_stages=st, prefetch=pf, swap=sw, block_h=bh, tma=False)
                  for bn, w, st, pf, sw, bh in [(32, 8, 2, False, False, 16), (64, 8, 1, True, False, 16),
                                                (64, 4, 2, False, True, 16), (64, 4, 3, False, True, 16),
                                                (32, 4, 3, False, True, 16), (64, 8, 2, False, True, 16),
                                                (32, 8, 2, False, False, 32), (32, 8, 2, False, False, 64),
                                                (16, 8, 2, False, False, 64), (64, 4, 2, False, True, 32)]]
PROGRAMS_PER_SM = {"gqa": (4, 8, 16, 32), "mla": (2, 4, 8)}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def capture(fn) -> tuple[torch.cuda.CUDAGraph, object]:
    """(a CUDA graph of one call of `fn`, what that captured call returned: the tensors each replay rewrites), `fn`
    called on a side stream first, as torch asks before a capture (compiles and caches warm outside it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def _ms(fn) -> float:
    """Median GPU time of one call of `fn`, replayed from a CUDA graph with L2 flushed between replays
    (triton.testing.do_bench): the per-call host cost (Python checks, Triton's launcher, its TMA descriptor
    encoding, allocations) stays out, as in graph decode; `host_us` measures that cost on its own."""
    fn()                                            # compile and warm up outside the capture
    graph, _ = capture(fn)
    try:
        return do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
    finally:
        del graph
        torch.cuda.synchronize()


def host_us(fn, calls: int = 30) -> float:
    """Median host time of one eager call of `fn` (µs), the GPU idle before each: what a step pays on the CPU
    to launch it (Python checks, allocations, Triton's launcher with its per-call TMA descriptor encoding)."""
    fn()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] * 1e6


def _pages(lengths: list[int], page: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    pages = [-(-n // page) for n in lengths]
    num_blocks = sum(pages) + 3
    order = torch.randperm(num_blocks)
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    for b, p in enumerate(pages):
        table[b, :p] = order[sum(pages[:b]):sum(pages[:b]) + p].int()
    return table.cuda(), torch.tensor(lengths, dtype=torch.int32).cuda(), num_blocks


def _read(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows of one sequence as fp64 (codes or values, unscaled)."""
    page = cache.shape[1]
    raw = cache.view(torch.uint8)[table[: -(-n // page)].long()].view(cache.dtype) if cache.element_size() == 1 \
        else cache[table[: -(-n // page)].long()]
    return raw.flatten(0, 1)[:n].double()


def _poison() -> None:
    """Leave NaN in the caching allocator's free blocks, so outputs the launchers allocate start as NaN."""
    torch.empty(1 << 26, device="cuda").fill_(float("nan"))


def _nan_max(a: float, b: float) -> float:
    """max that keeps NaN (Python's max(0.0, nan) is 0.0: an all-NaN output would pass)."""
    return float("nan") if math.isnan(a) or math.isnan(b) else max(a, b)


def check_gqa(cfg: dict, fmt: str, qk_fp8: bool = False) -> float:
    """Kernel max error / torch bf16 SDPA max error, both against fp64 attention over the stored values."""
    lengths, page, hq, hkv, d = [1, 300, 4099, 77], 16, 32, 8, 128
    table, seq, nb = _pages(lengths, page)
    dtype = FP8.get(fmt, torch.bfloat16)
    k_scale, v_scale = torch.rand(hkv, device="cuda") * 0.02 + 0.005, torch.tensor(0.013, device="cuda")
    caches = [torch.randn(nb, page, hkv, d, device="cuda").mul_(60 if fmt in FP8 else 1).to(dtype) for _ in range(2)]
    q = torch.randn(len(lengths), hq, d, device="cuda", dtype=torch.bfloat16)
    _poison()
    out = decode_attention(q, *caches, table, seq, k_scale, v_scale, d ** -0.5, qk_fp8=qk_fp8, **cfg)[0]
    worst, worst_torch = 0.0, 0.0
    for b, n in enumerate(lengths):
        ks, vs = (k_scale.double().view(1, -1, 1), v_scale.double()) if fmt in FP8 else (1.0, 1.0)
        k = (_read(caches[0], table[b], n) * ks).repeat_interleave(hq // hkv, 1)
        v = (_read(caches[1], table[b], n) * vs).repeat_interleave(hq // hkv, 1)
        s = torch.einsum("hd,lhd->hl", q[b].double(), k) * d ** -0.5
        truth = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v)
        sdpa = F.scaled_dot_product_attention(q[b][None, :, None], k.bfloat16().transpose(0, 1)[None],
                                              v.bfloat16().transpose(0, 1)[None], scale=d ** -0.5)[0, :, 0]
        worst = _nan_max(worst, (out[b].double() - truth).abs().max().item())
        worst_torch = max(worst_torch, (sdpa.double() - truth).abs().max().item())
    return worst / worst_torch if math.isfinite(worst) else float("inf")   # NaN or inf: never <= 2


def check_mla(cfg: dict, fmt: str, heads: int) -> float:
    lengths, page, dc, dr = [1, 300, 4099, 77], 64, 512, 64
    table, seq, nb = _pages(lengths, page)
    dtype = FP8.get(fmt, torch.bfloat16)
    scale = torch.tensor(0.02, device="cuda")
    cache = torch.randn(nb, page, dc + dr, device="cuda").mul_(20 if fmt in FP8 else 0.4).to(dtype)
    ql = torch.randn(len(lengths), heads, dc, device="cuda", dtype=torch.bfloat16)
    qp = torch.randn(len(lengths), heads, dr, device="cuda", dtype=torch.bfloat16)
    sm = (128 + 64) ** -0.5
    _poison()
    out = mla_decode(ql, qp, cache, table, seq, scale if fmt in FP8 else None, sm, **cfg)[0]
    worst, worst_torch = 0.0, 0.0
    for b, n in enumerate(lengths):
        rows = _read(cache, table[b], n) * (scale.double() if fmt in FP8 else 1.0)
        c, pe = rows[:, :dc], rows[:, dc:]
        s = (ql[b].double() @ c.T + qp[b].double() @ pe.T) * sm
        truth = torch.softmax(s, -1) @ c
        kk = torch.cat([c, pe], -1).bfloat16()[None, None].expand(1, heads, n, dc + dr)
        qq = torch.cat([ql[b], qp[b]], -1)[None, :, None]
        sdpa = F.scaled_dot_product_attention(qq, kk, c.bfloat16()[None, None].expand(1, heads, n, dc), scale=sm)[0, :, 0]
        worst = _nan_max(worst, (out[b].double() - truth).abs().max().item())
        worst_torch = max(worst_torch, (sdpa.double() - truth).abs().max().item())
    return worst / worst_torch if math.isfinite(worst) else float("inf")   # NaN or inf: never <= 2


def _timer(kind: str, batch: int, ctx: int, mla_heads: int):
    """A function (cfg, programs_per_sm) -> ms over fresh random data of this shape."""
    if kind.startswith("gqa"):
        page, hq, hkv, d = 16, 32, 8, 128
        shape = (batch * ctx // page, page, hkv, d)
        fp8 = kind.startswith("gqa_fp8")
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).mul_(16).to(dtype) for _ in range(2))
        q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
        s = torch.tensor(0.01, device="cuda") if fp8 else None
        pv = attention_kwargs("p", q) if kind == "gqa_fp8_pv" else {}
        table = torch.arange(batch * ctx // page, dtype=torch.int32, device="cuda").view(batch, -1)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        return lambda cfg, pps, **kw: _ms(lambda: decode_attention(q, k, v, table, lens, s, s, d ** -0.5,
                                                                   programs_per_sm=pps, **cfg, **(kw or pv)))
    page, dc, dr = 64, 512, 64
    shape = (batch * ctx // page, page, dc + dr)
    dtype = torch.float8_e4m3fn if "fp8" in kind else torch.bfloat16
    cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16).mul_(16 if "fp8" in kind else 1).to(dtype)
    ql = torch.randn(batch, mla_heads, dc, device="cuda", dtype=torch.bfloat16)
    qp = torch.randn(batch, mla_heads, dr, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor(0.01, device="cuda") if "fp8" in kind else None
    table = torch.arange(batch * ctx // page, dtype=torch.int32, device="cuda").view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return lambda cfg, pps: _ms(lambda: mla_decode(ql, qp, cache, table, lens, s, 0.072, programs_per_sm=pps, **cfg))


def sweep(kind: str, batch: int = 8, ctx: int = 32768, mla_heads: int = 16,
          candidates: list[dict] | None = None) -> tuple[list[str], dict]:
    """Lines of the sweep table and the fastest correct configuration (with its programs_per_sm)."""
    gqa = kind.startswith("gqa")
    fmt = "e4m3" if "fp8" in kind else "bf16"
    if kind == "gqa_fp8_pv" and candidates is None:
        candidates = [cfg for cfg, _ in FP8_ATTENTION_CANDIDATES]
    candidates = candidates or (GQA_CANDIDATES if gqa else MLA_CANDIDATES)
    time_it = _timer(kind, batch, ctx, mla_heads)
    lines = [f"sweep {kind} batch {batch} ctx {ctx}{'' if gqa else f' heads {mla_heads}'}: config | err ratio | "
             f"programs/SM -> ms"]
    best = (float("inf"), None)
    for cfg in candidates:
        try:
            if kind == "gqa_fp8_pv":   # P in fp8: judged against the fp64 emulation of its definition
                ratio = check_fp8_attention(cfg, "p")["kernel_vs_emulation"]
            else:
                ratio = check_gqa(cfg, fmt) if gqa else check_mla(cfg, fmt, mla_heads)
        except Exception as e:   # noqa: BLE001 - a config that does not compile or fit is a result
            lines.append(f"  {cfg} | {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}")
            continue
        if not ratio <= 2.0:
            lines.append(f"  {cfg} | WRONG: error {ratio:.2f}x torch's")
            continue
        timings = []
        for pps in PROGRAMS_PER_SM["gqa" if gqa else "mla"]:
            ms = time_it(cfg, pps)
            timings.append(f"{pps}:{ms:.4f}")
            if ms < best[0]:
                best = (ms, dict(cfg, programs_per_sm=pps))
        lines.append(f"  {cfg} | {ratio:.2f} | " + "  ".join(timings))
    lines.append(f"  best {kind}: {best[1]} -> {best[0]:.4f} ms")
    return lines, best[1]


def qk_fp8_rows(batch: int = 8, ctx: int = 32768) -> list[str]:
    """The qk_fp8 option (Q quantised per head, Q.K on fp8 tensor cores): its extra error and its time."""
    time_it = _timer("gqa_fp8", batch, ctx, 16)
    lines = [f"qk_fp8 batch {batch} ctx {ctx}: config | err ratio e4m3 (plain -> qk_fp8) | ms plain -> qk_fp8"]
    for cfg in GQA_CANDIDATES[:2] + GQA_CANDIDATES[5:8]:
        try:
            ratios = [f"{check_gqa(cfg, fmt):.2f} -> {check_gqa(cfg, fmt, qk_fp8=True):.2f}" for fmt in ("e4m3",)]
            lines.append(f"  {cfg} | {ratios[0]} | {time_it(cfg, 8):.4f} -> "
                         f"{time_it(cfg, 8, qk_fp8=True):.4f}")
        except Exception as e:   # noqa: BLE001
            lines.append(f"  {cfg} | {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
    return lines


# FP8 attention options of the GQA kernel (kernels/decode_attention.py): Q in e4m3 under q_scale, P in e4m3 under
# prob_scale for P.V. Only the swap layout (tokens as M) reaches Hopper's fp8 wgmma; the plain layout (16-row
# mma.sync) widens fp8 operands to fp16 in registers (PTX of Triton 3.9 for sm_90, kernels/BENCHMARKS.md).
FP8_ATTENTION_OPTIONS = ("none", "q", "q static", "p", "q+p")
FP8_ATTENTION_CANDIDATES = [  # (config, options swept); session 5's first sweep: swap 0.42-0.52 ms, plain 0.23-0.25
    (dict(block_n=128, num_warps=4, num_stages=2, prefetch=False, swap=False), ("none", "q", "p", "q+p")),
    (dict(block_n=128, num_warps=4, num_stages=3, prefetch=False, swap=False), ("p",)),
    (dict(block_n=64, num_warps=4, num_stages=2, prefetch=False, swap=False), ("p",)),
    (dict(block_n=64, num_warps=4, num_stages=3, prefetch=False, swap=False), ("p",)),
    (dict(block_n=128, num_warps=8, num_stages=2, prefetch=False, swap=False), ("p",)),
    (dict(block_n=256, num_warps=8, num_stages=2, prefetch=False, swap=False), ("p",)),
    (dict(block_n=32, num_warps=4, num_stages=1, prefetch=True, swap=False), ("p",)),
    (dict(block_n=128, num_warps=4, num_stages=2, prefetch=False, swap=True), ("p", "q+p")),
]
PROB_SCALE = 1.0 / ref.FP8_MAX["e4m3"]   # the harness's default: the largest probability, 1, onto 448


def attention_kwargs(option: str, q: torch.Tensor) -> dict:
    """decode_attention keywords of an FP8 attention option ("q static": one scale, amax(q) / 448)."""
    kw = {}
    if option in ("q", "q+p"):
        kw["q_scale"] = "dynamic"
    if option == "q static":
        kw["q_scale"] = (q.float().abs().amax() / ref.FP8_MAX["e4m3"]).reshape(())
    if option in ("p", "q+p"):
        kw["prob_scale"] = torch.tensor(PROB_SCALE, device=q.device)
    return kw


def check_fp8_attention(cfg: dict, option: str, fmt: str = "e4m3", num_splits: int = 5) -> dict[str, float]:
    """Errors of one option against fp64 attention of the unquantised Q and P, over torch bf16 SDPA's error:
    kernel, the fp64 emulation of the kernel's definition (ref.decode_attention_fp8, same tiles and splits),
    the normalised-P definition of ref.attention_fp8 (in fp64), and |kernel - emulation|."""
    lengths, page, hq, hkv, d = [1, 300, 4099, 77], 16, 32, 8, 128
    table, seq, nb = _pages(lengths, page)
    dtype = FP8.get(fmt, torch.bfloat16)
    k_scale, v_scale = torch.rand(hkv, device="cuda") * 0.02 + 0.005, torch.tensor(0.013, device="cuda")
    caches = [torch.randn(nb, page, hkv, d, device="cuda").mul_(60 if fmt in FP8 else 1).to(dtype) for _ in range(2)]
    q = torch.randn(len(lengths), hq, d, device="cuda", dtype=torch.bfloat16)
    kw = attention_kwargs(option, q)
    _poison()
    block_n = cfg.get("block_n", 128)
    out = decode_attention(q, *caches, table, seq, k_scale, v_scale, d ** -0.5, num_splits, **cfg, **kw)[0]
    tps = plan_splits(table.shape[1] * page, len(lengths) * hkv, block_n, 8, q.device, num_splits)[1]
    emul = ref.decode_attention_fp8(q, *caches, table, seq, k_scale, v_scale, d ** -0.5, kw.get("q_scale"),
                                    kw.get("prob_scale"), block_n, tps)[0]
    errs = dict(kernel=0.0, emulation=0.0, normalised=0.0, kernel_vs_emulation=0.0)
    worst_torch = 0.0
    q_used, q_s = ref.quantize_query(q, kw["q_scale"]) if "q_scale" in kw else (q.double(), torch.ones(()).double())
    q_used = q_used * q_s.to(q.device)
    for b, n in enumerate(lengths):
        ks, vs = (k_scale.double().view(1, -1, 1), v_scale.double()) if fmt in FP8 else (1.0, 1.0)
        k = (_read(caches[0], table[b], n) * ks).repeat_interleave(hq // hkv, 1)
        v = (_read(caches[1], table[b], n) * vs).repeat_interleave(hq // hkv, 1)
        scores = torch.einsum("hd,lhd->hl", q[b].double(), k) * d ** -0.5
        truth = torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v)
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q_used[b], k) * d ** -0.5, -1)
        if "prob_scale" in kw:
            probs = ref.quantize(probs, PROB_SCALE, "e4m3").double() * PROB_SCALE
        normalised = torch.einsum("hl,lhd->hd", probs, v)
        sdpa = F.scaled_dot_product_attention(q[b][None, :, None], k.bfloat16().transpose(0, 1)[None],
                                              v.bfloat16().transpose(0, 1)[None], scale=d ** -0.5)[0, :, 0]
        for key, got, want in (("kernel", out[b], truth), ("emulation", emul[b], truth),
                               ("normalised", normalised, truth), ("kernel_vs_emulation", out[b], emul[b])):
            errs[key] = _nan_max(errs[key], (got.double() - want).abs().max().item())
        worst_torch = max(worst_torch, (sdpa.double() - truth).abs().max().item())
    return {key: value / worst_torch if math.isfinite(value) else float("inf") for key, value in errs.items()}


def fp8_attention_sweep(batches=(8, 32), ctx: int = 32768, pps_list=(4, 8, 16)) -> list[str]:
    """Every FP8_ATTENTION_CANDIDATES (config, option): its errors (check_fp8_attention) and its time at
    each batch, the best of pps_list programs per SM at the first batch, that pps at the others."""
    timers = {batch: _timer("gqa_fp8", batch, ctx, 16) for batch in batches}
    q_probe = torch.randn(8, 32, 128, device="cuda", dtype=torch.bfloat16)
    lines = [f"fp8 attention sweep, ctx {ctx}: config | option | err/torch: kernel emulation normalised "
             f"kernel-vs-emulation | batch {batches[0]}: pps->ms | other batches ms"]
    for cfg, options in FP8_ATTENTION_CANDIDATES:
        for option in options:
            try:
                e = check_fp8_attention(cfg, option)
                kw = attention_kwargs(option, q_probe)
                first = {pps: timers[batches[0]](cfg, pps, **kw) for pps in pps_list}
                pps = min(first, key=first.get)
                rest = [f"b{b}:{timers[b](cfg, pps, **kw):.4f}" for b in batches[1:]]
            except Exception as ex:   # noqa: BLE001 - a config that does not compile or fit is a result
                why = str(ex).splitlines()[0][:100] if str(ex) else ""
                lines.append(f"  {cfg} | {option} | {type(ex).__name__}: {why}")
                print(lines[-1], flush=True)
                continue
            lines.append(f"  {cfg} | {option} | {e['kernel']:.2f} {e['emulation']:.2f} {e['normalised']:.2f} "
                         f"{e['kernel_vs_emulation']:.2f} | " + " ".join(f"{p}:{ms:.4f}" for p, ms in first.items())
                         + " | " + " ".join(rest))
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--mla-heads", type=int, default=16)
    parser.add_argument("--qk-fp8", action="store_true", help="also measure the qk_fp8 option")
    parser.add_argument("--first", type=int, default=0, help="only the first N candidates of each kind")
    parser.add_argument("--quick", action="store_true", help="GQA kinds: only GQA_QUICK")
    parser.add_argument("--fp8-attention", action="store_true",
                        help="sweep the FP8 attention options (q_scale / prob_scale) at batch 8 and 32")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}", flush=True)
    if args.fp8_attention:
        fp8_attention_sweep((args.batch, 32), args.ctx)
    for kind in (k for k in args.kinds.split(",") if k):
        pool = (GQA_QUICK if args.quick else GQA_CANDIDATES) if kind.startswith("gqa") else MLA_CANDIDATES
        lines, best = sweep(kind, args.batch, args.ctx, args.mla_heads, pool[:args.first] if args.first else pool)
        print("\n".join(lines), flush=True)
        torch.cuda.empty_cache()
    if args.qk_fp8:
        print("\n".join(qk_fp8_rows(args.batch, args.ctx)), flush=True)


if __name__ == "__main__":
    main()
