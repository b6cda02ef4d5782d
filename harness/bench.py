"""CPU cost of the default run and of each FP8 path relative to `bf16`, as a printed table.

    python -m harness.bench [--models DIR ...] [--scenarios PATH ...] [--repeat 3]

Targets (issue 2): the default run <= 3 minutes on a 2-core machine; each FP8 path <= 1.5x the `bf16`
path's time. Each path's time is the median over repeats of generating and scoring every turn of every
scenario with that path's backend, measured in the same process, so ratios cancel machine noise.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import job
from harness.replay.inprocess import InProcessModel
from harness.scenarios.sources import load_scenarios
from harness.types import Message


def _replay_once(backend, scenarios) -> float:
    started = time.perf_counter()
    for scenario in scenarios:
        history: list[Message] = [Message("system", scenario.system)] if scenario.system else []
        for turn in scenario.turns:
            messages = history + [Message("user", turn.user)]
            reply = turn.assistant
            if reply is None:
                generation = backend.generate_sync(messages, scenario.max_new_tokens)
                backend.score_sync(messages, generation.token_ids)
                reply = generation.text
            history = messages + [Message("assistant", reply)]
    return time.perf_counter() - started


def path_costs(models, scenarios, specs: str, repeat: int) -> list[dict]:
    rows = []
    for directory in models:
        loaded = InProcessModel.load(directory)
        backends = [loaded.backend(path) for path in job.parse_kv_paths(specs)]  # scales computed here, untimed
        times = {b.label: [] for b in backends}
        for _ in range(repeat):
            for backend in backends:  # interleaved, so drift hits every path alike
                times[backend.label].append(_replay_once(backend, scenarios))
        base = statistics.median(times["bf16"])
        for label, samples in times.items():
            rows.append({"model": directory.name, "path": label, "s": statistics.median(samples),
                         "x bf16": statistics.median(samples) / base})
    return rows


def default_run_seconds() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "harness.cli", "run", "--out", str(Path(tmp) / "run"), "--no-progress"],
                       check=True, capture_output=True)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", type=Path)
    parser.add_argument("--scenarios", nargs="*", type=Path)
    parser.add_argument("--paths", default=job.DEFAULT_PATHS)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-default-run", action="store_true")
    args = parser.parse_args()
    models = tuple(args.models) if args.models else job.default_models()[0]
    scenarios = load_scenarios(args.scenarios or list(job.default_scenarios()))
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {len(scenarios)} scenarios")
    if not args.skip_default_run:
        seconds = default_run_seconds()
        print(f"\ndefault `harness run` (subprocess, wall): {seconds:.1f} s (target <= 180 s)")
    print("\n| model | path | seconds (median) | x bf16 (target <= 1.5) |\n|---|---|---|---|")
    for row in path_costs(models, scenarios, args.paths, args.repeat):
        print(f"| {row['model']} | {row['path']} | {row['s']:.2f} | {row['x bf16']:.2f} |")


if __name__ == "__main__":
    main()
