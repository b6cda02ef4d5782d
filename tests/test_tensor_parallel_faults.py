"""Distributed faults of the tensor-parallel executor (`harness/executor/sharded.py` `TensorParallel`), run on the CPU:
two gloo ranks (`--device cpu,cpu --shard tensor`), the executor and its checks exactly as on GPUs. The ranks run
each unit's collectives in step, so a fault in one rank leaves the other waiting inside a collective: the run must
stop the waiting rank too, name the rank that failed, and stay resumable.

- a rank killed (SIGKILL) mid-run: the run stops, the rank named by its pid and signal;
- a rank stalled (SIGSTOP, --stall-timeout): the stall check watches the run's units (rank 0 writes them for both)
  and stops every rank;
- a rank whose GPU errors (CUDA out of memory, planted in rank 1 only): the error is raised and named. One rank
  cannot record a unit error and go on while the other waits inside that unit (`runner.in_lockstep`). Before this,
  the rank went on to the next unit and the two ranks' collectives no longer matched.

Each time `--resume` completes the run: every unit once (0 lost, 0 duplicated), the records of an undisturbed
tensor-parallel run. The TP=2 split adds its own rounding, so the comparison is against TP=2, never one device."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest

from harness import job
from harness.executor.local import WorkerFailure
from harness.run_config import build_run_config

from tests.test_executor_faults import comparable, rows, run_and_disturb

ROOT = Path(__file__).resolve().parents[1]
GQA = ROOT / "harness" / "canary" / "weights" / "gqa"
SCENARIOS = ROOT / "tests" / "data" / "scenarios" / "smoke.yaml"
# the reference, bf16, its chunked-prefill control and fp8_e4m3 on two short scenarios: 8 units, one every few
# seconds on two CPU ranks (the undisturbed run: ~15 s on the 2-core EPYC)
UNITS = {("gqa", s, p) for s in ("smoke-chat", "smoke-arith")
         for p in ("reference", "bf16", "bf16:chunked_prefill", "fp8_e4m3")}

pytestmark = pytest.mark.slow


def tp_config(out: Path, **fields):
    config = build_run_config(command=["pytest", "tp-faults"], out=out, device="cpu,cpu", shard="tensor",
                              models=[GQA], scenario_paths=[SCENARIOS], paths="fp8_e4m3", yardstick="none",
                              select=("id:smoke-chat", "id:smoke-arith"))
    return replace(config, **fields)


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> Path:
    run_dir = job.run_job(tp_config(tmp_path_factory.mktemp("tp") / "undisturbed"), warn=lambda message: None)
    assert {(r["model"], r["scenario"], r["path"]) for r in rows(run_dir, "done")} == UNITS
    return run_dir


def rank_pid(run_dir: Path, rank: int) -> int | None:
    """Rank `rank`'s pid once rank 0 has stored a unit and units are left, else None."""
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    workers = (manifest.get("executor") or {}).get("workers") or {}
    done = rows(run_dir, "done")
    entry = workers.get(f"rank {rank} (cpu)")
    return entry["pid"] if entry and 1 <= len(done) <= len(UNITS) - 2 else None


def disturb(config, signal_number: int) -> tuple[BaseException | None, int]:
    """Run `config` in a thread; once rank 0 has stored a unit, send rank 1 `signal_number`."""
    return run_and_disturb(lambda: job.run_job(config, warn=lambda message: None),
                           lambda: [pid] if (pid := rank_pid(config.out, 1)) is not None else [], signal_number)


def resume_and_check(config, undisturbed: Path) -> None:
    run_dir = job.run_job(replace(config, resume=True, stall_timeout_s=None), warn=lambda message: None)
    done = [(r["model"], r["scenario"], r["path"]) for r in rows(run_dir, "done")]
    assert len(done) == len(set(done)), "a unit stored twice"
    assert set(done) == UNITS, "units lost"
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "complete"
    assert comparable(run_dir) == comparable(undisturbed)


