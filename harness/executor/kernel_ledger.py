"""A replay on one GPU compiles the Triton kernels it will launch before it asks for them (kernels/warm.py), and
keeps a ledger of what it launched for the next run of the same plan.

A plan is the run's models (their directory names) and KV paths (their names): `plan_name`. Its ledger is
`LEDGER_DIR/<plan>-<target>.jsonl` (~/.cache/fp8-harness/triton-ledger; $FP8_HARNESS_LEDGER_DIR), written after
each in-process one-GPU replay (`compiled_ahead`, entered by the in-process executor: `harness run`, `pytest
harness` and `harness nightly` alike, from a plan's second run on a machine). The default `harness run --device
cuda`'s plan (the bundled canaries, the default paths) also has its ledger shipped, in `harness/canary/ledgers/`, for
the targets it was recorded on (Triton version and GPU architecture), so a machine's first default run compiles ahead
too; `pytest harness` replays one model a part run, plans with no bundled ledger. `harness run` starts the compiles
sooner, in the thread that starts CUDA beside its input checks (`start_ahead`). HARNESS_KERNEL_PRELOAD=0 turns all of
it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path

BUNDLED_DIR = Path(__file__).resolve().parent.parent / "canary" / "ledgers"
LEDGER_ENV = "FP8_HARNESS_LEDGER_DIR"
SWITCH_ENV = "HARNESS_KERNEL_PRELOAD"


def ledger_dir() -> Path:
    return Path(os.environ.get(LEDGER_ENV) or Path.home() / ".cache" / "fp8-harness" / "triton-ledger")


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "1") != "0"


def plan_name(config) -> str:
    """The run's models and KV paths, hashed: runs of one plan launch the same kernels."""
    plan = {"models": sorted(Path(m).name for m in config.models), "paths": [p.name for p in config.paths]}
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:16]


def preload_workers() -> int:
    """Threads for the compiles: the cores this process may use, less one for the run, at most 8 (8 threads compiled
    8 kernels 4.2x faster than one on a 16-core H200 box, session 32)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) - 1))


class KernelLedger:
    """`start` (in a thread that has started CUDA): preload the plan's ledger; `recorder`, entered while the run
    runs; `save` after it: what it compiled itself and what it took from the preload."""

    def __init__(self, config, device: int = 0):
        self.plan, self.device = plan_name(config), device
        self.preload = None
        self.tag: str | None = None
        from kernels.warm import Recorder
        self.recorder = Recorder()

    def path(self, directory: Path) -> Path:
        return directory / f"{self.plan}-{self.tag}.jsonl"

    def start(self) -> None:
        from kernels.warm import Ledger, Preload, target_tag
        self.tag = target_tag()
        entries = Ledger.read(self.path(ledger_dir()), self.tag) or Ledger.read(self.path(BUNDLED_DIR), self.tag)
        if entries:
            self.preload = Preload(entries, self.device, preload_workers()).start()

    def save(self) -> None:
        """The ledger of this run (kept as it was when the run compiled nothing of ours: a CPU-only path set)."""
        from kernels.warm import Ledger, target_tag
        taken = self.preload.used() if self.preload is not None else []
        entries = taken + [e for e in self.recorder.entries.values() if e not in taken]
        if not entries:
            return
        try:
            Ledger.write(self.path(ledger_dir()), self.tag or target_tag(), entries)
        except Exception:  # noqa: BLE001 - a read-only home, a driver gone: the next run compiles as it would have
            pass


# plan -> the ledger `harness run` started ahead of its replay (taken by that replay's `compiled_ahead`)
_STARTED: dict[str, KernelLedger] = {}


def one_gpu(config) -> int | None:
    """The GPU index of a run replayed on one GPU in this process; None for any other run."""
    match = re.fullmatch(r"cuda(?::(\d+))?", str(config.device))
    if match is None or config.shard is not None or getattr(config, "endpoints", ()) \
            or getattr(config, "executor", "auto") == "ray":   # Ray's actors replay elsewhere
        return None
    return int(match.group(1) or 0)


def start_ahead(config) -> KernelLedger | None:
    """The plan's ledger, registered for the replay to take; its compiles start when the caller calls `start`
    (after CUDA has started). None when turned off or not a one-GPU run."""
    device = one_gpu(config) if enabled() else None
    if device is None:
        return None
    ledger = _STARTED[plan_name(config)] = KernelLedger(config, device)
    return ledger


@contextlib.contextmanager
def compiled_ahead(config):
    """Around a replay: the plan's kernels compiling ahead (begun here unless `start_ahead` began them), this
    package's compiles recorded, and the ledger written at the end. Nothing for other runs or when turned off; a
    failure in any of it leaves the replay compiling at first launch, as before."""
    ledger = None
    try:
        device = one_gpu(config) if enabled() else None
        if device is not None:
            ledger = _STARTED.pop(plan_name(config), None)
            if ledger is None:
                ledger = KernelLedger(config, device)
                ledger.start()
    except Exception:  # noqa: BLE001 - compiled at first launch instead
        ledger = None
    if ledger is None:
        yield
        return
    with ledger.recorder:
        yield
    ledger.save()
