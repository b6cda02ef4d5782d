"""`harness run --executor ray` on a local Ray cluster of 2 CPU actors (one cluster for the module: starting Ray
costs seconds): the records of the in-process run, and an actor killed mid-run loses and duplicates nothing (its
tasks retried on the other actor, the failure named in the manifest; `--resume` then has nothing left to do)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.cli import main
from test_executor_faults import comparable, rows

SCENARIOS = Path(__file__).parent / "data" / "scenarios" / "smoke.yaml"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster owned by this test process (2 CPUs: 2 actors); its address for a `harness run`."""
    ray = pytest.importorskip("ray", reason="the test extras install ray (pip install -e '.[test]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def run_args(tiny_models, out: Path, *extra: str) -> list[str]:
    return ["run", "--out", str(out), "--scenarios", str(SCENARIOS), "--select", "id:smoke-chat,id:smoke-arith",
            "--paths", "fp8_e4m3", "--yardstick", "none",
            "--model", str(tiny_models["gqa"]), "--model", str(tiny_models["mla"]), "--no-progress",
            "--no-fail-on-verdict", *extra]


@pytest.fixture(scope="module")
def in_process(tiny_models, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ray") / "in-process"
    assert main(run_args(tiny_models, out)) == 0
    return out


@pytest.mark.slow
@pytest.mark.matrix
def test_two_ray_actors_store_the_records_of_the_in_process_run(tiny_models, tmp_path, ray_cluster, in_process):
    out = tmp_path / "ray"
    assert main(run_args(tiny_models, out, "--executor", "ray", "--ray-address", ray_cluster, "--workers", "2")) == 0
    assert comparable(out) == comparable(in_process)
    done = [tuple(r.values()) for r in rows(out, "done")]
    assert len(done) == len(set(done)) == len(rows(in_process, "done"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["executor"]["strategy"] == "ray"
    assert len(manifest["executor"]["workers"]) == 2 and not manifest["executor"].get("failures")
    assert [m["label"] for m in manifest["models"]] == ["gqa", "mla"]
    assert manifest["scales"] == json.loads((in_process / "manifest.json").read_text())["scales"]


@pytest.mark.slow
@pytest.mark.matrix
def test_an_actor_killed_mid_run_loses_and_duplicates_no_unit(tiny_models, tmp_path, ray_cluster, in_process):
    """SIGKILL one actor once the run has stored units and has units left: the other actor takes its tasks, the
    run completes, the failure is in the manifest; --resume finds nothing missing and stores nothing twice."""
    out = tmp_path / "killed"
    args = run_args(tiny_models, out, "--executor", "ray", "--ray-address", ray_cluster, "--workers", "2")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-m", "harness.cli", *args], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim, deadline = None, time.monotonic() + 240
    while victim is None and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        victim = _actor_mid_task(out)
    assert victim is not None, "no actor was mid-run to kill"
    os.kill(victim, signal.SIGKILL)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    [failure] = manifest["executor"]["failures"]
    assert manifest["executor"]["workers"][failure["worker"]]["pid"] == victim and "died" in failure["what"]
    assert manifest["status"] == "complete" and failure["retried_on"]
    assert main([*args, "--resume"]) == 0
    done = [tuple(r.values()) for r in rows(out, "done")]
    assert len(done) == len(set(done)) == len(rows(in_process, "done")), "a unit lost or stored twice"
    assert comparable(out) == comparable(in_process)


def _actor_mid_task(run_dir: Path) -> int | None:
    """An actor's pid once its model has some units stored and at least half still to come."""
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    executor = manifest.get("executor") or {}
    workers, shards = executor.get("workers") or {}, executor.get("shards") or {}
    per_model = len(manifest["scenarios"]) * (1 + len(manifest["paths"]))
    done = rows(run_dir, "done")
    for name in sorted(workers):
        models = [task["model"] for task in shards.get(name, [])]
        mine = sum(1 for r in done if r["model"] in models)
        if models and 1 <= mine <= per_model * len(models) // 2:
            return workers[name]["pid"]
    return None


@pytest.mark.multigpu
def test_ray_actors_on_every_gpu_store_what_the_local_pool_stores(tmp_path):
    """One actor per GPU (a local Ray cluster of this host's GPUs) against the local per-GPU pool on as many GPUs:
    the same plan, so the same records, replies and verdicts (the default canary set, --batch-size pinned so free
    memory does not size the batches differently)."""
    pytest.importorskip("ray", reason="pip install 'fp8-harness[ray]'")
    import torch

    from test_data_parallel import comparable as comparable_with_verdicts

    gpus = str(torch.cuda.device_count())
    common = ["--device", "cuda:all", "--workers", gpus, "--batch-size", "16", "--no-progress", "--no-fail-on-verdict"]
    assert main(["run", "--out", str(tmp_path / "local"), *common]) == 0
    assert main(["run", "--out", str(tmp_path / "ray"), "--executor", "ray", *common]) == 0
    layout = json.loads((tmp_path / "ray" / "manifest.json").read_text())["executor"]
    assert len(layout["workers"]) == int(gpus) and not layout.get("failures")
    assert comparable_with_verdicts(tmp_path / "ray") == comparable_with_verdicts(tmp_path / "local")


def test_an_actors_own_error_is_named_in_the_run_and_raised(tiny_models, tmp_path):
    """An actor's replay that raises (CUDA out of memory on a GPU) stops the run with that error, and the manifest
    names the actor and the error, as the local pool does (tests/test_executor_faults.py). No Ray needed: the
    driver's handling of the actor's event."""
    import queue

    from harness import job
    from harness.executor.ray_executor import Driver
    from harness.runs.store import RunStore
    from test_executor_faults import config_for, scenarios_of

    config = config_for(tiny_models, tmp_path / "run")
    store = RunStore.create(config.out, job._manifest(config, scenarios_of(config)))  # noqa: SLF001
    driver = Driver(None, store, None, lambda message: None, None)
    driver.events = queue.Queue()
    driver.events.put(("actor-1", ("raised", MemoryError("CUDA out of memory (planted)"))))
    with pytest.raises(MemoryError, match="planted"):
        driver._handle({"actor-1": None}, {}, {"actor-1": ("task", time.monotonic())})  # noqa: SLF001
    [failure] = store.read_manifest()["executor"]["failures"]
    assert failure == {"worker": "actor-1", "what": "raised MemoryError: CUDA out of memory (planted)"}


def test_a_stalled_actor_is_killed_named_and_its_tasks_go_to_the_actors_left(tiny_models, tmp_path):
    """--stall-timeout on Ray: an actor that sent nothing for the limit is killed (its stream then ends as died), the
    manifest names it as stalled, and its running and queued tasks move to the actors left. The driver's side,
    without Ray (the actor-killed test above runs the died path on a real cluster)."""
    import queue
    from types import SimpleNamespace

    from harness import job
    from harness.executor.ray_executor import Driver
    from harness.runs.store import RunStore
    from test_executor_faults import config_for, scenarios_of

    config = config_for(tiny_models, tmp_path / "run")
    store = RunStore.create(config.out, job._manifest(config, scenarios_of(config)))  # noqa: SLF001
    killed, warnings = [], []
    driver = Driver(SimpleNamespace(kill=killed.append), store, None, warnings.append, 10.0)
    driver.events = queue.Queue()
    task = lambda name: SimpleNamespace(name=name, cost=1.0)  # noqa: E731
    actors = {"actor-1": "handle-1", "actor-2": "handle-2"}
    queues = {"actor-1": [task("queued")], "actor-2": []}
    running = {"actor-1": (task("running"), time.monotonic() - 11), "actor-2": (task("other"), time.monotonic())}
    driver._handle(actors, queues, running)  # noqa: SLF001 - no event within its wait: the stall check
    assert killed == ["handle-1"] and "10 s" in warnings[0]
    driver.events.put(("actor-1", ("died", "the actor was killed")))
    driver._handle(actors, queues, running)  # noqa: SLF001
    assert list(actors) == ["actor-2"] and [t.name for t in queues["actor-2"]] == ["running", "queued"]
    [failure] = store.read_manifest()["executor"]["failures"]
    assert failure["worker"] == "actor-1" and failure["what"].startswith("stalled") and \
        failure["retried_on"] == ["actor-2"]
