"""One model over several devices: its layers split over the GPUs of this process (`--shard layers`, run by
`local.InProcess`: the layout is the model's, `harness/replay/sharding.py`), or a process per tensor-parallel rank
(`--shard tensor`, here): ranks this process starts on its host, or ranks `torchrun` started on one host or
several (`torchrun ... -m harness.cli run --shard tensor --device cuda`; global rank 0 runs the job and writes the
run directory, and hands the other ranks what they replay: `torchrun_rank_zero`, `follow_torchrun`)."""

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
        from harness.replay.tensor_parallel import free_port, layout, torchrun_launch

        config = work.config
        devices = config.shard_devices
        torchrun = torchrun_launch() is not None
        store.edit_manifest(lambda manifest: manifest.__setitem__("parallel", layout(devices, {}, config.batched,
                                                                                     torchrun)))
        if torchrun:
            torchrun_rank_zero(work, store)
            return
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


# ---------------------------------------------------------------- ranks that torchrun started

# files of the run directory the other ranks do not need (held by rank 0's process, or its own log)
_NOT_HANDED = (".lock", ".run.lock", "library.log")


def _run_files(run_dir: Path) -> dict[str, bytes]:
    """The run directory's files (relative path -> bytes): what another rank's private copy starts from, so that its
    units, resume state and reads are rank 0's."""
    return {str(f.relative_to(run_dir)): f.read_bytes() for f in sorted(run_dir.rglob("*"))
            if f.is_file() and f.name not in _NOT_HANDED}


def torchrun_rank_zero(work: RunWork, store: RunStore) -> None:
    """Global rank 0 under torchrun, in the process that runs the job: joins the process group, hands every other
    rank the run's scenarios, calibration chats and run directory (one broadcast), then replays every unit in
    lockstep with them and writes the run. A unit's error ends the run here, resumable (`WorkerFailure`); torchrun
    then stops the other ranks, which wait inside the unit's collectives."""
    import torch.distributed as dist

    from harness.executor.local import WorkerFailure
    from harness.replay import tensor_parallel

    config = work.config
    device = tensor_parallel.init_torchrun_rank(config.device)
    try:
        dist.broadcast_object_list([(work.scenarios, work.calibration_chats, _run_files(store.directory))], src=0)
        say = lambda message: print(message, file=sys.stderr)  # noqa: E731
        for directory in config.models:
            try:
                replay_model(config, directory, work.scenarios, work.calibration_chats, store, None, say)
            except Exception as error:  # noqa: BLE001 - named in the run; the ranks cannot go on without this one
                name_failure(store, rank_name(0, device), f"raised {type(error).__name__}: {error}")
                raise WorkerFailure(f"{rank_name(0, device)} raised {type(error).__name__}: {error} (tensor "
                                    f"parallel runs in lockstep: torchrun stops the other ranks)") from error
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def follow_torchrun(config) -> Path:
    """A global rank other than 0 under torchrun: joins the process group, takes rank 0's scenarios, calibration
    chats and run directory (into a private copy, deleted at the end), and replays every unit in lockstep with the
    other ranks. Writes nothing of the run: rank 0 does. Returns the private copy's path (gone by then). A unit's
    error ends this process at once (exit 70): torchrun then stops the other ranks, and rank 0's run stays
    resumable."""
    import dataclasses

    import torch.distributed as dist

    from harness.replay import runner, tensor_parallel
    from harness.runs.library_log import quiet_libraries

    rank = tensor_parallel.torchrun_launch()[0]
    device = tensor_parallel.init_torchrun_rank(config.device)
    name = rank_name(rank, device)
    scratch = Path(tempfile.mkdtemp(prefix=f"tp-rank{rank}-"))
    run_dir = scratch / "run"

    def stop(error: BaseException) -> None:  # as a rank this process starts ends: named (in the private copy), exit 70
        end_rank(run_dir, name, error)

    runner.ON_LOCKSTEP_ERROR = stop
    try:
        handed = [None]
        dist.broadcast_object_list(handed, src=0)
        scenarios, calibration_chats, files = handed[0]
        for relative, data in files.items():
            (run_dir / relative).parent.mkdir(parents=True, exist_ok=True)
            (run_dir / relative).write_bytes(data)
        quiet_libraries(run_dir)
        config = dataclasses.replace(config, out=run_dir)
        store = RunStore.attach(run_dir)
        for directory in config.models:
            try:
                replay_model(config, directory, scenarios, calibration_chats, store, None, lambda message: None)
            except Exception as error:  # noqa: BLE001 - the ranks cannot go on without this one
                stop(error)
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(scratch, ignore_errors=True)
    return run_dir