def test_a_killed_rank_stops_every_rank_named_and_resume_loses_and_duplicates_nothing(tmp_path, undisturbed):
    config = tp_config(tmp_path / "killed")
    raised, victim = disturb(config, signal.SIGKILL)
    assert isinstance(raised, WorkerFailure), raised
    assert "rank 1 (cpu)" in str(raised) and f"pid {victim}" in str(raised) and "SIGKILL" in str(raised)
    manifest = json.loads((config.out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    # rank 0 may also name its own error (its collective lost the peer), before or after the executor names the
    # killed rank: both write the manifest until the executor stops rank 0
    failures = manifest["executor"]["failures"]
    [failure] = [f for f in failures if f["worker"] == "rank 1 (cpu)"]
    assert "SIGKILL" in failure["what"]
    assert all(f["worker"] == "rank 0 (cpu)" for f in failures if f is not failure), failures
    assert manifest["executor"]["workers"]["rank 1 (cpu)"]["pid"] == victim
    resume_and_check(config, undisturbed)


@pytest.mark.matrix
def test_a_stalled_rank_is_stopped_with_the_others_and_resume_completes(tmp_path, undisturbed):
    # the undisturbed run stores a unit every few seconds on the 2-core box; 20 s without one is a stall
    config = tp_config(tmp_path / "stalled", stall_timeout_s=20.0)
    raised, victim = disturb(config, signal.SIGSTOP)
    assert isinstance(raised, WorkerFailure) and "--stall-timeout" in str(raised), raised
    manifest = json.loads((config.out / "manifest.json").read_text())
    [failure] = manifest["executor"]["failures"]
    assert failure["worker"] == "ranks 0-1 (tensor-parallel, in lockstep)"
    assert "finished no unit for 20 s" in failure["what"] and manifest["status"] == "interrupted"
    resume_and_check(config, undisturbed)


# Imported first by each spawned rank (Python's `sitecustomize` on the PYTHONPATH the ranks inherit): rank 1's engine
# raises CUDA's out-of-memory error on a decode forward once rank 0 would have stored a unit. The plant is the test's.
OOM_PLANT = r'''
import torch
import harness.replay.batched as batched

_forward, calls = batched.BatchedEngine._forward, []

def _forward_out_of_memory(self, *args, **kwargs):
    import torch.distributed as dist

    calls.append(1)
    if dist.is_initialized() and dist.get_rank() == 1 and len(calls) > 30:  # past the first unit, mid-run
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (planted by the test)")
    return _forward(self, *args, **kwargs)

batched.BatchedEngine._forward = _forward_out_of_memory
'''


@pytest.mark.matrix
def test_a_rank_out_of_memory_stops_the_run_named_and_resume_loses_and_duplicates_nothing(
        tmp_path, undisturbed, monkeypatch):
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(OOM_PLANT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(plant), os.environ.get("PYTHONPATH", "")]))
    config = tp_config(tmp_path / "oom", stall_timeout_s=120.0)  # a hang would fail the test, not the session
    with pytest.raises(WorkerFailure, match=r"rank 1 \(cpu\)"):
        job.run_job(config, warn=lambda message: None)
    manifest = json.loads((config.out / "manifest.json").read_text())
    # the error rank 1 raised, then how its process ended; rank 0 may name the lost peer (its collective failed)
    # anywhere after the first
    failures = manifest["executor"]["failures"]
    assert failures[0]["worker"] == "rank 1 (cpu)", failures  # it names its error before it exits
    oom, died = [f for f in failures if f["worker"] == "rank 1 (cpu)"]
    assert oom["what"].startswith("raised OutOfMemoryError: CUDA out of memory") and "planted by the test" in oom["what"]
    assert "exit 70" in died["what"]
    assert all(f["worker"] == "rank 0 (cpu)" for f in failures if f not in (oom, died)), failures
    assert manifest["status"] == "interrupted"
    assert 1 <= len(rows(config.out, "done")) < len(UNITS), "the fault hit no unit mid-run"
    monkeypatch.delenv("PYTHONPATH")
    resume_and_check(config, undisturbed)
