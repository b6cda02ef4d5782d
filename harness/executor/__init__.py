"""Where a run's units execute: the seam between `harness run`'s orchestration (`harness/job.py`) and the replay.

A run's work (its configuration, scenarios and calibration chats: `local.RunWork`) goes to one executor, chosen
here once from the run's options; each places tasks (`plan.Task`: a model's replay of some scenarios) on workers
and replays them through `model_replay`:

- `local.InProcess`: every model in this process, one after another (one device; a layer-sharded model's GPUs);
- `local.ModelThreads`: small models at once on one GPU, a thread of this process each (`models_at_once`);
- `local.CpuTasks` / `local.ModelProcesses`: a pool of CPU worker processes (`--jobs`);
- `local.DataParallel`: one worker per GPU of a GPU list, the work split by estimated cost (`plan`), only as many
  GPUs as pay off unless `--workers` says;
- `sharded.TensorParallel`: a process per tensor-parallel rank (`--shard tensor`);
- `ray_executor.RayActors`: one actor per GPU (or CPU slot) of a Ray cluster (`--executor ray`), the driver the only
  writer of the run directory.

Endpoint runs (live servers) are not placed on workers: `endpoints` replays them with asyncio concurrency.
"""

from __future__ import annotations


def executor_for(config, scenarios: list):
    """The executor of `config`'s in-process run over `scenarios`."""
    from harness.executor import local
    from harness.executor.plan import plan_data_parallel
    from harness.replay.devices import device_list

    devices = device_list(config.device)
    if config.executor == "ray":
        from harness.executor.ray_executor import RayActors

        return RayActors(config.ray_address, config.workers)
    if config.shard == "tensor":
        from harness.executor.sharded import TensorParallel

        return TensorParallel()
    if config.shard is not None:  # every model over all the GPUs, in this process, one after another
        return local.InProcess()
    if len(devices) > 1:
        plan = plan_data_parallel(config.models, scenarios, devices, len(config.paths), config.workers)
        return local.DataParallel(plan, tuple(devices))
    # the batched replay is one model's waves: at most one worker per model
    jobs = min(config.jobs, len(config.models)) if config.batched else config.jobs
    if config.device != "cpu":
        at_once, _ = local.models_at_once(config)
        return local.ModelThreads(at_once) if at_once > 1 else local.InProcess()
    if jobs <= 1:
        return local.InProcess()
    return local.ModelProcesses(jobs) if config.batched else local.CpuTasks(jobs)
