"""One run spread over the GPUs of a host: wall time and generated tokens/s of `harness run` per --device.

    python benchmarks/data_parallel.py [--devices cuda:0 cuda:0,1 cuda:all] [--scenarios PATH ...]
                                       [--models gqa,mla,hybrid] [--repeat N]

Each device spec runs the same run (the bundled canaries and scenarios unless named) in a fresh process, one
after another, after one warm-up run on the first spec (Triton's compile cache). It prints a table: units
stored, run seconds (the job alone, model loads included), generated tokens (every reply of every path, from
texts.jsonl) per second, and the ratio to the first spec; `--repeat` runs each spec N times and keeps the
fastest. Records of a data-parallel run against the one-GPU run are compared by tests/test_data_parallel.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SNIPPET = """
import sys, time
from pathlib import Path
from harness import job
from harness.run_config import build_run_config
from harness.scenarios.select import select_models
out, device, scenarios, models = sys.argv[1:5]
canaries, _ = job.default_models()
config = build_run_config(command=["benchmarks/data_parallel.py", device], out=Path(out), device=device,
                          models=select_models(canaries, [models] if models else []),
                          scenario_paths=[Path(p) for p in scenarios.split(",") if p] or None)
start = time.perf_counter()
job.run_job(config)
print("SECONDS", time.perf_counter() - start)
"""

def one_run(device: str, scenarios: list[str], models: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        done = subprocess.run([sys.executable, "-c", SNIPPET, str(run), device, ",".join(scenarios), models],
                              cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            return {"device": device, "error": done.stderr[-800:]}
        seconds = float(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("SECONDS")))
        texts = [json.loads(line) for line in (run / "texts.jsonl").read_text().splitlines() if line.strip()]
        units = sum(1 for line in (run / "done.jsonl").read_text().splitlines() if line.strip())
        manifest = json.loads((run / "manifest.json").read_text())
    return {"device": device, "seconds": seconds, "units": units, "status": manifest["status"],
            "tokens": sum(len(t.get("token_ids") or []) for t in texts),
            "gpus": len(manifest.get("parallel", {}).get("devices", [device]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", nargs="+", default=["cuda:0", "cuda:all"], help="--device specs to time")
    parser.add_argument("--scenarios", nargs="*", default=[], help="scenario files or folders (default: canary)")
    parser.add_argument("--models", default="", help="model labels to keep, e.g. gqa (default: all canaries)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per spec; the fastest is kept")
    args = parser.parse_args()
    one_run(args.devices[0], args.scenarios, args.models)  # warm-up: Triton compiles, page cache
    rows = []
    for device in args.devices:
        tries = [one_run(device, args.scenarios, args.models) for _ in range(args.repeat)]
        good = [t for t in tries if "error" not in t]
        rows.append(min(good, key=lambda t: t["seconds"]) if good else tries[0])
    base = rows[0].get("seconds")
    print(f"{'device':<16} {'gpus':>4} {'units':>6} {'status':<10} {'run s':>8} {'tokens':>8} {'tok/s':>9} {'x first':>8}")
    for row in rows:
        if "error" in row:
            print(f"{row['device']:<16} error: {row['error']}")
            continue
        print(f"{row['device']:<16} {row['gpus']:>4} {row['units']:>6} {row['status']:<10} {row['seconds']:>8.2f} "
              f"{row['tokens']:>8} {row['tokens'] / row['seconds']:>9.1f} {base / row['seconds']:>8.2f}")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - started:.1f} s")
