"""The whole `harness run` process of this tree against earlier trees (or itself with other settings), alternating on
one machine, with the records compared: how issue 43's default-run bars are measured (wall of the whole process,
warm, against a baseline tree in the same call: the lent machines differ by 1.7x from host to host, BENCHMARKS.md
session 38).

    python benchmarks/run_ab.py --baseline 3a67195 [--baseline f158deb] [--variant "NAME: [ENV=VALUE ...] [ARGS]"]
                                [--rounds 2] [--cold] [--device cuda] [--work DIR] [-- ARGS for harness run]

Each baseline is `git archive`d into the work folder once. A variant is this tree run with settings of its own:
environment variables (`NAME=VALUE` words) and `harness run` arguments after the common ones, so that a setting is
measured against this tree's default in the same call (`--variant "check64: --kernel-check-every 64"`, `--variant
"no-preload: HARNESS_KERNEL_PRELOAD=0"`); at least one baseline or variant. A warm-up run of every tree comes first
(caches, bytecode), then each round runs every tree once, the order turning each round. A row gives each run's wall
seconds and, in brackets, the run's own "run complete in". The records of every tree's last run are then compared
with this tree's (timing metrics left out): identical, or how many rows of which (metric, path) differ, and whether
the verdict labels (verdicts.jsonl, path_verdicts.jsonl) are the same, and each tree's mean warm wall (the rounds
after the warm-up) is set against this tree's, as a ratio (issue 43's bar: 15 s against 3a67195's 34.6). `--cold`
adds a row after the rounds: each tree once more with Triton's cache, our compiled kernels, our kernel ledger and
transformers' remembered start-up scans (harness/transformers_start.py) in empty folders of their own
(`COLD_CACHES`), as a fresh machine has them; Python's bytecode and the bundled ledger are kept (issue 43's cold
bar, sessions 32-37).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
TIMING = ("seconds", "ms_per", "tok_per_s", "tokens_per_s", "_time")  # metric names that hold a timing
COMPLETE = re.compile(r"run complete in ([0-9.]+) s")
# what a cold run starts without: Triton's cache, our compiled kernels (kernels/nvrtc.py, kernels/cpu_kernels.py) and
# the kernel ledgers a run writes (harness/executor/kernel_ledger.py), each pointed at an empty folder
COLD_CACHES = ("TRITON_CACHE_DIR", "FP8_HARNESS_KERNEL_CACHE", "FP8_HARNESS_LEDGER_DIR", "FP8_HARNESS_START_CACHE")
ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")  # a variant's word that sets an environment variable


def unpack(rev: str, work: Path) -> Path:
    """The tree at `rev`, archived from this repository into `work` (once)."""
    tree = work / f"tree-{rev}"
    if not tree.is_dir():
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(HERE), "archive", rev], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def parse_variant(text: str) -> tuple[str, dict[str, str], list[str]]:
    """`--variant "NAME: WORDS"` as (name, environment variables, harness run arguments): a word `NAME=VALUE` whose
    name is an environment variable's (letters, digits, underscores) sets it, the others are arguments."""
    name, colon, rest = text.partition(":")
    if not colon or not name.strip() or name.strip() == "this tree":
        raise ValueError(f"--variant {text!r}: expected \"NAME: [ENV=VALUE ...] [harness run arguments]\" with a "
                         "name of its own")
    env, args = {}, []
    for word in shlex.split(rest):
        if ENV_WORD.match(word):
            key, _, value = word.partition("=")
            env[key] = value
        else:
            args.append(word)
    if not env and not args:
        raise ValueError(f"--variant {text!r}: no setting (an ENV=VALUE word or a harness run argument)")
    return name.strip(), env, args


def one_run(tree: Path, out: Path, device: str, extra: list[str], cold: Path | None = None,
            env_extra: dict[str, str] | None = None) -> tuple[float, float | None, int]:
    """(wall s, the run's own "run complete in" s or None, exit code) of `python -m harness.cli run` in `tree`;
    cold: a new folder whose empty subfolders hold the caches `COLD_CACHES` names; env_extra: a variant's variables."""
    command = [sys.executable, "-m", "harness.cli", "run", "--device", device, "--out", str(out), "--no-progress",
               *extra]
    env = {**os.environ, **(env_extra or {})}
    if cold is not None:
        for name in COLD_CACHES:
            (cold / name).mkdir(parents=True)
            env[name] = str(cold / name)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    (out.parent / f"{out.name}.log").write_text(done.stdout + done.stderr)
    found = COMPLETE.search(done.stdout + done.stderr)
    return wall, float(found.group(1)) if found else None, done.returncode


