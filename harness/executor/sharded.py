"""One model over several devices: its layers split over the GPUs of this process (`--shard layers`, run by
`local.InProcess`: the layout is the model's, `harness/replay/sharding.py`), or a process per tensor-parallel rank
(`--shard tensor`, here)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from harness.executor.local import RunWork, name_failure, note_worker, spawn_pool, wait_for_workers
from harness.executor.model_replay import model_label, model_paths, replay_model
from harness.replay.runner import REFERENCE
from harness.runs.store import RunStore


class TensorParallel:
    """One process per rank (`harness.replay.tensor_parallel`), every rank replaying every unit of every model in
    lockstep (the collectives of each forward pass keep them there); rank 0 writes the run directory, the others
    a private copy of it (so their resume state is the same) that is deleted when they finish."""

    strategy = "tensor-parallel"

    def run(self, work: RunWork, store: RunStore, bar, warn) -> None:
        from harness.replay.tensor_parallel import free_port, layout

        config = work.config
        devices = config.shard_devices
        store.edit_manifest(lambda manifest: manifest.__setitem__("parallel", layout(devices, {}, config.batched)))
        port = free_port()
        threads = 1 if devices[0] == "cpu" else 0
        with spawn_pool(len(devices), config, threads) as pool:
            pending = {pool.submit(tensor_parallel_rank, config, rank, port, work.scenarios,
                                   work.calibration_chats): rank_name(rank, device)
                       for rank, device in enumerate(devices)}
            # the ranks store units in lockstep (rank 0 writes): a rank that hangs stops them all, so the stall
            # check watches the run's units as one worker's, named by its ranks
            owed = {f"ranks 0-{len(devices) - 1} (tensor-parallel, in lockstep)":
                    {(model_label(d), s.id, p) for d in config.models for s in work.scenarios
                     for p in (REFERENCE, *(path.name for path in model_paths(config, d)))}}
            wait_for_workers(pool, pending, store, bar, owed, stall_s=config.stall_timeout_s)


def rank_name(rank: int, device: str) -> str:
    return f"rank {rank} ({device})"


def tensor_parallel_rank(config, rank: int, port: int, scenarios, calibration_chats) -> None:
    import torch.distributed as dist

    from harness.replay import runner, tensor_parallel

    devices = config.shard_devices
    name = rank_name(rank, devices[rank])
    note_worker(RunStore.attach(config.out), name, devices[rank])  # its pid, for a death
    runner.ON_LOCKSTEP_ERROR = lambda error: end_rank(config.out, name, error)
    tensor_parallel.init_rank(rank, devices, port)
    scratch = None
    try:
        if rank == 0:
            store = RunStore.attach(config.out)
        else:  # the same units, resume state and reads as rank 0; its rows are rank 0's, so they are dropped
            scratch = Path(tempfile.mkdtemp(prefix=f"tp-rank{rank}-"))
            shutil.copytree(config.out, scratch / "run")
            store = RunStore.attach(scratch / "run")
        say = (lambda message: print(message, file=sys.stderr)) if rank == 0 else (lambda message: None)
        for directory in config.models:
            replay_model(config, directory, scenarios, calibration_chats, store, None, say)
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def end_rank(run_dir: Path, name: str, error: BaseException) -> None:
    """A rank's unit error under tensor parallel: named in the run (as a pool worker's raised error is), then this
    process ends now, sending no further collective; the executor sees the pool break and stops the other ranks."""
    name_failure(RunStore.attach(run_dir), name, f"raised {type(error).__name__}: {error}")
    print(f"{name}: {type(error).__name__}: {error}; this rank ends (tensor parallel runs in lockstep)", file=sys.stderr)
    sys.stderr.flush()
    os._exit(70)  # EX_SOFTWARE
