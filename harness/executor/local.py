"""Executors on this host: everything in this process, a pool of CPU worker processes, one worker per GPU
(data-parallel), and the layouts of one model over several devices (layer-sharded in this process, a process per
tensor-parallel rank).

Workers write into the run directory themselves (the store's group commit and flock take rows from several
processes). A worker that dies, raises, or stores no unit for `--stall-timeout` seconds after its first stops the
others at once, and is named in the manifest (`executor.failures`). A death or stall stops the run resumable
(`WorkerFailure`: status interrupted, exit 3); a worker's own error (CUDA out of memory, a bug) is raised as it
would be in this process (status failed). Either way finished units are kept, and a unit a killed worker was
writing has no done line: `--resume` drops its rows and redoes it.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from harness.executor.model_replay import (load_model, model_label, model_paths, replay_model, say_on_stderr,
                                           unit_task)
from harness.executor.plan import Plan
from harness.replay.runner import REFERENCE
from harness.runs.store import RunStore


class WorkerFailure(RuntimeError):
    """A worker (process, GPU worker or Ray actor) died, raised or stalled: the run stopped, resumable."""


@dataclass(frozen=True, slots=True)
class RunWork:
    """What every executor is handed: the run's configuration, its scenarios and calibration chats."""

    config: object  # harness.run_config.RunConfig
    scenarios: tuple
    calibration_chats: tuple


def note_executor(store: RunStore, **fields) -> None:
    """`manifest.executor`: the strategy, its workers (name -> pid, host, device) and failures."""
    def edit(manifest: dict) -> None:
        entry = manifest.setdefault("executor", {})
        for key, value in fields.items():
            if isinstance(value, dict):
                entry.setdefault(key, {}).update(value)
            elif isinstance(value, list):
                entry.setdefault(key, []).extend(value)
            else:
                entry[key] = value

    store.edit_manifest(edit)


def note_worker(store: RunStore, name: str, device: str) -> None:
    note_executor(store, workers={name: {"pid": os.getpid(), "host": socket.gethostname(), "device": device}})


def fail(store: RunStore, worker: str, what: str) -> WorkerFailure:
    """The failure named in the manifest (`executor.failures` and a warning); the error to raise."""
    message = name_failure(store, worker, what)
    return WorkerFailure(f"{message}; finished units are stored, the rest run with --resume")


def stop_and_fail(pool, store: RunStore, worker: str, what: str) -> WorkerFailure:
    """`fail`, after every worker of `pool` is killed: naming the failure takes the store's lock, and a worker
    stopped or hung while it held that lock (mid-commit) blocked the naming, so the run hung for good (CI, session
    19's stall tests: a SIGSTOP that landed inside a worker's fsync)."""
    stop_pool(pool)
    return fail(store, worker, what)


def name_failure(store: RunStore, worker: str, what: str) -> str:
    """`executor.failures` and the run's warnings name what happened to `worker`; returns the warning."""
    message = f"worker {worker}: {what}"
    note_executor(store, failures=[{"worker": worker, "what": what[:300]}])
    store.edit_manifest(lambda m: m["warnings"].append(message[:300]))
    return message


# ---------------------------------------------------------------- in this process


class InProcess:
    """Every model in this process, one after another (one device, or one model's layers over several GPUs)."""

    strategy = "in-process"

    def run(self, work: RunWork, store: RunStore, bar, warn) -> None:
        from harness.executor.kernel_ledger import compiled_ahead

        with compiled_ahead(work.config):   # on one GPU: the plan's Triton kernels compiled ahead, in threads
            for directory in work.config.models:
                replay_model(work.config, directory, work.scenarios, work.calibration_chats, store,
                             bar.update if bar else None, warn)


# ---------------------------------------------------------------- several models at once on one GPU

# Models replay at once on one GPU only where their weight files total at most this. Small models leave the GPU
# idle between launches: the host bounds their replay, and a thread's launches fill the GPU while another thread's
# host work runs (the default canary run, 3 models of 7-9 MB on one H200: 19.8 and 20.0 s inside the run one after
# another, 16.1 and 15.4 s at once, records identical; BENCHMARKS.md, session 37). Every model stays loaded for the
# whole replay. The bound is a margin, not a measurement: larger models replay one after another, as before.
MODELS_AT_ONCE_BYTES = 1 << 30


