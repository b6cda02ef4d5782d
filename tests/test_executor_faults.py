"""Distributed faults of the local per-GPU worker pool (`harness/executor/local.py` `DataParallel`), run on the CPU:
two workers on the `cpu` device, the pool and its checks exactly as on GPUs. A worker killed (SIGKILL) or stalled
(SIGSTOP, with --stall-timeout) mid-run: the run stops resumable, the failure named in the manifest, and after
`--resume` every unit is stored once (0 lost, 0 duplicated) with the records of an undisturbed run in one process.
A worker whose GPU errors (CUDA out of memory, planted) ends the units it hit as named unit errors, and `--resume`
completes them.
One scenario keeps them short: each worker stores a unit every few seconds (a stall stands out) and the run's time
is mostly its two workers' start."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest

from harness import job
from harness.executor import executor_for
from harness.executor.local import DataParallel, WorkerFailure
from harness.executor.plan import plan_data_parallel
from harness.scenarios.sources import load_scenarios

SCENARIOS = Path(__file__).parent / "data" / "scenarios" / "smoke.yaml"
TIMING = ("seconds", "ms_per", "tok_per_s", "tokens_per_s", "_time")  # wall-clock metrics differ run to run


def rows(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def comparable(run_dir: Path, scenarios: tuple[str, ...] = ()) -> dict:
    """Records (timings left out) and replies, sorted (of `scenarios` only, if named): what must not change with
    where units ran."""
    key = lambda r: json.dumps(r, sort_keys=True)  # noqa: E731
    kept = lambda r: not scenarios or r["scenario"] in scenarios  # noqa: E731
    return {"records": sorted(key(r) for r in rows(run_dir, "records")
                              if kept(r) and not any(t in r["metric"] for t in TIMING)),
            "texts": sorted(key({k: r[k] for k in ("model", "scenario", "path", "turn", "text")})
                            for r in rows(run_dir, "texts") if kept(r))}


def config_for(tiny_models, out: Path, **fields) -> job.RunConfig:
    return job.RunConfig(models=(Path(tiny_models["gqa"]), Path(tiny_models["mla"])), scenario_paths=(SCENARIOS,),
                         paths=job.parse_kv_paths("fp8_e4m3"), out=out, jobs=1, scenario_ids=("smoke-chat",),
                         **fields)


def scenarios_of(config) -> list:
    return [s for s in load_scenarios([SCENARIOS]) if not config.scenario_ids or s.id in config.scenario_ids]


def cpu_pool(config) -> DataParallel:
    """Two pool workers on the CPU, each a whole model (what two GPUs would get)."""
    plan = plan_data_parallel(config.models, scenarios_of(config), ["cpu", "cpu"], len(config.paths), workers=2)
    return DataParallel(plan, ("cpu", "cpu"))


def expected_units(config) -> set:
    return {(m.name, s.id, p) for m in config.models for s in scenarios_of(config)
            for p in ("reference", *(path.name for path in config.paths))}


@pytest.fixture(scope="module")
def undisturbed(tiny_models, tmp_path_factory) -> Path:
    return job.run_job(config_for(tiny_models, tmp_path_factory.mktemp("pool") / "undisturbed"),
                       warn=lambda message: None)


def disturb(config, signal_number: int) -> tuple[BaseException | None, int]:
    """Run `config` on the CPU pool in a thread; once a worker has stored a unit and has units left, send it
    `signal_number`. Returns what the run raised and the victim's pid."""
    return run_and_disturb(lambda: job.run_job(config, warn=lambda message: None, executor=cpu_pool(config)),
                           lambda: [pid] if (pid := _busy_worker(config.out)) is not None else [], signal_number)


def run_and_disturb(run: Callable[[], object], victims: Callable[[], list[int]],
                    signal_number: int) -> tuple[BaseException | None, int]:
    """`run` in a thread; as soon as `victims()` names processes, send each `signal_number`. Returns what the run
    raised and the first victim's pid. A run still going 240 s later hung; a process left stopped is killed."""
    raised: list[BaseException] = []

    def in_thread() -> None:
        try:
            run()
        except BaseException as error:  # noqa: BLE001 - the test reads it
            raised.append(error)

    thread = threading.Thread(target=in_thread)
    thread.start()
    found, deadline = [], time.monotonic() + 240
    while not found and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
        found = victims()
    assert found, f"no worker was mid-run to disturb (the run raised {raised})"
    for pid in found:
        os.kill(pid, signal_number)
    thread.join(timeout=240)
    assert not thread.is_alive(), "the run hung after a worker was disturbed"
    for pid in found:
        if signal_number == signal.SIGSTOP and _alive(pid):  # the executor kills it; never leave one stopped
            os.kill(pid, signal.SIGKILL)
    return (raised[0] if raised else None), found[0]


