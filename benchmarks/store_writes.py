"""Seconds to store a run's units the way the replay does: every unit's rows from a stored run, finished at once
through `asyncio.to_thread(store.finish_unit, ...)` (as `harness/replay/runner.py` does when the batched replay
has precomputed everything), into a fresh run directory.

    python benchmarks/store_writes.py RUN [--repeat 3] [--where DIR] [--fsync-ms 0]

Prints one row per repeat: units, seconds, fsync calls. `--where` puts the scratch run directories on another
file system (fsync cost is the file system's); `--fsync-ms` adds that many ms to every fsync, standing in for a
slower disk (a simulation, said in the table's header).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.runs.store import UNIT_TABLES, RunStore  # noqa: E402


def units_of(run: Path) -> dict[tuple, dict[str, list[dict]]]:
    units: dict[tuple, dict[str, list[dict]]] = {}
    for line in (run / "done.jsonl").read_text().splitlines():
        row = json.loads(line)
        units[(row["model"], row["scenario"], row["path"])] = {}
    for table in UNIT_TABLES:
        path = run / f"{table}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)
            if table == "records" and str(row.get("metric")).startswith("judge_"):
                continue  # written by the judges, not by a unit
            unit = units.get((row.get("model"), row.get("scenario"), row.get("path")))
            if unit is not None:
                unit.setdefault(table, []).append(row)
    return units


async def finish_all(store: RunStore, units: dict[tuple, dict[str, list[dict]]]) -> None:
    await asyncio.gather(*(asyncio.to_thread(store.finish_unit, *key, tables) for key, tables in units.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--where", type=Path, default=None)
    parser.add_argument("--fsync-ms", type=float, default=0.0, help="added to every fsync (simulated slower disk)")
    args = parser.parse_args()
    units = units_of(args.run)
    real_fsync, calls = os.fsync, [0]

    def counted(fd):
        calls[0] += 1
        real_fsync(fd)
        if args.fsync_ms:
            time.sleep(args.fsync_ms / 1e3)

    os.fsync = counted
    print(f"# {len(units)} units of {args.run}, {os.cpu_count()} cores, scratch under {args.where or tempfile.gettempdir()}"
          + (f", SIMULATED: {args.fsync_ms} ms added to every fsync" if args.fsync_ms else ""))
    print("| repeat | units | seconds | fsync calls |\n|---:|---:|---:|---:|")
    for repeat in range(args.repeat):
        with tempfile.TemporaryDirectory(dir=args.where) as tmp:
            store = RunStore.create(Path(tmp) / "run", {"run_id": "store-writes"})
            calls[0] = 0
            start = time.perf_counter()
            asyncio.run(finish_all(store, units))
            seconds = time.perf_counter() - start
            print(f"| {repeat + 1} | {len(store.read('done'))} | {seconds:.3f} | {calls[0]} |")


if __name__ == "__main__":
    main()
