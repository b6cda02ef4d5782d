"""MLA launch-configuration sweep with parallel compilation: `python -m kernels.tune_mla [--write]`.

Like kernels.tune (whose fp64 check it reuses), for the MLA kernels of kernels/mla_decode.py including the tile
kernel (`tma`) and the fp8_mma option: worker processes compile each candidate (Triton's on-disk cache is shared),
check it against fp64 attention on ragged lengths with shuffled pages (err ratio = kernel max error / torch bf16
SDPA's max error on the same values; > 2 is WRONG for the exact variants, fp8_mma's ratio is its measured extra
error) and run it once on the timing shape; the parent then times every correct candidate (CUDA-graph replays,
kernels.tune._ms: median of triton.testing.do_bench, L2 flushed) at batch 8, context 32k, for 1, 2 and 4 programs per SM, and prints the
fastest per kind; --write puts them into kernels/configs.py (the H100 MLA block), --write-from JSON does the same
from a run's tune_mla.json. Kinds `mla_fp8_mma*` are the fp8_mma option's entries.

Triton's pipeliner spends one stage on the page-index load that a TMA tile's row depends on, and a tile whose
consumer reads it back from shared memory (mma.sync operands, fp8 -> fp16, fp8_mma's transposed copy) one more:
the tile kernel double-buffers the latent tile only from num_stages 4 (wgmma from shared) or 5 (the others),
read off the TTGIR of Triton 3.6's sm_90 build; hence the stage counts below.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time

CONFIGS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs.py")
MLA_TC = dict(prefetch=False, tma=True)


def _tc(block_n: int, num_warps: int, num_stages: int, swap: bool, block_h: int, widen: bool = False,
        split: bool = False) -> dict:
    cfg = dict(MLA_TC, block_n=block_n, num_warps=num_warps, num_stages=num_stages, swap=swap, block_h=block_h)
    cfg = dict(cfg, widen=True) if widen else cfg
    return dict(cfg, split_latent=True) if split else cfg


def _v4(block_n: int, num_warps: int, num_stages: int, block_h: int, prefetch: bool = False) -> dict:
    return dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages, prefetch=prefetch, swap=False,
                block_h=block_h, tma=False)


CANDIDATES = {   # kind -> [(label, launch keywords)]; "v4" = session 4's kernel, "tma" = the tile kernel
    "mla_bf16": [("tma 32/4/5", _tc(32, 4, 5, False, 16)), ("tma swap 64/4/4", _tc(64, 4, 4, True, 16)),
                 # session 7: the latent in 4 chunks (split_latent; _mla_decode_split_kernel)
                 ("split 32/4/5", _tc(32, 4, 5, False, 16, split=True)),
                 ("split 32/4/4", _tc(32, 4, 4, False, 16, split=True)),
                 ("split 64/4/4", _tc(64, 4, 4, False, 16, split=True)),
                 ("split 32/8/5", _tc(32, 8, 5, False, 16, split=True)),
                 ("split 64/8/4", _tc(64, 8, 4, False, 16, split=True))],
    "mla_fp8": [("v4 64/8/1 prefetch", _v4(64, 8, 1, 16, prefetch=True)), ("tma 32/4/5", _tc(32, 4, 5, False, 16)),
                # session 7: each fp8 tile widened once by inline PTX (widen), and the latent in 4 chunks
                ("tma widen 32/4/5", _tc(32, 4, 5, False, 16, True)),
                ("split widen 32/4/5", _tc(32, 4, 5, False, 16, True, True)),
                ("split widen 32/4/4", _tc(32, 4, 4, False, 16, True, True)),
                ("split widen 64/4/4", _tc(64, 4, 4, False, 16, True, True)),
                ("split widen 64/4/5", _tc(64, 4, 5, False, 16, True, True)),
                ("split widen 32/8/5", _tc(32, 8, 5, False, 16, True, True)),
                ("split widen 64/8/4", _tc(64, 8, 4, False, 16, True, True)),
                ("split 32/4/5", _tc(32, 4, 5, False, 16, False, True))],
    "mla_fp8_mma": [("tma swap 64/8/5", _tc(64, 8, 5, True, 16)), ("tma swap 64/4/5", _tc(64, 4, 5, True, 16))],
    "mla_bf16_many_heads": [("tma h64 32/8/5", _tc(32, 8, 5, False, 64)),
                            ("split h64 32/8/5", _tc(32, 8, 5, False, 64, split=True)),
                            ("split h64 32/8/4", _tc(32, 8, 4, False, 64, split=True)),
                            ("split h64 16/8/5", _tc(16, 8, 5, False, 64, split=True)),
                            ("split h64 64/8/3", _tc(64, 8, 3, False, 64, split=True))],
    "mla_fp8_many_heads": [("tma h64 32/8/2", _tc(32, 8, 2, False, 64)),
                           ("tma widen h64 32/8/5", _tc(32, 8, 5, False, 64, True)),
                           ("split widen h64 32/8/5", _tc(32, 8, 5, False, 64, True, True)),
                           ("split widen h64 32/8/4", _tc(32, 8, 4, False, 64, True, True)),
                           ("split widen h64 32/8/3", _tc(32, 8, 3, False, 64, True, True)),
                           ("split widen h64 16/8/5", _tc(16, 8, 5, False, 64, True, True)),
                           ("split widen h64 64/8/3", _tc(64, 8, 3, False, 64, True, True)),
                           ("split widen h16 32/4/5", _tc(32, 4, 5, False, 16, True, True))],
    "mla_fp8_mma_many_heads": [("tma h64 32/8/5", _tc(32, 8, 5, False, 64)), ("tma h64 64/8/5", _tc(64, 8, 5, False, 64)),
                               ("tma h64 64/8/2", _tc(64, 8, 2, False, 64))],
}
PROGRAMS_PER_SM = (1, 2, 4)


def _heads(kind: str) -> int:
    return 128 if kind.endswith("many_heads") else 16


def check_fp8_mma(cfg: dict, heads: int) -> dict:
    """fp8_mma's error split in two, on check_mla's inputs: against fp64 attention of the true bf16 Q and of
    the Q it actually multiplied (per head q_s * fp8(q / q_s)), each over torch bf16 SDPA's error on that Q,
    and the lse's max abs error against fp64 of the fp8 Q."""
    import math

    import torch
    import torch.nn.functional as F

    from kernels import reference as ref
    from kernels.mla_decode import mla_decode
    from kernels.tune import _pages, _poison, _read
    lengths, page, dc, dr = [1, 300, 4099, 77], 64, 512, 64
    table, seq, nb = _pages(lengths, page)
    scale = torch.tensor(0.02, device="cuda")
    cache = torch.randn(nb, page, dc + dr, device="cuda").mul_(20).to(torch.float8_e4m3fn)
    ql = torch.randn(len(lengths), heads, dc, device="cuda", dtype=torch.bfloat16)
    qp = torch.randn(len(lengths), heads, dr, device="cuda", dtype=torch.bfloat16)
    sm = (128 + 64) ** -0.5
    _poison()
    out, lse = mla_decode(ql, qp, cache, table, seq, scale, sm, fp8_mma=True, **cfg)
    q_true = torch.cat([ql, qp], -1).double()
    q_s = (q_true.abs().amax(-1, keepdim=True) / 448.0)
    q_fp8 = ref.quantize(q_true.float() / q_s.float(), 1.0, "e4m3").double() * q_s
    err = {"true_q": [0.0, 0.0], "fp8_q": [0.0, 0.0]}
    lse_err = 0.0
    for b, n in enumerate(lengths):
        rows = _read(cache, table[b], n) * scale.double()
        for name, q in (("true_q", q_true[b]), ("fp8_q", q_fp8[b])):
            s = (q @ rows.T) * sm
            truth = torch.softmax(s, -1) @ rows[:, :dc]
            kk = rows.bfloat16()[None, None].expand(1, heads, n, dc + dr)
            sdpa = F.scaled_dot_product_attention(q.bfloat16()[None, :, None], kk, kk[..., :dc], scale=sm)[0, :, 0]
            got = (out[b].double() - truth).abs().max().item()
            err[name][0] = got if math.isnan(got) else max(err[name][0], got)
            err[name][1] = max(err[name][1], (sdpa.double() - truth).abs().max().item())
            if name == "fp8_q":
                lse_err = max(lse_err, (lse[b].double() - torch.logsumexp(s, -1)).abs().max().item())
    ratios = {name: (e / t if math.isfinite(e) else float("inf")) for name, (e, t) in err.items()}
    return dict(ratios, lse_abs_err=lse_err)


