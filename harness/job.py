"""`harness run` as a function: load scenarios, check inputs, open or resume the run directory, hand the work to an
executor (`harness/executor`: in this process, worker processes, a process per GPU, tensor-parallel ranks, Ray
actors, or live endpoints), then judge, write verdicts and finish the manifest."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import importlib
import platform
import subprocess
import threading
from pathlib import Path

import torch

import harness
from harness.analysis.metrics import noise_floor
from harness.executor.endpoints import ENDPOINT_MODEL, preflight_endpoints, replay_endpoints
from harness.executor.local import RunWork, WorkerFailure
from harness.executor.model_replay import SHARDED_DECODE, TENSOR_PARALLEL_DECODE, model_label
from harness.executor.plan import data_parallel_shards
from harness.replay.devices import device_list as run_devices
from harness.replay.live import candidate_labels
from harness.run_config import (CANARY_ARCHS, CANARY_WEIGHTS, DEFAULT_PATHS, DEFAULT_SCENARIOS, RANDOM_MODEL_CACHE,
                                REPO_ROOT, RunConfig, default_models, default_scenarios, new_run_dir, parse_kv_paths,
                                resolve_device)
from harness.run_inputs import InputError, check_run_inputs, scenario_budget_problems
from harness.runs.gate import write_verdicts
from harness.runs.status import expected_units, final_status, unfinished_units
from harness.runs.store import RunStore, RunStoreError, hold_run_lock
from harness.scenarios.load import Scenario
from harness.scenarios.select import select_scenarios
from harness.scenarios.sources import load_scenarios
from harness.types import Message

__all__ = [  # what callers import from here: the run's entry point, and names moved out of this module
    "CANARY_ARCHS", "CANARY_WEIGHTS", "DEFAULT_PATHS", "DEFAULT_SCENARIOS", "ENDPOINT_MODEL", "RANDOM_MODEL_CACHE",
    "REPO_ROOT", "SHARDED_DECODE", "TENSOR_PARALLEL_DECODE", "RunConfig", "WorkerFailure",
    "calibration_chats_from", "data_parallel_shards", "default_models", "default_scenarios", "model_label",
    "new_run_dir", "parse_kv_paths", "preflight_endpoints", "resolve_device", "run_devices", "run_job",
    "write_report", "write_verdicts",
]


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _versions() -> dict:
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "harness": harness.__version__, "triton": None}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    return versions


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _manifest(config: RunConfig, scenarios: list[Scenario]) -> dict:
    files = sorted({s.source for s in scenarios})
    device = config.device if config.device.startswith("cpu") else \
        f"{config.device} ({torch.cuda.get_device_name(run_devices(config.device)[0])})"
    return {
        "run_id": config.out.name, "status": "running", "command": config.command,
        "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "finished_at": None,
        "commit": _git_commit(), "versions": _versions(), "device": device, "cpu": platform.processor() or platform.machine(),
        "history_mode": config.history_mode, "seed": config.seed,
        "models": [], "scenario_files": [{"file": f, "sha256": _file_sha256(Path(f))} for f in files],
        "scenarios": [{"id": s.id, "kind": s.kind, "hash": s.content_hash, "source": s.source} for s in scenarios],
        "units_expected": len(_expected_units(config, scenarios)),
        "paths": [{"name": p.name, "canonical": p.canonical, "kind": "kv_path", "description": p.describe()}
                  for p in config.paths],
        "calibration_files": [str(p) for p in config.calibration_paths] or "built-in (harness/calibration.py)",
        "scales": {}, "noise_floor": {}, "warnings": [],
        "attention": config.attention.describe() if config.attention is not None else None,
    }


def _check_resumable(store: RunStore, config: RunConfig, scenarios: list[Scenario]) -> None:
    manifest = store.read_manifest()
    old = {(s["id"], s["hash"]) for s in manifest.get("scenarios", [])}
    new = {(s.id, s.content_hash) for s in scenarios}
    if old != new:
        raise RunStoreError(f"cannot resume {config.out}: its scenarios differ from the ones given "
                            f"({len(old ^ new)} differ); start a new run instead")
    if not config.endpoints and [p["name"] for p in manifest.get("paths", [])] != [p.name for p in config.paths]:
        raise RunStoreError(f"cannot resume {config.out}: it ran paths "
                            f"{[p['name'] for p in manifest['paths']]}, not {[p.name for p in config.paths]}")


def run_job(config: RunConfig, progress=None, warn=print, executor=None) -> Path:
    """Run everything in `config`; returns the run directory. Safe to interrupt and `resume`.
    Every input is checked before the run directory is touched; one run at a time writes it. `executor`: where
    the in-process units run (default: the one the run's options choose, `harness.executor.executor_for`)."""
    check_run_inputs(config)
    scenarios = load_scenarios(list(config.scenario_paths))  # validates everything before any model loads
    if config.scenario_ids:
        scenarios = [s for s in scenarios if s.id in set(config.scenario_ids)]
    scenarios = select_scenarios(scenarios, config.select)
    if budget := scenario_budget_problems(scenarios, config.models):  # D1: a reply longer than the context
        raise InputError(budget)
    calibration_chats = calibration_chats_from(load_scenarios(list(config.calibration_paths))) \
        if config.calibration_paths else []
    if config.endpoints:
        asyncio.run(preflight_endpoints(config))  # a dead or odd server is refused before a run directory exists
    with hold_run_lock(config.out):
        return _run_locked(config, scenarios, calibration_chats, progress, warn, executor)


def _run_locked(config: RunConfig, scenarios: list[Scenario], calibration_chats, progress, warn,
                executor=None) -> Path:
    if config.resume:
        store = RunStore.resume(config.out)
        _check_resumable(store, config, scenarios)
        store.update_manifest(status="running")
    else:
        store = RunStore.create(config.out, _manifest(config, scenarios))
    torch.manual_seed(config.seed)
    targets = len(config.candidate_urls) if config.endpoints else len(config.paths)
    total = max(1, len(config.models)) * len(scenarios) * (targets + (0 if config.endpoints and not config.reference_url
                                                                       else 1))
    bar = progress(total) if progress else None
    import_ahead()
    try:
        if config.endpoints:
            asyncio.run(replay_endpoints(config, scenarios, store, bar))
        else:
            _replay_models(config, scenarios, calibration_chats, store, bar, warn, executor)
        asyncio.run(_judge(config, scenarios, store))
        write_verdicts(store, list(config.thresholds), config.yardstick)
        unfinished = unfinished_units(store, _expected_units(config, scenarios))
        _finish(store, final_status(unfinished), unfinished_units=len(unfinished))
    except (KeyboardInterrupt, WorkerFailure):  # stopped, resumable; a worker's failure is named in the manifest
        _finish(store, "interrupted")
        raise
    except BaseException:
        _finish(store, "failed")
        raise
    finally:
        if bar:
            bar.close()
    return config.out


# what only the verdicts' and report's frames and the summary import, after the replay: pandas (0.27 s of imports on
# this project's 2-core EPYC, `python -X importtime`; 2.5 of a first GPU run's 30.7, session 39)
AFTER_REPLAY = ("pandas",)


def import_ahead(modules: tuple[str, ...] = AFTER_REPLAY) -> threading.Thread:
    """Import `modules` in a thread of their own while the replay runs: its threads leave the interpreter lock free
    part of the time (they wait on the GPU, on fsync), and the run's start no longer waits for these imports. A
    module that fails to import here fails again, by name, where it is used."""
    def run() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - raised again where the module is used
                pass

    thread = threading.Thread(target=run, name="import-ahead", daemon=True)
    thread.start()
    return thread


def _replay_models(config: RunConfig, scenarios, calibration_chats, store: RunStore, bar, warn,
                   executor=None) -> None:
    """The in-process models' units, on the executor the run's options choose (`harness.executor.executor_for`)."""
    from harness.executor import executor_for

    executor = executor or executor_for(config, scenarios)
    store.edit_manifest(lambda m: m.setdefault("executor", {}).__setitem__("strategy", executor.strategy))
    executor.run(RunWork(config, tuple(scenarios), tuple(calibration_chats)), store, bar, warn)


async def _judge(config: RunConfig, scenarios, store: RunStore) -> None:
    """Rule and reference-agreement judges on every reply; the LLM judge too when --judge is given."""
    from harness.judges import JudgeConfig, LLMJudge, judge_run

    from harness.replay.endpoint import request_policy
    from harness.replay.live import api_key_env_for, judge_model

    key = api_key_env_for("judge", config.api_key_envs, config.api_key_env)
    cache_dir = store.directory / "http-cache"
    llm = LLMJudge(config.judge_url, model=await judge_model(config.judge_url, config.judge_model, key, cache_dir,
                                                             config.request_timeout_s),
                   api_key_env=key, cache_dir=cache_dir, seed=config.seed,
                   policy=request_policy(config.request_timeout_s)) if config.judge_url else None
    if llm is not None:
        store.update_manifest(judge=llm.describe())
    try:
        await judge_run(store, scenarios, llm, JudgeConfig(selection=config.judge_selection,
                                                            history_mode=config.history_mode))
    finally:
        if llm is not None:
            await llm.aclose()


def calibration_chats_from(scenarios: list[Scenario]) -> list[list[Message]]:
    """Each scenario's whole conversation as far as its text is fixed: system prompt and user turns, with
    fixed assistant replies where given (calibration needs activations, not answers)."""
    chats = []
    for scenario in scenarios:
        chat = [Message("system", scenario.system)] if scenario.system else []
        for turn in scenario.turns:
            chat.append(Message("user", turn.user))
            if turn.assistant is not None:
                chat.append(Message("assistant", turn.assistant))
        chats.append(chat)
    return chats


def _expected_units(config: RunConfig, scenarios: list[Scenario]) -> list[tuple[str, str, str]]:
    if config.endpoints:
        models, paths = [ENDPOINT_MODEL], [label for label, _ in candidate_labels(config.candidate_urls)]
    else:
        models, paths = [model_label(d) for d in config.models], [p.name for p in config.paths]
    units = expected_units(models, [s.id for s in scenarios], paths)
    return units if config.reference_url or not config.endpoints else [u for u in units if u[2] != "reference"]


def _finish(store: RunStore, status: str, **fields) -> None:
    records = store.read("records")
    floors = {}
    for model in sorted({r["model"] for r in records}):
        floors[model] = noise_floor(r for r in records if r["model"] == model and r["path"] == "bf16")
    store.update_manifest(status=status, noise_floor=floors, **fields,
                          finished_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))


def write_report(run_dir: Path, figure_worker=None) -> Path | str:
    """Render the run's HTML report (its figures in `figure_worker` where given: `harness.runs.figure_worker`); a
    rendering failure is reported, and the stored run stays intact."""
    from harness.runs.report import render_run_report

    try:
        return render_run_report(run_dir, figure_worker=figure_worker)
    except Exception as error:  # noqa: BLE001 - the run is already stored; say what failed
        return f"not written ({type(error).__name__}: {error}); re-render with: harness report {run_dir}"
