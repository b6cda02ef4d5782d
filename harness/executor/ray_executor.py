"""Ray actors as workers: one per GPU of a Ray cluster (`num_gpus=1`, pinned by Ray's CUDA_VISIBLE_DEVICES), or
one per CPU slot for a CPU run; this process (the driver) is the only writer of the run directory.

The work is the local data-parallel pool's plan (`plan.plan_data_parallel` over the actors, so the two place the
same shards and store the same records), each actor's tasks a balanced mix of context lengths. An actor keeps its
loaded models across tasks (warm) and streams each unit back the moment it is finished (`remote.replay_task`, a
Ray streaming generator); the driver writes it unless it is already done. An actor that dies (or, with
`--stall-timeout`, finishes nothing for that long, and is killed) is named in the manifest (`executor.failures`)
and its unfinished tasks go to the actors left, so the run still completes; with no actor left it stops
resumable (`WorkerFailure`). A replay error inside an actor (a model that will not load) stops the run as it would
in this process.
"""

from __future__ import annotations

import queue
import threading
import time

from harness.executor.local import (RunWork, WorkerFailure, fail, format_modules, in_config_order, name_failure,
                                    note_executor)
from harness.executor.plan import plan_data_parallel
from harness.executor.remote import Snapshot, merge_notes, replay_task
from harness.runs.store import RunStore

NO_RAY = ("--executor ray needs Ray: pip install 'fp8-harness[ray]' (or pip install ray) on this host and on every "
          "node of the cluster")


