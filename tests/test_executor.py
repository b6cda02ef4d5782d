"""The executor seam's plain parts, without workers: option checks, the driver's merge of a worker's manifest
notes, and the streaming store a remote task writes into (harness/executor)."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest

from harness import job
from harness.cli import main
from harness.executor import executor_for, local
from harness.executor.remote import Snapshot, StreamingStore, merge_notes
from harness.runs.store import RunStore


@pytest.mark.parametrize("fields, message", [
    (dict(executor="threads"), "--executor threads: unknown"),
    (dict(ray_address="10.0.0.1:6379"), "a Ray cluster is used by --executor ray only"),
    (dict(executor="ray", shard="layers", device="cuda:0,1"), "--shard layers is not spread over Ray actors"),
    (dict(executor="ray", reference_url="http://127.0.0.1:1", candidate_urls=("http://127.0.0.1:2",)),
     "an endpoint run is not spread over Ray actors"),
    (dict(workers=0), "--workers must be >= 1"),
    (dict(stall_timeout_s=float("nan")), "--stall-timeout must be a positive number"),
])
def test_executor_options_that_cannot_run_are_refused_by_flag(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        job.RunConfig(models=(), scenario_paths=(), paths=(), out=tmp_path, **fields)


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0"], "--workers: must be at least 1"),
    (["--stall-timeout", "nan"], "--stall-timeout"),
    (["--executor", "threads"], "invalid choice: 'threads'"),
    (["--ray-address", "10.0.0.1:6379"], "a Ray cluster is used by --executor ray only"),
])
def test_the_cli_refuses_bad_executor_options_without_a_traceback(tmp_path, capsys, argv, message):
    try:
        code = main(["run", "--out", str(tmp_path / "run"), *argv])
    except SystemExit as usage:  # argparse's own refusals
        code = usage.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_executor_ray_without_ray_installed_is_refused_before_the_run(tmp_path, capsys, monkeypatch, tiny_models):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    code = main(["run", "--out", str(tmp_path / "run"), "--model", str(tiny_models["gqa"]), "--executor", "ray"])
    err = capsys.readouterr().err
    assert code == 2 and "pip install 'fp8-harness[ray]'" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "manifest.json").exists()


@pytest.mark.parametrize("address, message", [
    ("127.0.0.1:1", "no Ray cluster answers there"),
    ("10.0.0.1", "expected HOST:PORT"),
    ("host:99999999", "no Ray cluster answers there"),
])
def test_a_ray_address_nothing_answers_on_is_refused_at_once(tmp_path, capsys, tiny_models, address, message):
    """Ray itself waits minutes for a cluster that is not there; the run is refused before its directory is made."""
    code = main(["run", "--out", str(tmp_path / "run"), "--model", str(tiny_models["gqa"]), "--executor", "ray",
                 "--ray-address", address])
    err = capsys.readouterr().err
    assert code == 2 and message in err and f"--ray-address {address}" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "manifest.json").exists()


def test_the_run_options_choose_the_executor(tmp_path):
    def chosen(**fields):
        return executor_for(job.RunConfig(models=(Path("a"), Path("b")), scenario_paths=(), paths=(), out=tmp_path,
                                          **fields), []).strategy

    assert chosen(jobs=1) == "in-process"
    assert chosen(jobs=2) == "cpu-tasks"
    assert chosen(jobs=2, batch_size=4) == "model-processes"
    assert chosen(device="cpu,cpu", shard="tensor") == "tensor-parallel"
    assert chosen(executor="ray") == "ray"


def test_a_workers_notes_merge_into_the_run_manifest():
    """What a remote task noted (its model, scales, routes, a warning) joins the run's manifest; what the run
    already had (another model, the driver's fields) stays."""
    base = {"status": "running", "models": [{"label": "mla"}], "scales": {"mla": {"bf16": None}}, "warnings": ["w0"],
            "paths": [{"name": "bf16", "routes": {"mla": "r-mla"}}], "families": {}}
    current = {**base, "status": "running", "models": [{"label": "mla"}, {"label": "hybrid"}]}
    updated = {**base, "status": "interrupted", "models": [{"label": "mla"}, {"label": "gqa", "arch": "llama"}],
               "scales": {"mla": {"bf16": None}, "gqa": {"bf16": None}}, "warnings": ["w0", "w1"],
               "paths": [{"name": "bf16", "routes": {"mla": "r-mla", "gqa": "r-gqa"}}], "families": {"gqa": {}}}
    merge_notes(current, base, updated)
    assert [m["label"] for m in current["models"]] == ["mla", "hybrid", "gqa"]
    assert current["scales"] == {"mla": {"bf16": None}, "gqa": {"bf16": None}} and current["families"] == {"gqa": {}}
    assert current["paths"][0]["routes"] == {"mla": "r-mla", "gqa": "r-gqa"}
    assert current["warnings"] == ["w0", "w1"] and current["status"] == "running"


def test_a_streaming_store_reads_its_snapshot_and_passes_each_unit_on(tmp_path):
    """A remote task's scratch store knows the run's done units (so it skips them) and hands every unit it
    finishes and every error row to the driver."""
    run = RunStore.create(tmp_path / "run", {"models": [], "warnings": []})
    run.finish_unit("gqa", "s1", "reference", {"texts": [{"model": "gqa", "scenario": "s1", "path": "reference"}]})
    outbox: queue.Queue = queue.Queue()
    Snapshot.of(run, Path("gqa")).write(tmp_path / "scratch")
    scratch = StreamingStore(tmp_path / "scratch", outbox)
    assert scratch.is_done("gqa", "s1", "reference") and len(scratch.read("texts")) == 1
    scratch.finish_unit("gqa", "s1", "bf16", {"records": [{"metric": "kl_max", "value": 0.0}]})
    scratch.append("errors", [{"error": "boom"}])
    assert outbox.get_nowait() == ("unit", ("gqa", "s1", "bf16"), {"records": [{"metric": "kl_max", "value": 0.0}]})
    assert outbox.get_nowait() == ("errors", [{"error": "boom"}])
    assert not (tmp_path / "run" / "records.jsonl").exists()  # the driver writes the run, not the task


def test_a_worker_failure_names_the_worker_in_the_manifest(tmp_path):
    store = RunStore.create(tmp_path / "run", {"models": [], "warnings": []})
    error = local.fail(store, "cuda:1", "its process (pid 7) died: killed by SIGKILL")
    manifest = store.read_manifest()
    assert manifest["executor"]["failures"] == [{"worker": "cuda:1", "what": "its process (pid 7) died: killed by "
                                                                             "SIGKILL"}]
    assert "worker cuda:1" in manifest["warnings"][0] and "--resume" in str(error)