def models_at_once(config) -> tuple[int, str]:
    """How many of `config`'s models replay at once on its one GPU (`ModelThreads`), and why not more than one
    where it is 1: a CPU replay (its workers are processes), one model, `--jobs 1`, a layout over several devices
    (sharded), attention capture, a path whose attention is not the engine's own (a `kernel=` plug-in may set
    process-wide state), or models too large (`MODELS_AT_ONCE_BYTES`) or of unknown size (random weights)."""
    from harness.executor.plan import checkpoint_bytes

    if config.device == "cpu" or not config.batched or config.shard is not None:
        return 1, "not one GPU's batched replay"
    if len(config.models) < 2 or config.jobs < 2:
        return 1, "one model" if len(config.models) < 2 else "--jobs 1"
    if config.attention is not None:
        return 1, "attention capture"
    if any(path.kernel or path.fault for path in config.paths):
        return 1, "a kernel plug-in or fault injector among the paths"
    sizes = [checkpoint_bytes(directory) for directory in config.models]
    if None in sizes or sum(sizes) > MODELS_AT_ONCE_BYTES:
        return 1, f"weights over {MODELS_AT_ONCE_BYTES >> 20} MiB in all, or of unknown size"
    return min(config.jobs, len(config.models)), ""


def in_model_order(manifest: dict, labels: list[str]) -> None:
    """What the models noted in `manifest` (its `models` list, and every mapping keyed by model label: families,
    scales, batching, each path's routes) in the run's model order, whichever thread noted first."""
    rank = {label: i for i, label in enumerate(labels)}

    def ordered(mapping: dict) -> dict:
        return dict(sorted(mapping.items(), key=lambda item: rank[item[0]]))

    manifest["models"] = sorted(manifest.get("models", []), key=lambda m: rank.get(m.get("label"), len(rank)))
    for key, value in manifest.items():
        if isinstance(value, dict) and value and set(value) <= set(rank):
            manifest[key] = ordered(value)
    for path in manifest.get("paths", []):
        if isinstance(path.get("routes"), dict) and set(path["routes"]) <= set(rank):
            path["routes"] = ordered(path["routes"])


