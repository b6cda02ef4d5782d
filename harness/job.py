"""`harness run` as a function: load models and scenarios, replay every path, store, summarise."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import platform
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.backends.base import Message
from harness.kv_paths import KVPath, parse_paths
from harness.metrics import noise_floor
from harness.runner import REFERENCE, Replay
from harness.scenarios import Scenario, load_scenarios
from harness.store import RunStore, RunStoreError

REPO_ROOT = Path(__file__).resolve().parent.parent
CANARY_WEIGHTS = Path(__file__).resolve().parent / "canary" / "weights"
CANARY_ARCHS = ("gqa", "mla", "hybrid")
DEFAULT_SCENARIOS = REPO_ROOT / "scenarios" / "canary"
DEFAULT_PATHS = "bf16,fp8_e4m3,fp8_e4m3:per_head:calibrated,fp8_e5m2,fp8_e4m3:warmup"
RANDOM_MODEL_CACHE = Path.home() / ".cache" / "fp8-harness" / "random-models"


@dataclass(frozen=True, slots=True)
class RunConfig:
    models: tuple[Path, ...]
    scenario_paths: tuple[Path, ...]
    paths: tuple[KVPath, ...]
    out: Path
    device: str = "cpu"
    history_mode: str = "reference-history"
    resume: bool = False
    seed: int = 0
    command: str = ""
    calibration_paths: tuple[Path, ...] = ()


def default_models() -> tuple[tuple[Path, ...], str | None]:
    """The bundled canaries; until they exist, tiny random-weight models, with a warning to show."""
    canaries = tuple(CANARY_WEIGHTS / arch for arch in CANARY_ARCHS if (CANARY_WEIGHTS / arch / "config.json").exists())
    if canaries:
        return canaries, None
    from harness.tiny_models import build_tiny_model

    built = []
    for arch in CANARY_ARCHS:
        target = RANDOM_MODEL_CACHE / arch
        if not (target / "config.json").exists():
            build_tiny_model(arch, target)
        built.append(target)
    return tuple(built), ("NO TRAINED CANARIES FOUND: running tiny RANDOM-WEIGHT models. Their answers are noise; "
                          "only the divergence numbers mean anything.")


def default_scenarios() -> tuple[Path, ...]:
    files = tuple(sorted(DEFAULT_SCENARIOS.glob("*.yaml")))
    return files or (REPO_ROOT / "scenarios" / "general",)


def parse_kv_paths(spec: str) -> tuple[KVPath, ...]:
    """The requested paths, with `bf16` added first if missing: it measures the noise floor."""
    paths = parse_paths(spec)
    if not any(p.canonical == "bf16" for p in paths):
        paths = parse_paths("bf16") + paths
    return tuple(paths)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA device (torch {torch.__version__})")
    return device


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _versions() -> dict:
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "harness": "0.1.0", "triton": None}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    return versions


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def model_label(directory: Path) -> str:
    return directory.name


def new_run_dir() -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{uuid.uuid4().hex[:6]}"


def _manifest(config: RunConfig, scenarios: list[Scenario]) -> dict:
    files = sorted({s.source for s in scenarios})
    device = config.device if config.device == "cpu" else f"{config.device} ({torch.cuda.get_device_name()})"
    return {
        "run_id": config.out.name, "status": "running", "command": config.command,
        "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "finished_at": None,
        "commit": _git_commit(), "versions": _versions(), "device": device, "cpu": platform.processor() or platform.machine(),
        "history_mode": config.history_mode, "seed": config.seed,
        "models": [], "scenario_files": [{"file": f, "sha256": _file_sha256(Path(f))} for f in files],
        "scenarios": [{"id": s.id, "kind": s.kind, "hash": s.content_hash, "source": s.source} for s in scenarios],
        "paths": [{"name": p.name, "canonical": p.canonical, "description": p.describe()} for p in config.paths],
        "calibration_files": [str(p) for p in config.calibration_paths] or "built-in (harness/calibration.py)",
        "scales": {}, "noise_floor": {}, "warnings": [],
    }


def _check_resumable(store: RunStore, config: RunConfig, scenarios: list[Scenario]) -> None:
    manifest = store.read_manifest()
    old = {(s["id"], s["hash"]) for s in manifest.get("scenarios", [])}
    new = {(s.id, s.content_hash) for s in scenarios}
    if old != new:
        raise RunStoreError(f"cannot resume {config.out}: its scenarios differ from the ones given "
                            f"({len(old ^ new)} differ); start a new run instead")
    if [p["name"] for p in manifest.get("paths", [])] != [p.name for p in config.paths]:
        raise RunStoreError(f"cannot resume {config.out}: it ran paths "
                            f"{[p['name'] for p in manifest['paths']]}, not {[p.name for p in config.paths]}")


def run_job(config: RunConfig, progress=None, warn=print) -> Path:
    """Run everything in `config`; returns the run directory. Safe to interrupt and `resume`."""
    from harness.backends.inprocess import InProcessModel

    scenarios = load_scenarios(list(config.scenario_paths))  # validates everything before any model loads
    calibration_chats = calibration_chats_from(load_scenarios(list(config.calibration_paths))) \
        if config.calibration_paths else []
    if config.resume:
        store = RunStore.resume(config.out)
        _check_resumable(store, config, scenarios)
        store.update_manifest(status="running")
    else:
        store = RunStore.create(config.out, _manifest(config, scenarios))
    torch.manual_seed(config.seed)
    total = len(config.models) * len(scenarios) * (1 + len(config.paths))
    bar = progress(total) if progress else None
    try:
        for directory in config.models:
            loaded = InProcessModel.load(directory, device=config.device)
            loaded.calibration_chats = calibration_chats
            label = model_label(directory)
            _note_model(store, label, loaded, warn)
            backends = [loaded.backend(path) for path in config.paths]
            _note_scales(store, label, backends)
            replay = Replay(label, loaded.backend(None), backends, store, config.history_mode,
                            on_unit_done=(bar.update if bar else None))
            asyncio.run(replay.run(scenarios))
        _finish(store, "complete" if not store.read("errors") else "complete_with_errors")
    except KeyboardInterrupt:
        _finish(store, "interrupted")
        raise
    except BaseException:
        _finish(store, "failed")
        raise
    finally:
        if bar:
            bar.close()
    return config.out


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


def _note_model(store: RunStore, label: str, loaded, warn) -> None:
    manifest = store.read_manifest()
    described = {"label": label, **loaded.describe()}
    manifest["models"] = [m for m in manifest["models"] if m["label"] != label] + [described]
    if loaded.random_weights:
        message = f"model {label} has RANDOM WEIGHTS ({loaded.directory}): its answers are noise"
        if message not in manifest["warnings"]:
            manifest["warnings"].append(message)
            warn(f"warning: {message}")
    store.write_manifest(manifest)


def _note_scales(store: RunStore, label: str, backends) -> None:
    manifest = store.read_manifest()
    manifest["scales"][label] = {b.label: b.describe().get("scales") for b in backends}
    store.write_manifest(manifest)


def _finish(store: RunStore, status: str) -> None:
    records = store.read("records")
    floors = {}
    for model in sorted({r["model"] for r in records}):
        floors[model] = noise_floor(r for r in records if r["model"] == model and r["path"] == "bf16")
    store.update_manifest(status=status, noise_floor=floors,
                          finished_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))


def write_report(run_dir: Path) -> Path | str:
    """Render the run's HTML report; a rendering failure is reported, and the stored run stays intact."""
    from harness.report import render_run_report

    try:
        return render_run_report(run_dir)
    except Exception as error:  # noqa: BLE001 - the run is already stored; say what failed
        return f"not written ({type(error).__name__}: {error}); re-render with: harness report {run_dir}"