def _busy_worker(run_dir: Path) -> int | None:
    """A worker's pid once it has stored at least one unit of its model and has some left."""
    try:
        workers = json.loads((run_dir / "manifest.json").read_text()).get("executor", {}).get("workers", {})
    except (OSError, ValueError):
        return None
    done = rows(run_dir, "done")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    shards = manifest.get("parallel", {}).get("shards", {})
    per_model = len(manifest["scenarios"]) * (1 + len(manifest["paths"]))  # reference, bf16, fp8_e4m3
    for name, entry in workers.items():
        model = shards[name][0]["model"] if shards.get(name) else None
        mine = [r for r in done if r["model"] == model]
        if 1 <= len(mine) <= per_model - 1 - per_model // 3:
            return entry["pid"]
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def undisturbed_batched(tiny_models, tmp_path_factory) -> Path:
    """The model pool batches (--batch-size 4): its records are a batched run's, not one process's one at a time."""
    return job.run_job(replace(config_for(tiny_models, tmp_path_factory.mktemp("pool") / "batched"), jobs=2,
                               batch_size=4), warn=lambda message: None)


def resume_and_check(config, undisturbed: Path) -> None:
    """--resume: every unit once, the records of the undisturbed run."""
    run_dir = job.run_job(replace(config, resume=True), warn=lambda message: None)  # in one process: same units
    done = [(r["model"], r["scenario"], r["path"]) for r in rows(run_dir, "done")]
    assert len(done) == len(set(done)), "a unit stored twice"
    assert set(done) == expected_units(config), "units lost"
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "complete"
    assert comparable(run_dir) == comparable(undisturbed)