class ModelThreads:
    """Several models at once on one GPU: each replayed in a thread of this process, on CUDA streams of its own.

    The models are loaded first, one after another (transformers' loading sets process-wide state, such as the
    default dtype), then replayed at once, each in its share of the free GPU memory (`batched.GPU_SHARERS`). What
    the threads share is made safe where it lives: the forward context is a context variable, the store takes one
    writer at a time, SDPA's backend flags and graph captures are held by one thread at a time
    (`forward_context.sdpa_only`, `DEVICE_WIDE`). Each model's records are those of a replay one after another
    wherever its batches are the same (the canaries': all of a wave's rows in one batch; an automatic batch size is
    planned in the model's share of free memory, so a larger model may be cut into other batches). A model's error
    is raised when every thread has ended (the other models' units are stored)."""

    strategy = "models-at-once"

    def __init__(self, threads: int):
        self.threads = threads

    def run(self, work: RunWork, store: RunStore, bar, warn) -> None:
        from harness.executor.kernel_ledger import compiled_ahead
        from harness.replay.batched import GPU_SHARERS

        config = work.config
        device = torch.device(config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        note_executor(store, threads=self.threads)
        counted = threading.Lock()

        def unit_done(count: int = 1) -> None:
            with counted:
                bar.update(count)

        with compiled_ahead(config):
            loaded: dict = {}
            for directory in config.models:
                load_model(config, directory, work.calibration_chats, loaded)
            pending: queue.SimpleQueue = queue.SimpleQueue()
            for directory in config.models:
                pending.put(directory)
            errors: dict = {}

            def worker() -> None:
                GPU_SHARERS.set(self.threads)
                stream = None
                if device.type == "cuda":
                    torch.cuda.set_device(device)  # the current device is a thread's own
                    stream = torch.cuda.Stream(device)
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    while True:
                        try:
                            directory = pending.get_nowait()
                        except queue.Empty:
                            break
                        try:
                            replay_model(config, directory, work.scenarios, work.calibration_chats, store,
                                         unit_done if bar else None, warn, cache=loaded)
                        except BaseException as error:  # noqa: BLE001 - raised by the run's thread, below
                            errors[str(directory)] = error
                        finally:
                            loaded.pop(str(directory), None)  # its weights go when its replay has
                if stream is not None:
                    stream.synchronize()

            threads = [threading.Thread(target=worker, name=f"model-replay-{i}", daemon=True)
                       for i in range(self.threads)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        labels = [model_label(directory) for directory in config.models]
        store.edit_manifest(lambda manifest: in_model_order(manifest, labels))
        for directory in config.models:  # the first model's error, in the run's order
            if str(directory) in errors:
                raise errors[str(directory)]


# ---------------------------------------------------------------- worker processes


def format_modules(paths) -> tuple[str, ...]:
    """The modules a worker imports so that every format `paths` use is registered there."""
    from harness.kv_paths import formats

    used = {f.name for path in paths for f in (path.k_format, path.v_format, path.prefill_format) if f is not None}
    return formats.extension_modules(used)


def worker_init(run_dir: Path | None = None, threads: int = 1, format_modules: tuple[str, ...] | None = None) -> None:
    """Model workers: one intra-op thread each on the CPU (GPU workers keep torch's default: 0), and they die
    with the parent (a killed run leaves no orphan still writing into it). Library noise goes to the run's
    library.log, as in the parent. KV formats registered by other modules in the parent are registered here too."""
    import ctypes

    from harness.kv_paths import formats

    formats.load_extensions(format_modules if format_modules is not None else ())
    if run_dir is not None:
        from harness.lean_imports import hide_unused
        from harness.runs.library_log import quiet_libraries
        from harness.transformers_start import remember

        remember()
        hide_unused()  # a worker process is the harness's own, as `harness run`'s is
        quiet_libraries(run_dir)
    if threads:
        torch.set_num_threads(threads)
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class WorkerPool(futures.ProcessPoolExecutor):
    """The spawned worker processes of a run. Leaving its `with` block never waits on a worker that will not exit
    (stopped, hung): `ProcessPoolExecutor.__exit__` joins every worker, and a stopped worker that held no task hung
    a run that had stored every unit (session 19). On an error every worker is killed; after the work, each gets
    CLOSE_GRACE_S to exit, then is killed."""

    def __exit__(self, exc_type, exc, traceback) -> bool:
        if exc_type is not None:
            stop_pool(self)
        else:
            close_pool(self)
        return False


CLOSE_GRACE_S = 30.0  # a worker exits within seconds of the pool's shutdown (torch's teardown on a slow CPU included)


def spawn_pool(workers: int, config, threads: int) -> WorkerPool:
    return WorkerPool(workers, mp_context=multiprocessing.get_context("spawn"), initializer=worker_init,
                      initargs=(config.out, threads, format_modules(config.paths)))


def close_pool(pool: futures.ProcessPoolExecutor, grace_s: float | None = None) -> None:
    """Shut the pool down once its work is done; a worker still alive `grace_s` (CLOSE_GRACE_S) later is killed."""
    processes = list((getattr(pool, "_processes", None) or {}).values())  # noqa: SLF001 - no public list
    pool.shutdown(wait=False)
    deadline = time.monotonic() + (CLOSE_GRACE_S if grace_s is None else grace_s)
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()


def stop_pool(pool: futures.ProcessPoolExecutor) -> None:
    """Stop every worker now (SIGKILL: a stopped or hung worker does not act on SIGTERM)."""
    for process in list((pool._processes or {}).values()):  # noqa: SLF001 - no public kill; None once shut down
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def ended(processes: dict) -> dict[int, str]:
    """{pid: how it ended} of the processes that ended with an error (`killed by SIGKILL`, `exit 1`)."""
    found = {}
    for pid, process in processes.items():
        code = process.exitcode
        if code:
            found[pid] = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
    return found


def unread(processes: dict) -> set[int]:
    """The pids of processes that have ended (their sentinel is ready) whose exit status cannot be read yet: a
    process's pipes close before it is reaped, and the pool's own thread reaps its workers too (a status it has taken
    but not yet stored reads as running, None)."""
    sentinels = {}
    for pid, process in processes.items():
        with contextlib.suppress(ValueError):  # a closed Process object has no sentinel: nothing to read
            sentinels[process.sentinel] = pid
    ready = multiprocessing.connection.wait(list(sentinels), timeout=0) if sentinels else []
    return {sentinels[s] for s in ready if processes[sentinels[s]].exitcode is None}


def done_units(store: RunStore) -> set[tuple[str, str, str]]:
    return {(r["model"], r["scenario"], r["path"]) for r in store.read("done")}


class Watch:
    """A pool's workers: progress from the store's done lines (the bar, and per worker the units its tasks owe),
    their processes (pid -> worker name from `manifest.executor.workers`), and the stall check: a worker that has
    stored units, has units left, and stored none for `stall_s` seconds. Its clock starts at its first unit: before
    that it loads its model and generates its first replies, which take as long as the model and scenarios make
    them (minutes for a 70B load), so a hang before the first unit is not caught."""

    def __init__(self, pool, store: RunStore, bar, owed: dict[str, set], stall_s: float | None):
        self.pool, self.store, self.bar, self.owed, self.stall_s = pool, store, bar, owed, stall_s
        self.before = len(store.read("done"))
        started = done_units(store)  # a resumed run's units do not start a worker's clock
        self.progress: dict[str, tuple[int, float]] = {name: (len(units & started), 0.0)
                                                       for name, units in owed.items()}
        self.processes: dict = {}  # pid -> process, every one the pool has had
        self.names: dict[int, str] = {}  # pid -> worker name, as the workers noted themselves

    def poll(self) -> str | None:
        """Update the bar; the name of a stalled worker, or None."""
        self.processes.update(getattr(self.pool, "_processes", None) or {})  # noqa: SLF001 - no public list
        rows = self.store.read("done")
        if self.bar and len(rows) - self.before != self.bar.n:
            self.bar.update(len(rows) - self.before - self.bar.n)
        if not self.owed:
            return None
        self._read_names()
        done, now = {(r["model"], r["scenario"], r["path"]) for r in rows}, time.monotonic()
        for name, (count, since) in self.progress.items():
            finished = len(self.owed[name] & done)
            if finished != count:
                self.progress[name] = (finished, now)
            elif self.stall_s is not None and since and finished < len(self.owed[name]) and now - since > self.stall_s:
                return name
        return None

    def _read_names(self) -> None:
        """pid -> worker name, from the workers that noted themselves (read until each process has a name)."""
        if len(self.names) < max(len(self.owed), len(self.processes)):
            workers = (self.store.read_manifest().get("executor") or {}).get("workers") or {}
            self.names = {entry["pid"]: name for name, entry in workers.items()}

    def dead(self) -> tuple[str, str]:
        """(worker, how its process ended) of a broken pool: the one killed or failed, not those the pool then
        stopped (SIGTERM). The pool can break as the dead process's pipe closes, a moment before its exit status
        can be read, and a process that ended first can read as running while the pool's thread reaps it: up to 2 s
        are given until some process has ended and every ended one's status is read."""
        self.processes.update(getattr(self.pool, "_processes", None) or {})  # noqa: SLF001
        deadline = time.monotonic() + 2
        while (not (gone := ended(self.processes)) or unread(self.processes)) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._read_names()
        # the cause first: a process killed by a signal from outside (SIGKILL, a segfault), then one that named its
        # own error before it ended (a tensor-parallel rank: `end_rank`), in the order they named them; peers that
        # lost it in a collective end after it, and those the pool stopped (SIGTERM) last
        named = [f["worker"] for f in (self.store.read_manifest().get("executor") or {}).get("failures") or []]
        order = sorted(gone, key=lambda pid: (gone[pid] == "killed by SIGTERM", not gone[pid].startswith("killed"),
                                              named.index(self.names[pid]) if self.names.get(pid) in named
                                              else len(named)))
        first = order[0] if order else None
        if first is None:
            return "a worker process", "its process died"
        return self.names.get(first, f"pid {first}"), f"its process (pid {first}) died: {gone[first]}"


def wait_for_workers(pool, pending: dict, store: RunStore, bar, owed: dict[str, set] | None = None,
                     stall_s: float | None = None) -> None:
    """Wait for every future of `pending` (future -> worker name); a worker's error, death or stall, Ctrl-C or
    SIGTERM stops the others at once (their finished units are kept for --resume)."""
    watch = Watch(pool, store, bar, owed or {}, stall_s)
    try:
        while pending:
            finished, _ = futures.wait(pending, timeout=0.5, return_when=futures.FIRST_EXCEPTION)
            stalled = watch.poll()
            if stalled is not None:
                raise stop_and_fail(pool, store, stalled, f"finished no unit for {stall_s:g} s (--stall-timeout): "
                                    "stopped")
            for future in finished:
                name = pending.pop(future)
                try:
                    future.result()  # a worker's exception stops the run here, its finished units kept
                except futures.process.BrokenProcessPool:
                    raise stop_and_fail(pool, store, *watch.dead()) from None  # who died read before the kill
                except Exception as error:  # its own error (CUDA out of memory, a bug): named, then raised as is
                    stop_pool(pool)
                    name_failure(store, name, f"raised {type(error).__name__}: {error}")
                    raise
        watch.poll()
    except BaseException:  # Ctrl-C, SIGTERM, a worker's error, death or stall: stop the other workers now
        stop_pool(pool)
        raise


class ModelProcesses:
    """One worker process per model (at most `jobs` at once): CPU decoding of small models is bound by per-op
    overhead on one core, so models in parallel use the machine's cores; all write one run."""

    strategy = "model-processes"

    def __init__(self, jobs: int):
        self.jobs = jobs

    def run(self, work: RunWork, store: RunStore, bar, warn) -> None:
        config = work.config
        with spawn_pool(self.jobs, config, 1) as pool:
            pending = {pool.submit(model_worker, config, directory, work.scenarios, work.calibration_chats):
                       model_label(directory) for directory in config.models}
            # each model's worker owes its model's units (the stall check had nothing to watch here before)
            owed = {model_label(d): {(model_label(d), s.id, p) for s in work.scenarios
                                     for p in (REFERENCE, *(path.name for path in model_paths(config, d)))}
                    for d in config.models}
            wait_for_workers(pool, pending, store, bar, owed, config.stall_timeout_s)


def model_worker(config, directory: Path, scenarios, calibration_chats) -> None:
    store = RunStore.attach(config.out)
    note_worker(store, model_label(directory), "cpu")  # its pid, so a death names the model
    replay_model(config, directory, scenarios, calibration_chats, store, None, say_on_stderr)


class CpuTasks:
    """One-at-a-time CPU replay as tasks of one model's reference, then one task per (model, path) once that
    model's reference is stored, on `jobs` worker processes. A task per model left cores idle while the last model
    ran alone (3 canaries on 2 cores: 167 s of CPU in a 168 s run); every task computes what the model's own worker
    computed for that backend (same code, one intra-op thread), so the stored rows are the same. The reference task
    also scores the reference's turns (teacher-forced log-probs, which every path compares against) and hands them
    to its model's path tasks, as one process scored them once for all paths."""

    strategy = "cpu-tasks"

    def __init__(self, jobs: int):
        self.jobs = jobs

    def run(self, work: RunWork, store: RunStore, bar, warn) -> None:
        config = work.config
        jobs = min(self.jobs, sum(1 + len(model_paths(config, d)) for d in config.models))
        # tasks wait here, not in the pool's queue, so a free worker takes the longest one ready: a path task costs
        # about what its model's reference task took (the same turns through one backend), and the heaviest model's
        # paths last would leave one core idle at the end; references (cost not yet known) go first, in run order
        ready = [(float("inf"), Path(directory), None, None) for directory in config.models]
        # the stall check watches the run's units as a whole: tasks start as others finish, so no worker owes a
        # fixed set; a stall is the whole pool storing no unit for --stall-timeout, named by the tasks in flight
        everything = {(model_label(d), s.id, p) for d in config.models for s in work.scenarios
                      for p in (REFERENCE, *(path.name for path in model_paths(config, d)))}
        with spawn_pool(jobs, config, 1) as pool:
            watch = Watch(pool, store, bar, {"cpu tasks": everything}, config.stall_timeout_s)
            pending: dict = {}  # future -> (model directory, path name or None for its reference, start time)

            def in_flight() -> str:
                return ", ".join(f"{model_label(d)}/{p or REFERENCE}" for d, p, _ in pending.values())

            try:
                while pending or ready:
                    while ready and len(pending) < jobs:
                        _, directory, path_name, scores = ready.pop(0)
                        future = pool.submit(unit_task, config, directory, path_name, work.scenarios,
                                             work.calibration_chats, scores)
                        pending[future] = (directory, path_name, time.monotonic())
                    finished, _ = futures.wait(pending, timeout=0.5, return_when=futures.FIRST_COMPLETED)
                    if watch.poll() is not None:
                        raise stop_and_fail(pool, store, f"tasks {in_flight()}", f"finished no unit for "
                                            f"{config.stall_timeout_s:g} s (--stall-timeout): stopped")
                    for future in finished:
                        directory, path_name, started = pending.pop(future)
                        task = f"task {model_label(directory)}/{path_name or REFERENCE}"
                        try:
                            scores = future.result()  # a worker's exception stops the run, finished units kept
                        except futures.process.BrokenProcessPool:
                            worker, how = watch.dead()
                            raise stop_and_fail(pool, store, worker, f"{how}; tasks in flight: {task}"
                                                f"{', ' + in_flight() if pending else ''}") from None
                        except Exception as error:  # named, then raised as is
                            stop_pool(pool)
                            name_failure(store, task, f"raised {type(error).__name__}: {error}")
                            raise
                        if path_name is None:  # a reference task: its model's paths may start
                            took = time.monotonic() - started
                            ready += [(took, directory, path.name, scores) for path in model_paths(config, directory)]
                            ready.sort(key=lambda task: -task[0])
                watch.poll()
                store.edit_manifest(lambda m: in_config_order(m, config))
            except BaseException:  # Ctrl-C, SIGTERM or a worker's error: stop the other workers now
                stop_pool(pool)
                raise


def in_config_order(manifest: dict, config) -> None:
    """Models and each model's scales in the order the run names them (tasks note them as they finish)."""
    labels = [model_label(d) for d in config.models]
    manifest["models"].sort(key=lambda m: labels.index(m["label"]) if m["label"] in labels else len(labels))
    names = [p.name for p in config.paths]
    for label, scales in manifest["scales"].items():
        manifest["scales"][label] = dict(sorted(scales.items(), key=lambda kv: names.index(kv[0])
                                                if kv[0] in names else len(names)))


# ---------------------------------------------------------------- one worker per GPU


def owed_units(config, tasks) -> set[tuple[str, str, str]]:
    """The units a worker's tasks owe: each task's scenarios x the reference and the model's paths."""
    return {(model_label(t.model), scenario, path) for t in tasks for scenario in t.scenario_ids
            for path in (REFERENCE, *(p.name for p in model_paths(config, t.model)))}


class DataParallel:
    """One worker process per device of `plan` (a GPU each; `cpu` devices run the same pool on the CPU), each
    replaying its tasks into the one run directory; a plan of one device runs in this process on it."""

    strategy = "data-parallel"

    def __init__(self, plan: Plan, requested: tuple[str, ...]):
        self.plan, self.requested = plan, requested

    def layout(self, scenario_count: int) -> dict:
        whole = all(len(t.scenario_ids) == scenario_count for tasks in self.plan.work for t in tasks)
        return {"kind": "data-parallel", "devices": list(self.requested), "used": list(self.plan.devices),
                "why": self.plan.reason, "shards": self.plan.describe(model_label),
                "batch_composition": "as on one GPU: every model whole on one GPU" if whole else
                "differs from one GPU: a model's scenarios are split over GPUs (see noise_floor)"}

    def run(self, work: RunWork, store: RunStore, bar, warn) -> None:
        config = work.config
        layout = self.layout(len(work.scenarios))
        store.edit_manifest(lambda manifest: manifest.__setitem__("parallel", layout))
        warn(f"data-parallel: {self.plan.reason}")
        if len(self.plan.devices) == 1:  # no worker pays off: this process, on the first device
            InProcess().run(replace(work, config=replace(config, device=self.plan.devices[0])), store, bar, warn)
            return
        threads = 1 if self.plan.devices[0] == "cpu" else 0
        names = self.plan.names
        with spawn_pool(len(self.plan.devices), config, threads) as pool:
            pending = {pool.submit(device_worker, replace(config, device=device), name, tasks, work.scenarios,
                                   work.calibration_chats): name
                       for name, device, tasks in zip(names, self.plan.devices, self.plan.work) if tasks}
            owed = {name: owed_units(config, tasks) for name, tasks in zip(names, self.plan.work) if tasks}
            wait_for_workers(pool, pending, store, bar, owed, config.stall_timeout_s)


def device_worker(config, name: str, tasks, scenarios, calibration_chats) -> None:
    store = RunStore.attach(config.out)
    note_worker(store, name, config.device)
    by_id = {s.id: s for s in scenarios}
    cache: dict = {}  # each model loaded once by this worker
    for task in tasks:
        chunk = [by_id[i] for i in task.scenario_ids]
        replay_model(config, task.model, chunk, calibration_chats, store, None, say_on_stderr, cache)
