"""The measurement behind the verdict defaults (harness/analysis/verdicts.py, docs/VERDICTS.md): for stored runs,
each gating figure's largest value over the healthy paths and smallest over the known faults, per run.

Healthy: fp8_e4m3, fp8_e4m3:calibrated, fp8_e4m3:per_head:calibrated, fp8_e5m2 (bf16 is exactly 0).
Faults: bf16:calibrated:k_scale_on_scores (class 3) on every model, fp8_e4m3:warmup on the hybrid (class 2),
fp8_e4m3 on the MLA latent variant (class 1); any path with `fault=` in its spec (attention-arithmetic faults).
For a fault the figure is its own worst value (its worst turn, or its per-path value), and the smallest of those
over the faults is printed: a limit between the healthy max and that min catches every fault on that figure.

    python benchmarks/verdict_gaps.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from pathlib import Path

from harness.runs.gate import compute_run_path_verdicts, compute_run_verdicts
from harness.runs.store import RunStore

HEALTHY = ("fp8_e4m3", "fp8_e4m3:calibrated", "fp8_e4m3:per_head:calibrated", "fp8_e5m2")
TURN_FIGURES = ("kl_p99", "kl_mean", "attn_impl_err_ratio")


def is_fault(model: str, path: str) -> bool:
    return (path == "bf16:calibrated:k_scale_on_scores" or "fault=" in path
            or (model == "hybrid" and path == "fp8_e4m3:warmup") or (model == "mla-latent-2048" and path == "fp8_e4m3"))


def figures(run_dir: Path) -> dict[tuple, dict[str, float]]:
    """(model, path) -> {figure: the path's worst value}."""
    store = RunStore(run_dir)
    worst: dict[tuple, dict[str, float]] = defaultdict(dict)
    for row in compute_run_verdicts(store):
        ratio = row.get("kl_ratio_yardstick")
        if ratio is not None:
            key = (row["model"], row["path"])
            worst[key]["kl_ratio_yardstick (turn max)"] = max(worst[key].get("kl_ratio_yardstick (turn max)", 0), ratio)
    for row in store.read("records"):
        value = row.get("value") if row.get("value_text") is None else float(row["value_text"])
        if row["metric"] in TURN_FIGURES and value is not None:
            key, name = (row["model"], row["path"]), f"{row['metric']} (turn max)"
            worst[key][name] = max(worst[key].get(name, -math.inf), value)
    for row in compute_run_path_verdicts(store):
        for name in ("kl_mean_ratio", "kl_p999_ratio", "length_ratio"):
            value = row["numbers"].get(name)
            if value is not None:
                worst[(row["model"], row["path"])][name] = value
    return worst


def main(run_dirs: list[str]) -> None:
    print("| run | figure | healthy max (path) | faults' min (path) | gap |")
    print("|---|---|---|---|---|")
    for run_dir in run_dirs:
        table = figures(Path(run_dir))
        names = sorted({name for values in table.values() for name in values})
        for name in names:
            healthy = [(v[name], f"{m} {p}") for (m, p), v in table.items() if p in HEALTHY and name in v]
            faults = [(v[name], f"{m} {p}") for (m, p), v in table.items() if is_fault(m, p) and name in v]
            high = max(healthy) if healthy else None
            low = min(faults) if faults else None
            gap = f"{low[0] / high[0]:.3g}x" if high and low and high[0] > 0 else "-"
            show = (lambda x: "-" if x is None else f"{x[0]:.4g} ({x[1]})")
            print(f"| {Path(run_dir).name} | {name} | {show(high)} | {show(low)} | {gap} |")


if __name__ == "__main__":
    main(sys.argv[1:])
