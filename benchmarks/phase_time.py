"""Seconds per phase of one default canary run (`job.run_job`), CPU or CUDA, with an optional cProfile.

    python benchmarks/phase_time.py [--device cpu|cuda] [--batch-size N | --one-at-a-time] [--out DIR]
                                    [--profile FILE.prof] [--top 30] [--models hybrid,gqa] [--passes] [--timeline]

The default run (bundled canaries x canary scenarios x the default KV paths and the gate's controls), in this
process, models one after another (`jobs=1`, so every phase runs where the timers are; `--timeline`: at once). On
the CPU it runs the batched replay (`--batch-size`, default 64) unless `--one-at-a-time` (what `harness run` does on
the CPU by default); on CUDA the batch size is chosen from free GPU memory unless given. Each phase is a wrapped
function; phases nest (scoring batches are asked for lazily while records are built), so the table gives both the
inclusive seconds and the exclusive ("self") seconds, i.e. minus the phases timed inside it. `store_writes` (a
unit's rows appended and fsynced) runs in worker threads beside the replay: its seconds overlap the others and are
left out of "outside every phase". The last row adds up the host work that is neither a model load nor a phase of
forward passes (`FORWARD_PHASES`). `--profile` also writes a cProfile of the whole run and prints its top functions
by cumulative and by own time. `--passes` also counts each model's forward passes per KV path: run eagerly, recorded
into a CUDA graph, and graph replays (on the GPU the host's cost is mostly its eager passes).
`--timeline` (CUDA) runs the models as `harness run` does (on one GPU, small models at once in threads of this
process, `--jobs` as its default) and prints, per thread, each phase's first start and last end in seconds from the
process's start, its summed seconds and calls (per KV path where the phase has one): which model's thread the run
waits for.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import os
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == "__main__":  # as `harness run` does before transformers' first import (harness/transformers_start.py,
    # harness/lean_imports.py); without the second a profile counted 2.1 s of scikit-learn imports the run's own
    # process never makes (session 40, an H200 box's transformers 5.17). Not on import: a test importing this module
    # keeps its process as it was.
    from harness.lean_imports import hide_unused
    from harness.transformers_start import remember

    remember()
    hide_unused()

STARTED = time.perf_counter()  # the process's start, near enough: what --timeline counts from

from harness import job  # noqa: E402
from harness.replay import batched, batched_runner, inprocess, runner  # noqa: E402
from harness.run_config import CANARY_WEIGHTS, build_run_config  # noqa: E402
from harness.runs import store  # noqa: E402

# (phase, owner, attribute): the functions whose time is a phase
PHASES = (
    ("load", inprocess.InProcessModel, "load"),
    ("scales", inprocess.InProcessModel, "_compute_scales"),
    ("encode_chat", inprocess.InProcessModel, "encode_chat"),
    ("reference_waves", batched_runner.BatchedReplay, "_reference_waves"),
    ("candidate_waves", batched_runner.BatchedReplay, "_candidate_waves"),
    ("score_waves", batched_runner.BatchedReplay, "_score_waves"),
    ("batch_invariance", batched_runner.BatchedReplay, "_batch_invariance"),
    ("generate_batches", batched.BatchedEngine, "_generate_batch"),
    ("score_batches", batched.BatchedEngine, "_score_batch"),
    ("generate_one", inprocess.InProcessBackend, "generate_sync"),
    ("score_one", inprocess.InProcessBackend, "score_sync"),
    ("replay_records", runner.Replay, "run"),
    ("tf_metrics", runner, "teacher_forced"),
    ("store_writes", store.RunStore, "finish_unit"),
    ("judge", job, "_judge"),
    ("verdicts", job, "write_verdicts"),
)
# phases also timed per KV path (inclusive seconds, summed over models): the path's label from the call's arguments
BY_PATH = {"candidate_waves": lambda args: args[1].label}


def engine_path(engine) -> str:
    """The KV path a `BatchedEngine` runs ("reference" for the reference's)."""
    kv_path = engine.backend.kv_path
    return kv_path.name if kv_path is not None else "reference"


# --timeline: the KV path (or model) a call of these phases is for, from its arguments
TIMELINE_LABELS = {"candidate_waves": lambda args: args[1].label, "generate_batches": lambda args: engine_path(args[0]),
                   "score_batches": lambda args: engine_path(args[0]), "load": lambda args: Path(str(args[1])).name}
# phases whose time is model loads and forward passes (with the decode loop's own per-step host work)
FORWARD_PHASES = ("load", "scales", "generate_batches", "score_batches", "generate_one", "score_one")


class PhaseClock:
    """Inclusive and exclusive seconds and call counts per phase; nested phases subtract from their parent."""

    def __init__(self):
        self.inclusive: dict[str, float] = {}
        self.exclusive: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.by_path: dict[tuple[str, str], float] = {}  # (phase, path label) -> inclusive seconds (BY_PATH)
        self.threads = threading.local()  # .stack: [phase, seconds spent in phases nested inside it]
        self.lock = threading.Lock()
        self.events: list[tuple[str, str, str, float, float]] | None = None  # --timeline: (thread, phase, label,
        # start, end), kept where a list is set

    @property
    def stack(self) -> list[list]:
        if not hasattr(self.threads, "stack"):
            self.threads.stack = []
        return self.threads.stack

    def enter(self, name: str) -> float:
        self.stack.append([name, 0.0])
        return time.perf_counter()

    def leave(self, start: float) -> None:
        seconds = time.perf_counter() - start
        with self.lock:
            self._add(seconds)

    def _add(self, seconds: float) -> None:
        name, nested = self.stack.pop()
        self.inclusive[name] = self.inclusive.get(name, 0.0) + seconds
        self.exclusive[name] = self.exclusive.get(name, 0.0) + seconds - nested
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.stack and self.stack[-1][0] != name:
            self.stack[-1][1] += seconds
        elif self.stack:  # a phase re-entering itself: its outer call keeps the time once
            self.inclusive[name] -= seconds
            self.exclusive[name] -= seconds - nested
            self.stack[-1][1] += nested

    def wrap(self, name: str, fn):
        clock = self
        if asyncio.iscoroutinefunction(fn):
            async def timed_async(*args, **kwargs):
                start = clock.enter(name)
                try:
                    return await fn(*args, **kwargs)
                finally:
                    clock.leave(start)
            return timed_async

        def timed(*args, **kwargs):
            start = clock.enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                if name in BY_PATH:
                    key = (name, BY_PATH[name](args))
                    clock.by_path[key] = clock.by_path.get(key, 0.0) + time.perf_counter() - start
                if clock.events is not None:
                    label = TIMELINE_LABELS[name](args) if name in TIMELINE_LABELS else ""
                    clock.events.append((threading.current_thread().name, name, label, start, time.perf_counter()))
                clock.leave(start)
        return timed


def install(clock: PhaseClock) -> None:
    for name, owner, attribute in PHASES:
        found = owner.__dict__.get(attribute) if isinstance(owner, type) else getattr(owner, attribute, None)
        if found is None:  # an older tree without this function
            continue
        if isinstance(found, classmethod):
            setattr(owner, attribute, classmethod(clock.wrap(name, found.__func__)))
        else:
            setattr(owner, attribute, clock.wrap(name, found))


class PassCount:
    """Forward passes of the models, per (model, KV path, how): "eager", "recorded" (while a CUDA graph is captured)
    and "replayed" (one CUDA graph replay: a whole pass). The path is the engine's whose `generate` or `score` is
    running in the thread; a pass outside them (scales, the batch-invariance floor) counts under "(outside)"."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.threads = threading.local()

    def install(self, set_attribute=setattr) -> None:
        """Wrap what counts (`set_attribute`: a test's `monkeypatch.setattr`, undone after it)."""
        import torch

        count = self

        for name in ("generate", "score"):
            real = getattr(batched.BatchedEngine, name)

            def entered(self, *args, _real=real, **kwargs):
                outer = getattr(count.threads, "where", None)
                count.threads.where = (self.backend.owner.directory.name, engine_path(self))
                try:
                    return _real(self, *args, **kwargs)
                finally:
                    count.threads.where = outer
            set_attribute(batched.BatchedEngine, name, entered)
        real_load = inprocess.InProcessModel.load.__func__

        def load(cls, *args, **kwargs):
            model = real_load(cls, *args, **kwargs)
            name = model.directory.name
            model.model.register_forward_pre_hook(lambda module, inputs: count._pass(name))
            return model
        set_attribute(inprocess.InProcessModel, "load", classmethod(load))
        real_replay = torch.cuda.CUDAGraph.replay

        def replay(graph):
            count._add("replayed")
            return real_replay(graph)
        set_attribute(torch.cuda.CUDAGraph, "replay", replay)

    def _pass(self, model: str) -> None:
        import torch

        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        self._add("recorded" if capturing else "eager", model)

    def _add(self, how: str, model: str | None = None) -> None:
        where = getattr(self.threads, "where", None) or (model or "?", "(outside)")
        self.counts[(*where, how)] += 1

    def table(self) -> str:
        lines = ["| model | KV path | eager | recorded | replayed |", "|---|---|---:|---:|---:|"]
        for model, path in sorted({(m, p) for m, p, _ in self.counts}):
            lines.append(f"| {model} | {path} | " + " | ".join(str(self.counts[(model, path, how)])
                                                           for how in ("eager", "recorded", "replayed")) + " |")
        return "\n".join(lines)


def run(device: str, batch_size: int | None, out: Path, models: list[Path] | None = None, jobs: int = 1) -> float:
    # the configuration `harness run` builds: the default paths with the gate's yardstick, its twin and the control
    # arm (`gate.with_controls`); a RunConfig of DEFAULT_PATHS alone timed 4 of the default run's 7 paths
    config = build_run_config(command="benchmarks/phase_time.py", out=out, device=device, jobs=jobs,
                              batch_size=batch_size, models=models)
    start = time.perf_counter()
    job.run_job(config, warn=lambda message: print(f"# {message}", file=sys.stderr))
    return time.perf_counter() - start


def table(clock: PhaseClock, total: float) -> str:
    lines = ["| phase | calls | inclusive s | self s | self % of run |", "|---|---:|---:|---:|---:|"]
    for name, _, _ in PHASES:
        if name in clock.calls:
            lines.append(f"| {name} | {clock.calls[name]} | {clock.inclusive[name]:.2f} | "
                         f"{clock.exclusive[name]:.2f} | {100 * clock.exclusive[name] / total:.1f} |")
    outside = total - sum(v for k, v in clock.exclusive.items() if k != "store_writes")
    lines.append(f"| (outside every phase) | | | {outside:.2f} | {100 * outside / total:.1f} |")
    lines.append(f"| run_job total | 1 | {total:.2f} | | |")
    host = total - sum(clock.exclusive.get(name, 0.0) for name in FORWARD_PHASES)
    lines.append(f"| host work besides loads and forward passes | | | {host:.2f} | {100 * host / total:.1f} |")
    if clock.by_path:
        lines += ["", "| phase, per path | inclusive s | % of run |", "|---|---:|---:|"]
        lines += [f"| {name} {label} | {seconds:.2f} | {100 * seconds / total:.1f} |"
                  for (name, label), seconds in clock.by_path.items()]
    return "\n".join(lines)


def timeline(events: list[tuple[str, str, str, float, float]], started: float) -> str:
    """Per thread (in the order each first timed a phase), each (phase, label): first start and last end in seconds
    from `started`, summed seconds and calls, by first start. The store's writer threads are left out (they
    overlap everything, as in the phase table)."""
    threads: dict[str, dict[tuple[str, str], list]] = {}
    for thread, name, label, start, end in sorted(events, key=lambda event: event[3]):
        if name == "store_writes":
            continue
        row = threads.setdefault(thread, {}).setdefault((name, label), [start, end, 0.0, 0])
        row[1], row[2], row[3] = max(row[1], end), row[2] + end - start, row[3] + 1
    lines = ["| thread | phase | path or model | first start s | last end s | summed s | calls |",
             "|---|---|---|---:|---:|---:|---:|"]
    for thread, rows in threads.items():
        for (name, label), (first, last, summed, calls) in sorted(rows.items(), key=lambda item: item[1][0]):
            lines.append(f"| {thread} | {name} | {label} | {first - started:.2f} | {last - started:.2f} | "
                         f"{summed:.2f} | {calls} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="batched replay's batch size (default: 64 on the CPU, from free memory on CUDA)")
    parser.add_argument("--one-at-a-time", action="store_true", help="the CPU's default replay, no batches")
    parser.add_argument("--out", type=Path, default=None, help="keep the run here (default: a temporary folder)")
    parser.add_argument("--profile", type=Path, default=None, help="write a cProfile of the run here")
    parser.add_argument("--top", type=int, default=25, help="functions listed from the profile")
    parser.add_argument("--models", default="", help="canaries to replay, comma-separated (default: all three)")
    parser.add_argument("--passes", action="store_true", help="count forward passes per model, path and how they ran")
    parser.add_argument("--timeline", action="store_true",
                        help="models as harness run replays them (at once on one GPU); each thread's phases in time")
    args = parser.parse_args()
    if args.one_at_a_time and (args.device != "cpu" or args.batch_size is not None):
        parser.error("--one-at-a-time is the CPU's unbatched replay: no --batch-size, --device cpu")
    if args.timeline and (args.profile or args.passes or args.device == "cpu"):
        parser.error("--timeline times a GPU run as harness run makes it, its models in threads of this process: "
                     "no --profile or --passes (one thread each), no --device cpu (its replay runs in worker "
                     "processes, which this process's clock does not see)")
    batch_size = None if args.one_at_a_time else (args.batch_size or (64 if args.device == "cpu" else None))
    clock = PhaseClock()
    if args.timeline:
        clock.events = []
    install(clock)
    passes = PassCount() if args.passes else None
    if passes:
        passes.install()
    profiler = cProfile.Profile() if args.profile else None
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "run"
        if profiler:
            profiler.enable()
        models = [CANARY_WEIGHTS / name for name in args.models.split(",")] if args.models else None
        total = run(args.device, batch_size, out, models, jobs=(os.cpu_count() or 1) if args.timeline else 1)
        if profiler:
            profiler.disable()
            profiler.dump_stats(args.profile)
    import torch
    import transformers

    how = "one at a time" if args.one_at_a_time else f"batched, batch size {batch_size or 'auto'}"
    print(f"# default canary run, device {args.device}, {how}; torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {time.strftime('%Y-%m-%d %H:%M')}{', under cProfile' if profiler else ''}")
    if profiler:
        stats = pstats.Stats(str(args.profile))
        stats.sort_stats("cumulative").print_stats(args.top)
        stats.sort_stats("tottime").print_stats(args.top)
    if clock.events is not None:
        print("# models replayed at once: the phases' seconds are summed over their threads and add up past the run's")
    print(table(clock, total))
    if clock.events is not None:
        print()
        print(timeline(clock.events, STARTED))
    if passes:
        print()
        print(passes.table())


if __name__ == "__main__":
    main()
