"""One run spread over the GPUs of a host: wall time and generated tokens/s of `harness run` per --device, for
the scenario set and for copies of it N times larger, as ratios in one process window.

    python benchmarks/data_parallel.py [--devices cuda:0 cuda:all] [--sets 1 8] [--scenarios PATH ...]
                                       [--models gqa,mla,hybrid] [--workers N] [--executor local|ray] [--repeat N]

Each (set, device spec) runs the same run (the bundled canaries and scenarios unless named; set N: every scenario
N times, ids suffixed) in a fresh process, one after another, after one warm-up run on the first spec (Triton's
compile cache). It prints a table: GPUs used (the data-parallel plan's choice: as many as pay off, or --workers),
units stored, run seconds (the job alone, model loads included), generated tokens (every reply of every path, from
texts.jsonl) per second, the ratio to the first spec of the same set, and the plan's estimated cost and reason.
`--repeat` runs each spec N times and keeps the fastest. Records of a data-parallel run against the one-GPU run are
compared by tests/test_data_parallel.py. Issue 42's bar, 4 GPUs: cuda:all >= 1.0x on the default set, >= 3.3x on
the set 8x larger.
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
out, device, scenarios, models, workers, executor = sys.argv[1:7]
canaries, _ = job.default_models()
config = build_run_config(command=["benchmarks/data_parallel.py", device], out=Path(out), device=device,
                          models=select_models(canaries, [models] if models else []),
                          scenario_paths=[Path(p) for p in scenarios.split(",") if p] or None,
                          workers=int(workers) if workers else None, executor=executor)
start = time.perf_counter()
job.run_job(config)
print("SECONDS", time.perf_counter() - start)
"""


def scaled_set(scenarios: list[str], times: int, directory: Path) -> list[str]:
    """The scenario files with every scenario `times` times (ids suffixed -xK), written under `directory`."""
    import yaml

    from harness import job

    files = [Path(p) for p in scenarios] or list(job.default_scenarios())
    files = [f for p in files for f in (sorted(p.glob("*.yaml")) if p.is_dir() else [p])]
    written = []
    for i, path in enumerate(files):
        data = yaml.safe_load(path.read_text())
        entries = data["scenarios"] if isinstance(data, dict) else data
        copies = [{**entry, "id": f"{entry['id']}-x{k}"} for k in range(times) for entry in entries]
        target = directory / f"x{times}-{i}-{path.name}"
        target.write_text(yaml.safe_dump({**data, "scenarios": copies} if isinstance(data, dict) else copies,
                                         sort_keys=False))
        written.append(str(target))
    return written


def one_run(device: str, scenarios: list[str], models: str, workers: str = "", executor: str = "auto") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        done = subprocess.run([sys.executable, "-c", SNIPPET, str(run), device, ",".join(scenarios), models,
                               workers, executor], cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            return {"device": device, "error": done.stderr[-800:]}
        seconds = float(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("SECONDS")))
        texts = [json.loads(line) for line in (run / "texts.jsonl").read_text().splitlines() if line.strip()]
        units = sum(1 for line in (run / "done.jsonl").read_text().splitlines() if line.strip())
        manifest = json.loads((run / "manifest.json").read_text())
    parallel = manifest.get("parallel") or {}
    return {"device": device, "seconds": seconds, "units": units, "status": manifest["status"],
            "tokens": sum(len(t.get("token_ids") or []) for t in texts),
            "gpus": len(parallel.get("used") or parallel.get("devices") or [device]), "why": parallel.get("why", "")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", nargs="+", default=["cuda:0", "cuda:all"], help="--device specs to time")
    parser.add_argument("--sets", nargs="+", type=int, default=[1, 8], help="scenario set sizes (x the named set)")
    parser.add_argument("--scenarios", nargs="*", default=[], help="scenario files or folders (default: canary)")
    parser.add_argument("--models", default="", help="model labels to keep, e.g. gqa (default: all canaries)")
    parser.add_argument("--workers", default="", help="--workers of each run (default: as many GPUs as pay off)")
    parser.add_argument("--executor", default="auto", choices=("auto", "local", "ray"), help="--executor of each run")
    parser.add_argument("--repeat", type=int, default=1, help="runs per spec; the fastest is kept")
    args = parser.parse_args()
    one_run(args.devices[0], args.scenarios, args.models)  # warm-up: Triton compiles, page cache
    print(f"{'set':>4} {'device':<16} {'gpus':>4} {'units':>6} {'status':<10} {'run s':>8} {'tokens':>8} "
          f"{'tok/s':>9} {'x first':>8}  plan")
    with tempfile.TemporaryDirectory() as tmp:
        for times in args.sets:
            scenarios = args.scenarios if times == 1 else scaled_set(args.scenarios, times, Path(tmp))
            rows = []
            for device in args.devices:
                tries = [one_run(device, scenarios, args.models, args.workers, args.executor)
                         for _ in range(args.repeat)]
                good = [t for t in tries if "error" not in t]
                rows.append(min(good, key=lambda t: t["seconds"]) if good else tries[0])
            base = rows[0].get("seconds")
            for row in rows:
                if "error" in row:
                    print(f"{times:>4} {row['device']:<16} error: {row['error']}")
                    continue
                print(f"{times:>4} {row['device']:<16} {row['gpus']:>4} {row['units']:>6} {row['status']:<10} "
                      f"{row['seconds']:>8.2f} {row['tokens']:>8} {row['tokens'] / row['seconds']:>9.1f} "
                      f"{base / row['seconds'] if base else float('nan'):>8.2f}  {row['why']}")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - started:.1f} s")
