"""Several GPUs of one host: `--device cuda:N` on any GPU, and one run spread over GPUs (`cuda:0,1`, `cuda:all`).

The CPU tests check how work is sharded and how the device list is read; the multi-GPU tests (`multigpu`: `--gpu` on a
host with at least two GPUs) run the default canary set on the last GPU and data-parallel, against a one-GPU run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness import job
from harness.run_config import build_run_config
from harness.scenarios.sources import load_scenarios

TIMING = ("seconds", "ms_per", "tok_per_s", "tokens_per_s", "_time")  # wall-clock metrics differ run to run


def scenario_list(count: int) -> list:
    scenarios = load_scenarios(list(job.default_scenarios()))
    assert len(scenarios) >= count
    return scenarios[:count]


def test_models_stay_whole_when_there_are_at_least_as_many_as_gpus():
    """3 models on 2 GPUs: each model on one GPU (its batches as on one GPU), loads 2 + 1 models."""
    models = tuple(Path(m) for m in ("gqa", "mla", "hybrid"))
    scenarios = scenario_list(6)
    plan = job.data_parallel_shards(models, scenarios, ["cuda:0", "cuda:1"])
    placed = [model for work in plan for model, chunk in work if len(chunk) == len(scenarios)]
    assert sorted(placed) == sorted(models) and sorted(len(work) for work in plan) == [1, 2]


def test_one_model_is_split_over_every_gpu_and_each_scenario_runs_once():
    scenarios = scenario_list(7)  # odd: shards of 2, 2, 2, 1
    plan = job.data_parallel_shards((Path("gqa"),), scenarios, [f"cuda:{i}" for i in range(4)])
    ids = [s.id for work in plan for _, chunk in work for s in chunk]
    assert sorted(ids) == sorted(s.id for s in scenarios) and all(len(work) == 1 for work in plan)


def test_more_gpus_than_models_cuts_models_into_equal_cost_segments():
    """3 models on 4 GPUs (the pay-off check, `plan.workers_that_pay_off`, already chose 4): every GPU works, every
    (model, scenario) runs once, a model spans at most two neighbouring GPUs, and the GPUs' costs are within one
    scenario of each other."""
    from harness.executor.plan import scenario_tokens

    models, scenarios = tuple(Path(m) for m in ("a", "b", "c")), scenario_list(12)
    plan = job.data_parallel_shards(models, scenarios, [f"cuda:{i}" for i in range(4)])
    placed = [(model, s.id) for work in plan for model, chunk in work for s in chunk]
    assert sorted(placed) == sorted((m, s.id) for m in models for s in scenarios)
    assert all(len(work) >= 1 for work in plan)
    assert all(len({i for i, work in enumerate(plan) if any(m == model for m, _ in work)}) <= 2 for model in models)
    loads = [sum(scenario_tokens(s) for _, chunk in work for s in chunk) for work in plan]
    assert max(loads) - min(loads) <= 2 * max(scenario_tokens(s) for s in scenarios), loads


def test_a_model_with_more_layers_costs_more_and_is_placed_by_cost(tmp_path):
    """Work is split by cost (tokens x layers), not by count: a 12-layer model against two 2-layer ones on 2 GPUs
    sits alone on one GPU (its scenarios whole), the two light ones share the other."""
    for name, layers in (("deep", 12), ("light1", 2), ("light2", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    models = tuple(tmp_path / name for name in ("light1", "deep", "light2"))
    plan = job.data_parallel_shards(models, scenario_list(6), ["cuda:0", "cuda:1"])
    assert sorted(sorted(m.name for m, _ in work) for work in plan) == [["deep"], ["light1", "light2"]]


def test_a_small_run_uses_one_gpu_and_a_large_one_every_gpu_and_says_why():
    """The default set's estimated work is about one worker's start-up: one GPU (in this process); 8 copies of it
    pay off on 4 GPUs. The manifest keeps the reason."""
    import dataclasses

    from harness.executor.plan import plan_data_parallel

    models = job.default_models()[0]
    scenarios = scenario_list(12)
    devices = [f"cuda:{i}" for i in range(4)]
    small = plan_data_parallel(models, scenarios, devices, paths=7)
    assert small.devices == ("cuda:0",) and "1 of 4 device(s)" in small.reason
    eight = [dataclasses.replace(s, id=f"{s.id}-{i}") for i in range(8) for s in scenarios]
    large = plan_data_parallel(models, eight, devices, paths=7)
    assert large.devices == tuple(devices) and "4 of 4 device(s)" in large.reason
    assert plan_data_parallel(models, scenarios, devices, paths=7, workers=3).devices == tuple(devices[:3])


@pytest.mark.parametrize("spec, count, expected", [
    ("cuda:all", 4, "cuda:0,1,2,3"),
    ("cuda:all", 1, "cuda"),
    ("cuda:2,0", 4, "cuda:2,0"),
    ("cuda:3", 4, "cuda:3"),
])
def test_device_lists_resolve(monkeypatch, spec, count, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert job.resolve_device(spec) == expected
    assert job.run_devices(expected) == ([f"cuda:{i}" for i in expected[5:].split(",")] if "," in expected
                                         else [expected])


@pytest.mark.parametrize("spec, message", [
    ("cuda:0,5", "torch sees 2 CUDA device"),
    ("cuda:1,1", "named twice"),
    ("cuda:0,", "unknown device"),
    ("gpu:0", "unknown device"),
])
def test_bad_device_lists_are_refused_by_name(monkeypatch, spec, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=message):
        job.resolve_device(spec)


# ---------------------------------------------------------------- GPU hosts


def rows(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"{name}.jsonl").read_text().splitlines() if line.strip()]


def comparable(run_dir: Path) -> dict[str, list]:
    """Records (timings left out), replies and verdicts, each sorted: what must match a one-GPU run."""
    records = [r for r in rows(run_dir, "records") if not any(t in r["metric"] for t in TIMING)]
    key = lambda r: json.dumps(r, sort_keys=True)  # noqa: E731
    return {"records": sorted(map(key, records)),
            "texts": sorted(key({k: r[k] for k in ("model", "scenario", "path", "turn", "text")})
                            for r in rows(run_dir, "texts")),
            "verdicts": sorted(key({k: r[k] for k in ("model", "scenario", "path", "turn", "verdict")})
                               for r in rows(run_dir, "verdicts"))}


def canary_run(out: Path, device: str, **fields) -> Path:
    run_dir = job.run_job(build_run_config(command=["pytest", "data-parallel", device], out=out, device=device,
                                           **fields))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete", manifest
    return run_dir


@pytest.fixture(scope="module")
def one_gpu_run(tmp_path_factory) -> Path:
    return canary_run(tmp_path_factory.mktemp("dp") / "cuda0", "cuda:0")


@pytest.mark.multigpu
def test_the_last_gpu_runs_the_default_canary_set_as_the_first(one_gpu_run, tmp_path):
    """Every launch, graph and allocation follows the run's device: cuda:N-1 stores what cuda:0 stores."""
    last = canary_run(tmp_path / "last", f"cuda:{torch.cuda.device_count() - 1}")
    assert comparable(last) == comparable(one_gpu_run)


@pytest.mark.multigpu
def test_a_data_parallel_run_stores_what_one_gpu_stores(one_gpu_run, tmp_path):
    """3 canaries over every GPU: the default set pays off on one GPU (run in this process, the reason stored);
    forced onto at most 3 worker processes (--workers), models stay whole: identical records, replies and
    verdicts either way; the layout is in the manifest."""
    spread = canary_run(tmp_path / "all", "cuda:all")
    layout = json.loads((spread / "manifest.json").read_text())["parallel"]
    assert layout["kind"] == "data-parallel" and len(layout["devices"]) == torch.cuda.device_count()
    assert layout["used"] == ["cuda:0"] and "1 of" in layout["why"]
    assert comparable(spread) == comparable(one_gpu_run)
    workers = min(3, torch.cuda.device_count())
    forced = canary_run(tmp_path / "forced", "cuda:all", workers=workers)
    layout = json.loads((forced / "manifest.json").read_text())["parallel"]
    assert len(layout["used"]) == workers and layout["batch_composition"].startswith("as on one GPU")
    assert comparable(forced) == comparable(one_gpu_run)
