"""A/B of launch variants, same process, round robin: `python -m kernels.ab [--kinds K,..] [--write]`.

Each candidate is compiled and checked in worker processes first (as kernels.tune_mla does): against fp64 over
e4m3 and e5m2 caches (kernels.tune.check_gqa / check_mla, error ratio to torch bf16's <= 2), or for gqa_fp8_pv
against the fp64 emulation of its FP8 attention definition (kernels.tune.check_fp8_attention, option "p":
kernel vs emulation <= 2x torch bf16's error, the GPU tests' bound). Then every candidate is timed at each shape
in two round-robin rounds, with the current entry of kernels/configs.py (the first candidate) among them; a
candidate without programs_per_sm is timed at each of the kind's programs/SM and its best counts. --write puts
the fastest candidate (geometric mean over the shapes) into kernels/configs.py only if it is >= 1% faster than
the current entry by that mean and not slower than 0.99x at any shape; "reference" candidates are never landed.

CANDIDATES holds the latest session's variants; earlier sessions' candidates and their numbers are in
kernels/BENCHMARKS.md (session 8: widen="v" and whole waves for GQA, warp specialization and 16 warps for MLA;
session 9: for MLA, widen="bits" (e4m3 widened by integer bit moves instead of cvt), latent_parts=2 (a program
per half of the output columns), lazy rescaling and scores_ahead (each trip's score product for the next tile);
all lost, their code removed; session 11: the CUDA kernel, impl="cuda", its launch shapes; session 13: the
warpgroup-MMA kernels for many heads: a two-group form, then the warp-specialized one, wgmma=True).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time

from kernels.tune_mla import CONFIGS_PATH, _compile_and_check, write_configs

SHAPES = {"mla_fp8": [(8, 8192), (8, 32768), (32, 32768), (8, 131072)],
          "mla_fp8_many_heads": [(8, 8192), (8, 32768), (32, 32768)]}
MLA = dict(prefetch=False, swap=False, tma=True, split_latent=True, programs_per_sm=1)


def _mla(block_n, warps, stages, block_h, **kw):
    return dict(MLA, block_n=block_n, num_warps=warps, num_stages=stages, block_h=block_h, widen=True, **kw)


def _cuda(block_n, warps, stages, block_h=16, ctas=1, bulk=True):
    """The CUDA kernel (kernels/mla_decode_fp8.cu): block_h heads a block, block_n = 8 x warps x token blocks a
    warp, ctas blocks per SM (its launch bounds; then timed at that many programs per SM, else at 1 and 2); bulk
    copies or cp.async."""
    cfg = {k: v for k, v in _mla(block_n, warps, stages, block_h, impl="cuda", bulk=bulk).items()
           if k != "programs_per_sm"}
    return dict(cfg, ctas=ctas, programs_per_sm=ctas) if ctas > 1 else cfg


def _cuda_label(n, w, s, h=16, ctas=1, bulk=True):
    return f"cuda h{h} {n}/{w}/{s}" + (f" x{ctas}" if ctas > 1 else "") + ("" if bulk else " cp.async")


def _wgmma(stages):
    """The warp-specialized warpgroup-MMA kernel (kernels/mla_decode_fp8_ws.cu): 64 heads and 64 tokens a block of
    12 warps, `stages` tiles in flight, one block per SM."""
    return dict(_mla(64, 12, stages, 64, impl="cuda", wgmma=True), programs_per_sm=1)


CUDA_FEW = [(64, 8, 3), (32, 4, 3, 16, 2), (64, 8, 3, 16, 1, False)]
CANDIDATES = {   # kind -> [(label, cfg)]; the first is the current entry; "reference" rows are never landed
    # session 11's last round (kernels/BENCHMARKS.md: the CUDA kernel won at 16 heads, not at 128), its entry's
    # splits merged by the CUDA merge kernel since session 14 (cuda_merge); a new one goes below its entry
    "mla_fp8": [("cuda h16 32/4/4 x2 cuda_merge (current)", dict(_cuda(32, 4, 4, 16, 2), cuda_merge=True)),
                ("cuda h16 32/4/4 x2 merge_splits (session 11's entry)", _cuda(32, 4, 4, 16, 2)),
                ("split widen 64/4/5 (Triton tile kernel, reference)", _mla(64, 4, 5, 16))]
    + [(_cuda_label(*c), _cuda(*c)) for c in CUDA_FEW],
    # session 13: the warp-specialized wgmma kernel won at 128 heads (kernels/BENCHMARKS.md)
    "mla_fp8_many_heads": [("cuda wgmma ws h64 64/12/3 (current)", _wgmma(3)),
                           ("split widen h64 32/8/5 (Triton entry, reference)", _mla(32, 8, 5, 64))],
}
PPS = {"gqa_fp8": (4, 8, 16), "gqa_fp8_pv": (4, 8, 16)}   # programs per SM timed when a candidate names none


def _pps(kind: str, cfg: dict) -> tuple:
    return (cfg["programs_per_sm"],) if "programs_per_sm" in cfg else PPS.get(kind, (1, 2))


def _bare(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "programs_per_sm"}


def _heads(kind: str) -> int:
    return 128 if kind.endswith("many_heads") else 16


def _prepare(kind: str, label: str, cfg: dict) -> dict:
    """Worker: check against fp64 (e4m3 and e5m2, or bf16), then run every timing shape once (compiles)."""
    import torch

    from kernels.tune import _timer, check_fp8_attention, check_gqa, check_mla
    t0 = time.time()
    fmts = ["e4m3", "e5m2"] if "fp8" in kind else ["bf16"]
    try:
        torch.manual_seed(0)
        if kind == "gqa_fp8_pv":
            e = check_fp8_attention(_bare(cfg), "p")
            ratios = {"kernel vs emulation": e["kernel_vs_emulation"], "kernel": e["kernel"]}
        elif kind.startswith("gqa"):
            ratios = {fmt: check_gqa(_bare(cfg), fmt) for fmt in fmts}
        else:
            ratios = {fmt: check_mla(_bare(cfg), fmt, _heads(kind)) for fmt in fmts}
        timer = _timer(kind, 8, 8192, _heads(kind))
        for pps in _pps(kind, cfg):
            timer(_bare(cfg), pps)
        return dict(kind=kind, label=label, ratios=ratios, seconds=round(time.time() - t0, 1))
    except Exception as e:   # noqa: BLE001 - a candidate that does not compile or run is a result
        text = str(e).strip().splitlines()
        return dict(kind=kind, label=label, error=f"{type(e).__name__}: {text[-1][:200] if text else ''}",
                    seconds=round(time.time() - t0, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default=",".join(CANDIDATES))
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--compile-budget", type=float, default=100.0)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    jobs = [(kind, label, cfg) for kind in kinds for label, cfg in CANDIDATES[kind]]
    prepared = _compile_and_check(jobs, args.workers, args.compile_budget, _prepare)
    import torch

    from kernels.tune import _timer
    report, winners = [], {}
    for kind in kinds:
        cands = [(label, cfg, res) for (k, label, cfg), res in zip(jobs, prepared) if k == kind]
        ok = []
        for label, cfg, res in cands:
            if "error" in res:
                report.append(f"{kind} {label}: {res['error']}")
            elif not all(r <= 2.0 for name, r in res["ratios"].items() if name != "kernel"):
                report.append(f"{kind} {label}: WRONG {res['ratios']}")
            else:
                ok.append((label, cfg, res))
        if not ok or not cands[0][0] in [label for label, _, _ in ok]:
            report.append(f"{kind}: the current entry did not pass; nothing timed")
            continue
        best_ms = {}   # (label, shape) -> (ms, pps)
        shapes = SHAPES[kind]
        for batch, ctx in shapes:
            timer = _timer(kind, batch, ctx, _heads(kind))
            rounds = {}
            for rnd in (1, 2):
                for label, cfg, _ in ok:
                    for pps in _pps(kind, cfg):
                        rounds.setdefault((label, pps), []).append(timer(_bare(cfg), pps))
            for label, cfg, res in ok:
                ms, pps = min((sum(rounds[(label, p)]) / 2, p) for p in _pps(kind, cfg))
                best_ms[(label, (batch, ctx))] = (ms, pps)
                line = "  ".join(f"pps {p}: " + "/".join(f"{t:.4f}" for t in rounds[(label, p)])
                                 for p in _pps(kind, cfg))
                report.append(f"{kind} b{batch} {ctx // 1024}k {label:34s} err {res['ratios']} | {line}")
                print(report[-1], flush=True)
            timer = None
            torch.cuda.empty_cache()
        base = cands[0][0]
        score = {}
        for label, cfg, _ in ok[1:]:
            gains = [best_ms[(base, s)][0] / best_ms[(label, s)][0] for s in shapes]
            mean = math.prod(gains) ** (1 / len(gains))
            report.append(f"{kind} {label}: speed-up vs current " + " ".join(f"{g:.3f}x" for g in gains)
                          + f" (geometric mean {mean:.3f}x, at programs/SM "
                          + " ".join(str(best_ms[(label, s)][1]) for s in shapes) + ")")
            print(report[-1], flush=True)
            if "reference" not in label and mean >= 1.01 and min(gains) >= 0.99:
                score[label] = (mean, cfg)
        if score:
            label = max(score, key=lambda k: score[k][0])
            cfg = dict(score[label][1], programs_per_sm=best_ms[(label, shapes[0])][1])
            winners[kind] = (label, cfg)
            report.append(f"{kind}: WINNER {label} {cfg}")
        else:
            report.append(f"{kind}: current entry kept")
        print(report[-1], flush=True)
    with open(os.path.join(args.out, "ab.json"), "w") as f:
        json.dump(dict(prepared=prepared, report=report, winners=winners), f, indent=1)
    print("\n".join(report), flush=True)
    if args.write and winners:
        write_winners(winners)


def write_winners(winners: dict) -> None:
    """MLA kinds into the H100 MLA block (kernels.tune_mla.write_configs); gqa_fp8 into its line of H100."""
    mla = {kind: cfg for kind, (_, cfg) in winners.items() if kind.startswith("mla")}
    if mla:
        write_configs(mla)
    for kind in ("gqa_fp8", "gqa_fp8_pv"):
        if kind not in winners:
            continue
        cfg = winners[kind][1]
        keys = ("block_n", "num_warps", "num_stages", "prefetch", "swap", "programs_per_sm", "widen", "whole_waves")
        parts = [f"{k}={json.dumps(cfg[k]) if isinstance(cfg[k], str) else repr(cfg[k])}" for k in keys if k in cfg]
        head = f'    "{kind}": dict('
        lines, line = [], head
        for i, part in enumerate(parts):   # wrapped at 120 columns, as kernels.tune_mla writes its entries
            piece = part + (", " if i < len(parts) - 1 else "")
            if len(line) + len(piece.rstrip()) + 2 > 120:
                lines.append(line.rstrip())
                line = " " * len(head)
            line += piece
        body = "\n".join(lines + [line])[len(head):]
        with open(CONFIGS_PATH) as f:
            text = f.read()
        text = re.sub(rf'    "{kind}": dict\([^)]*\),', lambda _: f"{head}{body}),", text, count=1)
        with open(CONFIGS_PATH, "w") as f:
            f.write(text)
    print(f"wrote {sorted(winners)} into {CONFIGS_PATH}", flush=True)


if __name__ == "__main__":
    main()
