"""Self-consistency on healthy `harness serve` paths against a planted decode fault: the numbers behind the limit in
harness/analysis/self_consistency.py (docs/VERDICTS.md, "Self-consistency").

For each path spec: `harness serve --path SPEC` on a free loopback port, then
`harness run --candidate LABEL=URL --self-consistency --scenarios FILE` (no reference), then per metric the
largest value over the run's turns (first turns and multi-turn ones apart). The last table: healthy max against
the faults' min.

    python benchmarks/self_consistency_gap.py --out runs/selfcons-gap           # serve, run, print
    python benchmarks/self_consistency_gap.py --out runs/selfcons-gap --print   # print the stored runs only
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.records import decode_value  # noqa: E402
from harness.serve import serve_in_subprocess  # noqa: E402

HEALTHY = ("bf16", "fp8_e4m3:calibrated", "fp8_e4m3:per_head:calibrated", "fp8_e5m2", "fp8_e4m3:calibrated:raw_prefill",
           "fp8_e4m3:calibrated:kernel=reference")
FAULTS = ("fp8_e4m3:calibrated:kernel=tests.faulty_decode:decode",)
METRICS = ("selfcons_logprob_delta_max", "selfcons_kl_mean", "selfcons_kl_max", "selfcons_flips",
           "selfcons_repeat_delta_max")


def label_of(spec: str) -> str:
    return spec.replace(":", "-").replace("=", "-").replace(".", "-")


def measure(spec: str, scenarios: str, out: Path) -> None:
    with serve_in_subprocess(spec) as url:
        command = [sys.executable, "-m", "harness.cli", "run", "--candidate", f"{label_of(spec)}={url}",
                   "--self-consistency", "--scenarios", scenarios, "--out", str(out), "--no-progress",
                   "--no-fail-on-verdict"]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        print(f"{spec}: harness run exit {done.returncode}" + (f"\n{done.stderr[-2000:]}" if done.returncode else ""),
              flush=True)


def worst_by_metric(run: Path) -> dict[tuple[str, str], float]:
    """{(metric, 'first' | 'later'): largest value over the run's turns}; 'later': turns with history."""
    import json

    rows = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines() if line.strip()]
    history = {(r["scenario"], r["turn"]): r["value"] for r in rows if r["metric"] == "selfcons_history_turns"}
    worst: dict[tuple[str, str], float] = defaultdict(float)
    for row in rows:
        value = decode_value(row)
        if row["metric"] in METRICS and value is not None:
            kind = "later" if history.get((row["scenario"], row["turn"])) else "first"
            worst[(row["metric"], kind)] = max(worst[(row["metric"], kind)], value)
    return worst


def gated_turn_values(run: Path) -> list[float]:
    """The gated statistic of every turn of the run (the check is per turn: every faulty turn should fail)."""
    import json

    rows = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines() if line.strip()]
    return [decode_value(r) for r in rows if r["metric"] == METRICS[0] and decode_value(r) is not None]


def print_tables(runs: dict[str, Path]) -> None:
    measured = {spec: worst_by_metric(run) for spec, run in runs.items() if (run / "records.jsonl").exists()}
    print(f"{'path':58s} " + " ".join(f"{m.removeprefix('selfcons_'):>22s}" for m in METRICS))
    for spec, worst in measured.items():
        cells = [f"{worst.get((m, 'first'), math.nan):10.4g} /{worst.get((m, 'later'), math.nan):10.4g}" for m in METRICS]
        print(f"{spec:58s} " + " ".join(cells))
    print("(each cell: worst first turn / worst later turn with history)\n")
    for metric in METRICS:
        healthy = [(max(w.get((metric, k), 0.0) for k in ("first", "later")), s) for s, w in measured.items()
                   if s not in FAULTS]
        faults = [(max(w.get((metric, k), 0.0) for k in ("first", "later")), s) for s, w in measured.items()
                  if s in FAULTS]
        if healthy and faults:
            (h, hs), (f, fs) = max(healthy), min(faults)
            print(f"{metric}: healthy max {h:.4g} ({hs}), faults' min {f:.4g} ({fs}), "
                  f"fault / healthy {f / h if h else math.inf:.3g}x")
    for spec in FAULTS:
        if spec in measured:
            values = gated_turn_values(runs[spec])
            print(f"{METRICS[0]} per turn on {spec}: min {min(values):.4g} over {len(values)} turns")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for one run per path")
    parser.add_argument("--scenarios", default="scenarios/canary/default.yaml")
    parser.add_argument("--paths", default=",".join(HEALTHY + FAULTS), help="comma-separated path specs")
    parser.add_argument("--print", action="store_true", help="print the stored runs, serve nothing")
    args = parser.parse_args()
    specs = [s for s in args.paths.split(",") if s]
    runs = {spec: args.out / label_of(spec) for spec in specs}
    if not args.print:
        for spec, run in runs.items():
            if not (run / "records.jsonl").exists():
                measure(spec, args.scenarios, run)
    print_tables(runs)


if __name__ == "__main__":
    main()