def rows(run: Path, table: str) -> list[dict]:
    path = run / f"{table}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def compare(mine: Path, other: Path) -> str:
    """What differs between two runs' records (timings left out) and verdict labels."""
    def records(run: Path) -> set[str]:
        return {json.dumps(r, sort_keys=True) for r in rows(run, "records")
                if not any(word in r["metric"] for word in TIMING)}

    def labels(run: Path, table: str) -> list[tuple]:
        return sorted((r.get("model"), r.get("path"), r.get("scenario"), r.get("turn"), r.get("verdict"))
                      for r in rows(run, table))

    a, b = records(mine), records(other)
    differ = collections.Counter((json.loads(r)["metric"], json.loads(r)["path"]) for r in a ^ b)
    said = (f"records identical ({len(a)} rows)" if not differ else
            f"records differ in {len(a ^ b)} of {len(a)} rows: " +
            ", ".join(f"{metric} on {path} ({n})" for (metric, path), n in sorted(differ.items())))
    same = all(labels(mine, t) == labels(other, t) for t in ("verdicts", "path_verdicts"))
    return f"{said}; verdict labels {'identical' if same else 'DIFFER'}"


def ratios(walls: dict[str, dict[str, list[float]]], names: list[str]) -> list[str]:
    """Per baseline: the mean wall of its warm rounds and of its cold run, and this tree's as a ratio of each.
    walls: {tree: {"warm": [s, ...], "cold": [s]}}; names: this tree first."""
    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    lines = []
    mine = walls[names[0]]
    for name in names[1:]:
        theirs = walls[name]
        said = [f"warm {mean(mine['warm']):.2f} s against {mean(theirs['warm']):.2f} s "
                f"({mean(mine['warm']) / mean(theirs['warm']):.2f}x)"]
        if mine.get("cold") and theirs.get("cold"):
            said.append(f"cold {mean(mine['cold']):.2f} s against {mean(theirs['cold']):.2f} s "
                        f"({mean(mine['cold']) / mean(theirs['cold']):.2f}x)")
        lines.append(f"- this tree against {name}, means: " + "; ".join(said))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", action="append", default=[], metavar="REV", help="a git revision to compare")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME: SETTINGS",
                        help="this tree with environment variables (NAME=VALUE) and harness run arguments of its own")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cold", action="store_true", help="then one cold run of each tree (empty kernel caches)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--work", type=Path, default=None, help="where trees and runs go (default: a temporary folder)")
    parser.add_argument("extra", nargs="*", help="arguments for harness run, after --")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not args.baseline and not args.variant:
        parser.error("nothing to compare with: give a --baseline REV or a --variant")
    try:
        variants = [parse_variant(text) for text in args.variant]
    except ValueError as error:
        parser.error(str(error))
    if len({name for name, _, _ in variants} | set(args.baseline)) < len(variants) + len(set(args.baseline)):
        parser.error("each --variant needs a name of its own, apart from the baselines' revisions")
    work = args.work or Path(tempfile.mkdtemp(prefix="run-ab-"))
    # name -> (tree, environment variables, harness run arguments after the common ones)
    arms = {"this tree": (HERE, {}, []), **{rev: (unpack(rev, work), {}, []) for rev in args.baseline},
            **{name: (HERE, env, extra) for name, env, extra in variants}}
    names = list(arms)
    last: dict[str, Path] = {}
    walls: dict[str, dict[str, list[float]]] = {name: {"warm": [], "cold": []} for name in names}
    table = [f"| round | {' | '.join(names)} |", "|---|" + "---:|" * len(names)]
    rounds = [*range(args.rounds + 1), *(["cold"] if args.cold else [])]  # round 0: every tree's warm-up
    for number, round_ in enumerate(rounds):
        order = names[number % len(names):] + names[:number % len(names)]
        cells = {}
        for name in order:
            out = work / "runs" / f"{re.sub(r'[^A-Za-z0-9]+', '-', name)}-{round_}"
            out.parent.mkdir(parents=True, exist_ok=True)
            cold = work / "cold" / out.name if round_ == "cold" else None
            tree, env, extra = arms[name]
            wall, inside, code = one_run(tree, out, args.device, [*args.extra, *extra], cold, env)
            if code not in (0, 1):  # 1: a verdict failed, the run is whole; anything else is no measurement
                print(f"error: {name} exited {code}; its output: {out.parent / (out.name + '.log')}", file=sys.stderr)
                return 2
            cells[name] = f"{wall:.2f} ({inside if inside is not None else '?'})"
            if round_ != "cold":  # the records compared are the last warm round's
                last[name] = out
            if round_ != 0:
                walls[name]["cold" if round_ == "cold" else "warm"].append(wall)
        table.append(f"| {'warm-up' if round_ == 0 else round_} | " + " | ".join(cells[n] for n in names) + " |")
    print(f"# {args.device}; wall s of the whole process (the run's own \"run complete in\" s); runs in {work}")
    print("\n".join(table))
    print("\n".join(ratios(walls, names)))
    for name in names[1:]:
        print(f"- {name} against this tree: {compare(last['this tree'], last[name])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