def _prepare(kind: str, label: str, cfg: dict, batch: int, ctx: int) -> dict:
    """Worker: compile, check against fp64 (e4m3 and, for exact fp8 variants, e5m2), run the timing shape once."""
    import torch

    from kernels.tune import _timer, check_mla
    t0 = time.time()
    fmts = ["e4m3"] if "fp8" in kind else ["bf16"]
    if "fp8" in kind and "fp8_mma" not in kind:
        fmts.append("e5m2")
    if "fp8_mma" in kind:
        cfg = dict(cfg, fp8_mma=True)
    try:
        torch.manual_seed(0)
        ratios = {fmt: check_mla(cfg, fmt, _heads(kind)) for fmt in fmts}
        extra = {}
        if "fp8_mma" in kind:
            extra = {f"vs {k}" if k != "lse_abs_err" else k: v for k, v in check_fp8_mma(
                {k: v for k, v in cfg.items() if k != "fp8_mma"}, _heads(kind)).items()}
        timer = _timer(kind, batch, ctx, _heads(kind))
        for pps in PROGRAMS_PER_SM:   # compiles the specialisations the parent will time (and the merge kernels)
            timer_cfg = dict(cfg)
            timer(timer_cfg, pps)
        return dict(kind=kind, label=label, ratios=ratios, extra=extra, seconds=time.time() - t0)
    except Exception as e:   # noqa: BLE001 - a candidate that does not compile or run is a result
        return dict(kind=kind, label=label, error=f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160] if str(e).strip() else ''}",
                    seconds=time.time() - t0)