@pytest.mark.slow
def test_a_killed_pool_worker_stops_the_run_resumable_and_resume_loses_and_duplicates_nothing(
        tiny_models, tmp_path, undisturbed):
    config = config_for(tiny_models, tmp_path / "killed")
    raised, victim = disturb(config, signal.SIGKILL)
    assert isinstance(raised, WorkerFailure) and f"pid {victim}" in str(raised) and "SIGKILL" in str(raised)
    manifest = json.loads((config.out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    [failure] = manifest["executor"]["failures"]
    assert manifest["executor"]["workers"][failure["worker"]]["pid"] == victim and "SIGKILL" in failure["what"]
    resume_and_check(config, undisturbed)


@pytest.mark.slow
@pytest.mark.matrix
def test_a_stalled_pool_worker_is_stopped_named_and_resume_completes(tiny_models, tmp_path, undisturbed):
    # a unit every few seconds even on a busy 2-core box, so 15 s without one after the first is a stall
    config = config_for(tiny_models, tmp_path / "stalled", stall_timeout_s=15.0)
    raised, victim = disturb(config, signal.SIGSTOP)
    assert isinstance(raised, WorkerFailure) and "--stall-timeout" in str(raised)
    manifest = json.loads((config.out / "manifest.json").read_text())
    [failure] = manifest["executor"]["failures"]
    assert manifest["executor"]["workers"][failure["worker"]]["pid"] == victim
    assert "finished no unit for 15 s" in failure["what"] and manifest["status"] == "interrupted"
    resume_and_check(replace(config, stall_timeout_s=None), undisturbed)


@pytest.mark.slow
def test_a_pool_worker_that_raises_is_named_and_its_error_raised(tiny_models, tmp_path):
    """A worker's own error (here its model directory vanished after the run's checks; on a GPU, CUDA out of
    memory) stops the pool: the error is raised as in one process, and the manifest names the worker."""
    import shutil

    from harness.executor.local import RunWork
    from harness.runs.store import RunStore

    model = tmp_path / "gone"
    shutil.copytree(tiny_models["gqa"], model)
    config = replace(config_for(tiny_models, tmp_path / "run"), models=(model, Path(tiny_models["mla"])))
    store = RunStore.create(config.out, job._manifest(config, scenarios_of(config)))
    pool = cpu_pool(config)
    shutil.rmtree(model)
    with pytest.raises(FileNotFoundError, match="gone"):
        pool.run(RunWork(config, tuple(scenarios_of(config)), ()), store, None, lambda message: None)
    [failure] = store.read_manifest()["executor"]["failures"]
    assert failure["worker"].startswith("cpu#") and failure["what"].startswith("raised FileNotFoundError")


def test_a_worker_failure_is_exit_3_with_the_resume_command(tiny_models, tmp_path, capsys, monkeypatch):
    """The CLI's side: a stopped pool is not a traceback but exit 3, naming the worker and how to continue."""
    from harness import cli

    def failing(config, progress=None, warn=print, executor=None):
        raise WorkerFailure("worker cuda:1: its process (pid 7) died: killed by SIGKILL; finished units are stored, "
                            "the rest run with --resume")

    monkeypatch.setattr(job, "run_job", failing)
    code = cli.main(["run", "--out", str(tmp_path / "run"), "--model", str(tiny_models["gqa"]), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 3 and "worker cuda:1" in err and "--resume" in err and "Traceback" not in err


# What a worker's process imports first (Python's `sitecustomize`, found on the PYTHONPATH the spawned workers inherit):
# its engine's decode forward raises CUDA's out-of-memory error once the worker has stored a unit. A plant in the test
# only: the pool and the engine run as shipped.
OOM_PLANT = r'''
import torch
import harness.replay.batched as batched

_forward, calls = batched.BatchedEngine._forward, []

def _forward_out_of_memory(self, *args, **kwargs):
    calls.append(1)
    if len(calls) > 12:  # of the ~26 a worker makes on its model (tests/data smoke-chat): mid-run
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (planted by the test)")
    return _forward(self, *args, **kwargs)

batched.BatchedEngine._forward = _forward_out_of_memory
'''


@pytest.mark.slow
def test_a_pool_worker_out_of_memory_is_named_and_resume_loses_and_duplicates_nothing(
        tiny_models, tmp_path, undisturbed, monkeypatch):
    """A GPU that errors in one worker (CUDA out of memory mid-run, planted in the spawned workers): the units it hit
    end as unit errors named in the run (errors.jsonl: model, scenario, path, the error), the rest complete, the run
    is `complete_with_errors`; --resume (in one process, no plant) replays the missing units: every unit once, the
    undisturbed run's records."""
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(OOM_PLANT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(plant), os.environ.get("PYTHONPATH", "")]))
    config = config_for(tiny_models, tmp_path / "oom")
    job.run_job(config, warn=lambda message: None, executor=cpu_pool(config))
    errors = rows(config.out, "errors")
    assert errors and all(e["error"].startswith("OutOfMemoryError: CUDA out of memory") for e in errors), errors
    assert json.loads((config.out / "manifest.json").read_text())["status"] == "complete_with_errors"
    done = {(r["model"], r["scenario"], r["path"]) for r in rows(config.out, "done")}
    assert done and not done & {(e["model"], e["scenario"], e["path"]) for e in errors}, "an errored unit counted done"
    monkeypatch.delenv("PYTHONPATH")
    resume_and_check(config, undisturbed)


# ---------------------------------------------------------------- the CPU default: one task per (model, path)


def cpu_task_workers(run_dir: Path) -> list[int]:
    """The CPU task workers' pids once the run has stored a unit and has units left: the pool's processes are this
    test's process's children (the run is in a thread of it), found in /proc."""
    done = rows(run_dir, "done")
    if not 1 <= len(done) <= 6:  # of the 8 units (2 models x reference, bf16, its control, fp8_e4m3)
        return []
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def disturb_cpu_tasks(config, signal_number: int) -> tuple[BaseException | None, int]:
    """SIGKILL: one worker (any death breaks the pool). SIGSTOP: every worker, since which one holds a task is not
    visible from outside, and a stopped worker that holds none only idles while the other finishes the run."""
    def victims() -> list[int]:
        workers = cpu_task_workers(config.out)
        return workers if signal_number == signal.SIGSTOP else workers[:1]

    return run_and_disturb(lambda: job.run_job(config, warn=lambda message: None), victims, signal_number)


# the CPU's two pools: a task per (model, path) (the default with --jobs 2), a process per model (--batch-size set)
CPU_POOLS = [pytest.param("cpu-tasks", {}, id="cpu-tasks"),
             pytest.param("model-processes", {"batch_size": 4}, id="model-processes", marks=pytest.mark.matrix)]


@pytest.mark.slow
@pytest.mark.matrix  # CI: the data-parallel pool's killed worker, and the CPU task pool's stall
@pytest.mark.parametrize("strategy, fields", CPU_POOLS)
def test_a_killed_cpu_pool_worker_is_named_and_resume_loses_and_duplicates_nothing(
        tiny_models, tmp_path, request, strategy, fields):
    config = replace(config_for(tiny_models, tmp_path / "killed"), jobs=2, **fields)
    assert executor_for(config, scenarios_of(config)).strategy == strategy
    raised, victim = disturb_cpu_tasks(config, signal.SIGKILL)
    assert isinstance(raised, WorkerFailure) and f"pid {victim}" in str(raised) and "SIGKILL" in str(raised), raised
    if strategy == "cpu-tasks":
        assert "tasks in flight" in str(raised)
    else:  # a model's worker notes itself: its death names the model
        assert str(raised).startswith(("worker gqa:", "worker mla:")), raised
    assert json.loads((config.out / "manifest.json").read_text())["status"] == "interrupted"
    resume_and_check(config, request.getfixturevalue("undisturbed_batched" if fields else "undisturbed"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy, fields", CPU_POOLS)
def test_a_stalled_cpu_pool_is_stopped_named_and_resume_completes(tiny_models, tmp_path, request, strategy, fields):
    """The CPU pools had no stall check: stopped workers hung the run for good, --stall-timeout or not. The task
    pool storing no unit for the timeout now stops the run, naming the tasks in flight; the model pool names the
    model whose worker stored none."""
    config = replace(config_for(tiny_models, tmp_path / "stalled"), jobs=2, stall_timeout_s=20.0, **fields)
    raised, victim = disturb_cpu_tasks(config, signal.SIGSTOP)
    assert isinstance(raised, WorkerFailure) and "--stall-timeout" in str(raised), raised
    manifest = json.loads((config.out / "manifest.json").read_text())
    [failure] = manifest["executor"]["failures"]
    assert failure["worker"].startswith("tasks " if strategy == "cpu-tasks" else ("gqa", "mla")), failure
    assert "finished no unit for 20 s" in failure["what"] and manifest["status"] == "interrupted"
    resume_and_check(replace(config, stall_timeout_s=None),
                     request.getfixturevalue("undisturbed_batched" if fields else "undisturbed"))


def test_a_worker_that_will_not_exit_does_not_hang_the_end_of_a_run(tmp_path, monkeypatch):
    """A stopped worker that held no task never reads the pool's shutdown sentinel, and `ProcessPoolExecutor`'s
    exit joined it for good: a CPU task run that had stored every unit hung (session 19). The pool now gives each
    worker CLOSE_GRACE_S after the work, then kills it."""
    from harness.executor import local

    monkeypatch.setattr(local, "CLOSE_GRACE_S", 3.0)
    config = job.RunConfig(models=(), scenario_paths=(), paths=(), out=tmp_path)
    started = time.monotonic()
    with local.spawn_pool(2, config, 1) as pool:
        assert sorted(pool.map(abs, [-1, -2, -3, -4])) == [1, 2, 3, 4]
        processes = list(pool._processes.values())  # noqa: SLF001
        os.kill(processes[0].pid, signal.SIGSTOP)
    assert time.monotonic() - started < local.CLOSE_GRACE_S + 30  # the pool's start-up, then the grace; unbounded before
    # join returns when the process's sentinel closes, which can be before waitpid sees it exit (CI, session 22:
    # is_alive() True just after join, exitcode -SIGKILL a moment later): wait for the exit status itself
    deadline = time.monotonic() + 10
    while processes[0].exitcode is None and time.monotonic() < deadline:
        processes[0].join(0.1)
    assert processes[0].exitcode == -signal.SIGKILL, processes[0].exitcode


# What a pool worker imports first (see OOM_PLANT): after its second commit to the run, still holding the store's lock
# (`RunStore._exclusive`: a thread lock and an flock on the run's .lock), it stops itself (SIGSTOP). In CI a SIGSTOP
# from the tests above landed inside a worker's fsync: the parent's stall check fired, then blocked for good taking the
# same lock to name the failure. Here the stop lands inside the lock every time.
STOP_IN_LOCK_PLANT = r'''
import os
import signal

from harness.runs.store import RunStore

_commit, commits = RunStore._commit, []

def _commit_then_stop(self, group):
    _commit(self, group)
    commits.append(1)
    if len(commits) == 2:
        os.kill(os.getpid(), signal.SIGSTOP)  # the lock is still held: _commit runs inside _exclusive

RunStore._commit = _commit_then_stop
'''


def stopped_children() -> list[int]:
    """This process's spawned children that are stopped (state T)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        if fields[0] == "T" and int(fields[1]) == os.getpid():
            found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["cpu-tasks", pytest.param("data-parallel", marks=pytest.mark.matrix)])
def test_a_worker_stopped_while_it_holds_the_run_lock_is_stopped_and_named(tiny_models, tmp_path, monkeypatch, pool):
    """Both failure loops (the CPU task pool's own, and `wait_for_workers` under the model, data-parallel and
    tensor-parallel pools) kill the pool before they take the store's lock to name the failure."""
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(STOP_IN_LOCK_PLANT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(plant), os.environ.get("PYTHONPATH", "")]))
    config = replace(config_for(tiny_models, tmp_path / "stopped"), jobs=2, stall_timeout_s=10.0)
    executor = cpu_pool(config) if pool == "data-parallel" else None
    raised: list[BaseException] = []

    def in_thread() -> None:
        try:
            job.run_job(config, warn=lambda message: None, executor=executor)
        except BaseException as error:  # noqa: BLE001 - read below
            raised.append(error)

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join(timeout=240)  # the workers' start and two units each, then 10 s of stall: well under a minute here
    hung = thread.is_alive()
    for pid in stopped_children():  # never leave one stopped (a hung run's workers are still ours)
        os.kill(pid, signal.SIGKILL)
    assert not hung, "the run hung naming the failure (a stopped worker holds the run's lock)"
    assert raised and isinstance(raised[0], WorkerFailure) and "--stall-timeout" in str(raised[0]), raised
    manifest = json.loads((config.out / "manifest.json").read_text())
    [failure] = manifest["executor"]["failures"]
    assert manifest["status"] == "interrupted" and "finished no unit for 10 s" in failure["what"], failure


class _EndedProcess:
    """A pool worker that has ended: its sentinel ready (a pipe whose writer is closed, as an ended process's is), its
    exit status readable only `after` seconds on (until the pool's own thread, which reaps it too, stores it)."""

    def __init__(self, code: int, after: float):
        self.sentinel, writer = os.pipe()
        os.close(writer)
        self.code, self.readable_at = code, time.monotonic() + after

    @property
    def exitcode(self) -> int | None:
        return self.code if time.monotonic() >= self.readable_at else None


def test_a_broken_pool_names_the_killed_rank_whose_status_is_read_after_its_peers(tmp_path):
    """A SIGKILLed tensor-parallel rank while its peer ends itself (exit 70) on the lost collective: the run named the
    peer (CI, session 40: "rank 0 (cpu) ... exit 70"), so the killed rank's status was unreadable when the peer's was
    read (a process's pipes close before it is reaped, and the pool's own thread reaps it too). Every ended process's
    status is now read before one is named: here the killed rank's only 0.3 s after its peer's."""
    from harness.executor.local import Watch, note_executor
    from harness.runs.store import RunStore

    store = RunStore.create(tmp_path / "run", {"models": [], "warnings": []})
    killed, peer = _EndedProcess(-signal.SIGKILL, after=0.3), _EndedProcess(70, after=0.0)
    note_executor(store, workers={"rank 0 (cpu)": {"pid": 100, "host": "h", "device": "cpu"},
                                  "rank 1 (cpu)": {"pid": 101, "host": "h", "device": "cpu"}})

    class Pool:
        _processes = {100: peer, 101: killed}

    try:
        assert Watch(Pool(), store, None, {}, None).dead() == ("rank 1 (cpu)", "its process (pid 101) died: "
                                                                                "killed by SIGKILL")
    finally:
        os.close(killed.sentinel)
        os.close(peer.sentinel)