class ReplayActor:
    """A Ray actor's state: the run's configuration, scenarios and calibration chats, and its loaded models."""

    def __init__(self, config, scenarios, calibration_chats, format_modules: tuple[str, ...]):
        import torch

        from harness.kv_paths import formats

        formats.load_extensions(format_modules)
        if not config.device.startswith("cuda"):
            torch.set_num_threads(1)  # one CPU slot a CPU actor, as the local CPU workers
        self.config, self.scenarios, self.calibration_chats = config, scenarios, calibration_chats
        self.device = "cuda:0" if config.device.startswith("cuda") else "cpu"  # Ray sets CUDA_VISIBLE_DEVICES
        self.cache: dict = {}

    def where(self) -> dict:
        import os
        import socket

        return {"pid": os.getpid(), "host": socket.gethostname(), "device": self.device,
                "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def replay(self, task, snapshot: Snapshot):
        yield from replay_task(self.config, task, self.scenarios, self.calibration_chats, snapshot, self.device,
                               self.cache)


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError(NO_RAY) from None
    return ray


class RayActors:
    strategy = "ray"

    def __init__(self, address: str | None, workers: int | None):
        self.address, self.workers = address, workers

    def run(self, work: RunWork, store: RunStore, bar, warn) -> None:
        ray = _ray()
        started = not ray.is_initialized()
        if started:
            ray.init(address=self.address, log_to_driver=False, include_dashboard=False)
        actors = {}
        try:
            plan = self._plan(ray, work)
            actors = self._start(ray, work, plan, store)
            warn(f"ray: {len(actors)} actor(s); {plan.reason}")
            Driver(ray, store, bar, warn, work.config.stall_timeout_s).run(actors, dict(zip(plan.devices, plan.work)))
            store.edit_manifest(lambda m: in_config_order(m, work.config))
        finally:
            for actor in actors.values():
                ray.kill(actor)
            if started:
                ray.shutdown()

    def _plan(self, ray, work: RunWork):
        config = work.config
        resources = ray.cluster_resources()
        gpu = config.device.startswith("cuda")
        slots = int(resources.get("GPU" if gpu else "CPU", 0))
        if slots < 1:
            raise ValueError(f"--executor ray: the Ray cluster has no {'GPU' if gpu else 'CPU'} to place an actor on "
                             f"({resources}); start it with GPUs (ray start --num-gpus N) or run on --device cpu")
        workers = min(self.workers or slots, slots)
        names = [f"actor-{i}" for i in range(workers)]
        return plan_data_parallel(config.models, work.scenarios, names, len(config.paths),
                                  self.workers if self.workers is not None or not gpu else None)

    def _start(self, ray, work: RunWork, plan, store: RunStore) -> dict:
        gpu = work.config.device.startswith("cuda")
        cls = ray.remote(num_gpus=1, num_cpus=0)(ReplayActor) if gpu else ray.remote(num_cpus=1)(ReplayActor)
        actors = {name: cls.remote(work.config, work.scenarios, work.calibration_chats,
                                      format_modules(work.config.paths))
                  for name in plan.devices}
        where = dict(zip(actors, ray.get([actor.where.remote() for actor in actors.values()])))
        note_executor(store, workers=where, plan=plan.reason, shards=plan.describe())
        return actors


class Driver:
    """The one writer: runs each actor's tasks in turn (a thread per running task reads its stream), writes each
    unit once, merges notes, and moves a dead or stalled actor's tasks to the actors left."""

    def __init__(self, ray, store: RunStore, bar, warn, stall_s: float | None):
        self.ray, self.store, self.bar, self.warn, self.stall_s = ray, store, bar, warn, stall_s
        self.events: queue.Queue = queue.Queue()
        self.stalled: set[str] = set()  # actors killed for sending nothing for stall_s

    def run(self, actors: dict, queues: dict) -> None:
        queues = {name: list(tasks) for name, tasks in queues.items()}
        running: dict = {}  # actor name -> (task, time of its last event)
        try:
            while True:
                for name in actors:
                    if name not in running and queues.get(name):
                        task = queues[name].pop(0)
                        running[name] = (task, time.monotonic())
                        self._stream(name, actors[name], task)
                if not running:
                    return
                self._handle(actors, queues, running)
        except BaseException:
            for actor in actors.values():  # Ctrl-C or a replay error: stop every actor now
                self.ray.kill(actor)
            raise

    def _stream(self, name: str, actor, task) -> None:
        snapshot = Snapshot.of(self.store, task.model)

        def read() -> None:
            try:
                for ref in actor.replay.remote(task, snapshot):
                    self.events.put((name, self.ray.get(ref)))
                self.events.put((name, ("finished",)))
            except self.ray.exceptions.RayActorError as error:
                self.events.put((name, ("died", str(error).splitlines()[0])))
            except BaseException as error:  # noqa: BLE001 - the replay's own error: the run stops with it
                self.events.put((name, ("raised", error)))

        threading.Thread(target=read, name=f"ray-{name}", daemon=True).start()

    def _handle(self, actors: dict, queues: dict, running: dict) -> None:
        try:
            name, event = self.events.get(timeout=0.5)
        except queue.Empty:
            self._check_stalls(actors, running)
            return
        running[name] = (running[name][0], time.monotonic())
        kind = event[0]
        if kind == "unit":
            if not self.store.is_done(*event[1]):  # a retried task's units that were stored are not stored twice
                self.store.finish_unit(*event[1], event[2])
                if self.bar:
                    self.bar.update(1)
        elif kind == "errors":
            self.store.append("errors", event[1])
        elif kind == "warn":
            self.warn(event[1])
        elif kind == "notes":
            self.store.edit_manifest(lambda m: merge_notes(m, event[1], event[2]))
        elif kind == "finished":
            del running[name]
        elif kind == "died":
            self._lost(name, event[1], actors, queues, running)
        elif kind == "raised":  # named in the run, as the local pool names it, then raised as in one process
            name_failure(self.store, name, f"raised {type(event[1]).__name__}: {event[1]}")
            raise event[1]

    def _check_stalls(self, actors: dict, running: dict) -> None:
        now = time.monotonic()
        for name, (task, since) in list(running.items()):
            if self.stall_s is not None and now - since > self.stall_s and name not in self.stalled:
                self.warn(f"ray: {name} sent nothing for {self.stall_s:g} s (--stall-timeout): killing it")
                self.stalled.add(name)  # its stream ends with "died"
                self.ray.kill(actors[name])

    def _lost(self, name: str, why: str, actors: dict, queues: dict, running: dict) -> None:
        """An actor died: named in the manifest; its task and queue go to the actors left (least work first)."""
        task, _ = running.pop(name)
        what = (f"stalled: killed after {self.stall_s:g} s without a unit" if name in self.stalled
                else f"died ({why})")
        left = [n for n in actors if n != name]
        orphaned = [task, *queues.pop(name, [])]
        del actors[name]
        if not left:
            raise fail(self.store, name, what + "; no actor left")
        note_executor(self.store, failures=[{"worker": name, "what": what,
                                             "retried_on": sorted(left), "tasks": len(orphaned)}])
        self.store.edit_manifest(lambda m: m["warnings"].append(f"ray {name}: {what}; its {len(orphaned)} "
                                                                f"task(s) retried on {', '.join(sorted(left))}"))
        for orphan in orphaned:
            target = min(left, key=lambda n: sum(t.cost for t in queues.get(n, [])) + (n in running))
            queues.setdefault(target, []).append(orphan)


__all__ = ["NO_RAY", "RayActors", "ReplayActor", "WorkerFailure"]