def _warm(heads: int, row: str) -> str:
    """Worker: compile one MLA row of kernels.bench (its configuration and specialisation) at batch 8, 8k."""
    import torch

    from kernels.bench import MLA_SESSION4, _identity_table
    from kernels.mla_decode import mla_decode
    t0 = time.time()
    batch, ctx, page = 8, 8192, 64
    ql = torch.randn(batch, heads, 512, device="cuda", dtype=torch.bfloat16)
    qp = torch.randn(batch, heads, 64, device="cuda", dtype=torch.bfloat16)
    table, lens = _identity_table(batch, ctx, page)
    fp8 = row.startswith("fp8")
    cache = torch.randn(batch * ctx // page, page, 576, device="cuda").to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    scale = torch.tensor(0.01, device="cuda") if fp8 else None
    extra = dict(fp8_mma=True) if row == "fp8_mma" else MLA_SESSION4[heads >= 64] if row == "bf16_session4" else {}
    mla_decode(ql, qp, cache, table, lens, scale, 0.072, **extra)
    torch.cuda.synchronize()
    return f"warm {heads} heads {row}: {time.time() - t0:.1f} s"


def warm_bench(workers: int) -> None:
    """Compile the MLA kernels that `python -m kernels.bench` will time, in parallel (Triton's disk cache)."""
    jobs = [(heads, row) for heads in (16, 128) for row in ("bf16", "bf16_session4", "fp8", "fp8_mma")]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for line in pool.starmap(_warm, jobs):
            print(line, flush=True)


def matmul_peaks(n: int = 8192) -> str:
    """The MMA ceilings of the roofline: torch bf16 matmul and e4m3 _scaled_mm rates (TFLOP/s, median)."""
    import torch
    from triton.testing import do_bench
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bf16_ms = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    a8, b8, one = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn), torch.tensor(1.0, device="cuda")
    fp8_ms = do_bench(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                      warmup=25, rep=200, return_mode="median")
    return (f"matmul peaks ({n}^3): bf16 {2 * n ** 3 / bf16_ms / 1e9:.0f} TFLOP/s, "
            f"e4m3 _scaled_mm {2 * n ** 3 / fp8_ms / 1e9:.0f} TFLOP/s")


def _prepare_star(args):
    return _prepare(*args)


def _compile_and_check(jobs: list[tuple], workers: int, job_timeout: float, prepare=None) -> list[dict]:
    """`prepare(*job)` (default: this module's `_prepare`) for every job in `workers` spawned processes, each
    result or a timeout named by the job's (kind, label); kernels.ab runs its candidates through this too."""
    t0 = time.time()
    pool = multiprocessing.get_context("spawn").Pool(workers)
    pending = [pool.apply_async(prepare or _prepare, job) for job in jobs]
    prepared = []
    for job, result in zip(jobs, pending):
        try:
            prepared.append(result.get(timeout=max(5.0, job_timeout - (time.time() - t0))))
        except multiprocessing.TimeoutError:
            prepared.append(dict(kind=job[0], label=job[1], error=f"no result within {job_timeout:.0f} s"))
        print(f"  [{time.time() - t0:5.1f} s] {prepared[-1]}", flush=True)
    pool.terminate()
    print(f"compiled and checked {len(jobs)} candidates in {time.time() - t0:.0f} s", flush=True)
    return prepared


