"""The gate's measurements over stored runs (issue 40), as the tables docs/VERDICTS.md quotes:

    python benchmarks/gate_table.py RUN [RUN ...]

Per run: each model's healthy candidate paths (not the twin, the control arm or the fp32 reference) with failing
and warning turns and paths, the yardstick's ratio to its twin, the control arm's floor, and every warning's test
and p-value (a warning must name a test that rejected at p < 0.01)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.runs.read import read_run


def _lines(run_dir: Path) -> list[str]:
    run = read_run(run_dir)
    manifest, whole = run.manifest, {(r["model"], r["path"]): r for r in run.path_verdicts}
    turns: dict[tuple, list[str]] = {}
    for row in run.verdicts:
        turns.setdefault((row["model"], row["path"]), []).append(row["verdict"])
    out = [f"## {run_dir} ({manifest.get('device', '?')}, yardstick {manifest.get('yardstick')})"]
    for (model, path), verdicts in sorted(turns.items()):
        row = whole.get((model, path)) or {}
        numbers = row.get("numbers") or {}
        role = (row.get("role") or "").split(" (")[0]
        warned = [f"{r['check']}: {r['message'][:140]}" for r in row.get("reasons", []) if r["severity"] == "warn"]
        twin = numbers.get("yardstick_twin_ratio")
        out.append(f"{model:8} {path:34} {role or 'candidate':22} turns fail {verdicts.count('fail'):3} warn "
                   f"{verdicts.count('warn'):3}  path {row.get('verdict', '-'):4}"
                   + (f"  twin ratio {twin:.4g}" if twin is not None else "")
                   + (f"  kl_mean {numbers['kl_mean']:.3g}" if numbers.get("kl_mean") is not None else ""))
        out += [f"{'':10}warn {w}" for w in warned]
    for model, floor in sorted((manifest.get("control_floor") or {}).items()):
        out.append(f"control {model}: {json.dumps(floor, default=str)[:300]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    for run_dir in parser.parse_args().runs:
        print("\n".join(_lines(run_dir)))


if __name__ == "__main__":
    main()
