"""How much of the hybrid canary's answers the `fp8_e4m3:warmup` path keeps, over repeated runs.

`python benchmarks/warmup_spread.py --repeat 3` runs `harness run --model <hybrid canary> --paths
fp8_e4m3:warmup` REPEAT times with 1 intra-op thread (as the default run's worker processes use) and
REPEAT times with 2, then prints one row per run and the spread: answer_correct and rules_followed
means over the path's checked turns, and the turns whose free-running reply left the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HYBRID = REPO / "harness" / "canary" / "weights" / "hybrid"
PATH = "fp8_e4m3:warmup"


def one_run(out: Path, threads: int) -> dict:
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "harness.cli", "run", "--model", str(HYBRID), "--paths", PATH,
                    "--out", str(out), "--no-progress"], env=env, check=False, capture_output=True, cwd=REPO)
    rows = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line.strip()]
    mine = [r for r in rows if r["path"] == PATH and r["value"] is not None]

    def mean(metric: str) -> float:
        values = [r["value"] for r in mine if r["metric"] == metric]
        return sum(values) / len(values) if values else float("nan")

    diverged = sum(1 for r in mine if r["metric"] == "first_divergent_token")
    return {"threads": threads, "answer_correct": mean("answer_correct"), "rules_followed": mean("rules_followed"),
            "diverged_turns": diverged}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per thread count (default: 3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [one_run(Path(tmp) / f"t{threads}-{i}", threads)
                   for i in range(args.repeat) for threads in (1, 2)]
    print("| run | threads | answer_correct | rules_followed | diverged turns |")
    print("|---:|---:|---:|---:|---:|")
    for i, r in enumerate(results):
        print(f"| {i} | {r['threads']} | {r['answer_correct']:.3f} | {r['rules_followed']:.3f} | {r['diverged_turns']} |")
    answers = [r["answer_correct"] for r in results]
    print(f"answer_correct over {len(results)} runs: min {min(answers):.3f}, max {max(answers):.3f}")


if __name__ == "__main__":
    main()