def _time_kind(kind: str, results: list[tuple[str, dict, dict]], batch: int, ctx: int) -> tuple[list[str], tuple]:
    """Table lines of one kind and its fastest correct (ms, label, config with programs_per_sm)."""
    from kernels.tune import _timer
    timer = _timer(kind, batch, ctx, _heads(kind))
    lines = [f"{kind} ({_heads(kind)} heads) batch {batch} ctx {ctx}: candidate | err ratio | programs/SM -> ms"]
    best = (float("inf"), "", {})
    for label, cfg, res in results:
        if "error" in res:
            lines.append(f"  {label:22s} | {res['error']}")
            continue
        ratios = " ".join(f"{f} {r:.2f}" for f, r in res["ratios"].items())
        if not all(r <= (64.0 if "fp8_mma" in kind else 2.0) for r in res["ratios"].values()):
            lines.append(f"  {label:22s} | WRONG: {ratios}")
            continue
        timings = []
        for pps in PROGRAMS_PER_SM:
            ms = timer(dict(cfg, fp8_mma=True) if "fp8_mma" in kind else dict(cfg), pps)
            timings.append(f"{pps}:{ms:.4f}")
            if ms < best[0]:
                best = (ms, label, dict(cfg, programs_per_sm=pps))
        extra = " ".join(f"{k} {v:.3g}" for k, v in res.get("extra", {}).items())
        lines.append(f"  {label:22s} | {ratios} | " + "  ".join(timings) + (f" | {extra}" if extra else ""))
    return lines, best


def _entry(kind: str, cfg: dict) -> str:
    """One kernels/configs.py line (wrapped at 120 columns) for `kind`."""
    keys = ("block_n", "num_warps", "num_stages", "prefetch", "swap", "programs_per_sm", "block_h", "tma", "widen",
            "split_latent", "impl", "bulk", "ctas", "wgmma")
    head, parts = f'    "{kind}": dict(', [f"{k}={json.dumps(cfg[k]) if isinstance(cfg[k], str) else repr(cfg[k])}"
                                           for k in keys if k in cfg]
    lines, line = [], head
    for i, part in enumerate(parts):
        piece = part + (", " if i < len(parts) - 1 else "),")
        if len(line) + len(piece.rstrip()) > 120:
            lines.append(line.rstrip())
            line = " " * len(head)
        line += piece
    return "\n".join(lines + [line])


def write_configs(best: dict[str, dict], path: str = CONFIGS_PATH) -> None:
    """Replace the H100 MLA block of kernels/configs.py: swept kinds get their fastest config, others stay."""
    from kernels.configs import H100_MLA
    with open(path) as f:
        text = f.read()
    begin, end = text.index("# BEGIN H100 MLA\n"), text.index("# END H100 MLA\n")
    entries = {kind: best.get(kind, cfg) for kind, cfg in H100_MLA.items()}
    block = "# BEGIN H100 MLA\nH100_MLA = {\n" + "\n".join(_entry(k, c) for k, c in entries.items()) + "\n}\n"
    with open(path, "w") as f:
        f.write(text[:begin] + block + text[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--kinds", default=",".join(CANDIDATES))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--job-timeout", type=float, default=90.0, help="seconds from the start for all compile jobs")
    parser.add_argument("--warm-bench", action="store_true", help="only compile kernels.bench's MLA rows")
    parser.add_argument("--peak", action="store_true", help="only print the bf16 / fp8 matmul rates")
    parser.add_argument("--write", action="store_true", help="write the fastest configs into kernels/configs.py")
    parser.add_argument("--write-from", help="a run's tune_mla.json: write its fastest configs, sweep nothing")
    args = parser.parse_args()
    if args.write_from:
        with open(args.write_from) as f:
            write_configs({k: v[2] for k, v in json.load(f)["best"].items()})
        return
    if args.warm_bench:
        warm_bench(args.workers)
        return
    if args.peak:
        print(matmul_peaks(), flush=True)
        return
    kinds = args.kinds.split(",")
    jobs = [(kind, label, cfg, args.batch, args.ctx) for kind in kinds for label, cfg in CANDIDATES[kind]]
    prepared = _compile_and_check(jobs, args.workers, args.job_timeout)
    import torch
    lines, best = [], {}
    for kind in kinds:
        results = [(job[1], job[2], res) for job, res in zip(jobs, prepared) if job[0] == kind]
        kind_lines, fastest = _time_kind(kind, results, args.batch, args.ctx)
        print("\n".join(kind_lines), flush=True)
        lines += kind_lines
        if fastest[1]:
            best[kind] = fastest
        torch.cuda.empty_cache()
    lines += ["best:"] + [f"  {kind}: {label} -> {ms:.4f} ms  {cfg}" for kind, (ms, label, cfg) in best.items()]
    print("\n".join(lines[-len(best) - 1:]), flush=True)
    with open(os.path.join(args.out, "tune_mla.json"), "w") as f:
        json.dump(dict(prepared=prepared, best={k: list(v) for k, v in best.items()}, lines=lines), f, indent=1)
    if args.write:
        write_configs({kind: cfg for kind, (_, _, cfg) in best.items()})


if __name__ == "__main__":
    main()
