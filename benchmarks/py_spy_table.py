"""Tables from a py-spy profile of a `harness run` process: the seconds of samples per thread, and per stage of the
run, each sample given to the innermost stage its stack is in (session 39 read the default GPU run this way).

    py-spy record -f raw -r 250 --nonblocking [--threads | --gil] -o RAW -- python -m harness.cli run ...
    python benchmarks/py_spy_table.py RAW [--rate 250] [--thread TID] [--stages a,b,...] [--top 15]

`--threads` puts each sample under its thread ("thread (TID): NAME"), so the first table says what each thread ran
(the model family whose modelling frames it holds); `--gil` samples only the thread holding the interpreter lock, so
the stages say where the lock's time went. Without either, one table of stages. A stage is a substring of a frame
(`STAGES` by default: imports, the replay's passes and checks, the verdicts, the report, the kernel preload); a
sample in none is "(other)". `--thread TID` keeps one thread's samples. Seconds are samples / rate: with
`--nonblocking` a sample of a running thread that waits for a core counts as running (session 34's and 39's
`teacher_forced` seconds did not hold up in wall time), so read shares against a wall-time A/B (`run_ab.py`).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

# innermost first wins: a frame of each, as py-spy names it (function, or "Class.method")
STAGES = ("_find_and_load", "Preload._compile", "GraphedPass._capture", "StaticDecodeStep.run", "AheadOfTheHost",
          "_prefill_static", "BatchedEngine._prefill", "_score_static", "_score_rows", "PagedKV._check",
          "torch_chunk_gated_delta_rule", "_compute_scales", "_batch_invariance", "teacher_forced", "finish_unit",
          "load_model", "check_run_inputs", "write_verdicts", "write_report", "format_summary")
THREAD = re.compile(r"^thread \((\w+)\)(?::\s*(.*))?$")
FAMILY = re.compile(r"models/(\w+)/modeling_\1\.py")  # a family's own modelling file


def read_raw(path: Path) -> list[tuple[list[str], int]]:
    """(frames outermost first, samples) per line of py-spy's raw output ("frame;frame;... COUNT"; a sample in native
    code alone has no frame: "(no Python frame)")."""
    rows = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            raise ValueError(f"{path}:{number}: not py-spy's raw format (frames;... COUNT)")
        rows.append((stack.split(";") if stack.strip() else ["(no Python frame)"], int(count)))
    return rows


def thread_of(frames: list[str]) -> tuple[str, str] | None:
    """(thread id, name) where the stack starts with py-spy's thread frame (`--threads`), else None."""
    found = THREAD.match(frames[0]) if frames else None
    return (found.group(1), found.group(2) or "") if found else None


def stage_of(frames: list[str], stages: tuple[str, ...]) -> str:
    for frame in reversed(frames):
        for stage in stages:
            if stage in frame:
                return stage
    return "(other)"


def tables(rows: list[tuple[list[str], int]], rate: float, stages: tuple[str, ...] = STAGES, thread: str | None = None,
           top: int = 15) -> str:
    """Markdown: per thread (where the samples name threads) and per stage, in seconds."""
    if thread is not None:
        rows = [(frames, n) for frames, n in rows if (thread_of(frames) or ("",))[0] == thread]
    lines = [f"# {sum(n for _, n in rows) / rate:.2f} s of samples at {rate:g} Hz"]
    threads: collections.Counter = collections.Counter()
    names, families = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    for frames, n in rows:
        found = thread_of(frames)
        if found is None:
            continue
        threads[found[0]] += n
        names[found[0]][found[1]] += n  # a thread's name as sampled: a pool's threads are renamed
        for family in {m.group(1) for f in frames for m in [FAMILY.search(f)] if m}:
            families[found[0]][family] += n
    if threads:
        lines += ["", "| thread | name | s | model code it ran (s) |", "|---|---|---:|---|"]
        for tid, n in threads.most_common(top):
            ran = ", ".join(f"{family} {count / rate:.2f}" for family, count in families[tid].most_common(3))
            lines.append(f"| {tid} | {names[tid].most_common(1)[0][0]} | {n / rate:.2f} | {ran or '-'} |")
    by_stage: collections.Counter = collections.Counter()
    for frames, n in rows:
        by_stage[stage_of(frames, stages)] += n
    lines += ["", "| stage (innermost) | s |", "|---|---:|"]
    lines += [f"| {stage} | {n / rate:.2f} |" for stage, n in by_stage.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", type=Path, help="py-spy record -f raw output")
    parser.add_argument("--rate", type=float, default=250.0, help="the -r py-spy sampled at (samples a second)")
    parser.add_argument("--thread", default=None, help="one thread's samples (its id, from the thread table)")
    parser.add_argument("--stages", default=None, help="comma-separated frame substrings (default: STAGES)")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    if args.rate <= 0:
        parser.error("--rate must be positive")
    try:
        rows = read_raw(args.raw)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    stages = tuple(s for s in args.stages.split(",") if s) if args.stages else STAGES
    print(tables(rows, args.rate, stages, args.thread, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
