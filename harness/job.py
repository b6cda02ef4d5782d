"""`harness run` as a function: load models and scenarios, replay every path, store, summarise."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import platform
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.analysis.metrics import noise_floor
from harness.kv_paths.spec import KVPath, parse_paths
from harness.replay.runner import Replay
from harness.runs.store import RunStore, RunStoreError
from harness.scenarios.load import Scenario, load_scenarios
from harness.types import Message

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
    # live endpoints instead of in-process models (OpenAI-compatible servers)
    reference_url: str | None = None
    candidate_urls: tuple[str, ...] = ()  # "URL" or "LABEL=URL"
    judge_url: str | None = None  # an LLM judge; the rule and agreement judges always run
    judge_selection: str = "diverged"  # which turns the LLM judge sees: all | diverged
    api_key_env: str | None = None  # name of the environment variable holding the API key
    tokenizer: str | None = None  # local tokenizer for servers without /tokenize
    concurrency: int = 8  # scenarios replayed at once against endpoints
    jobs: int = 1  # in-process models replayed at once, each in its own process (CPU)
    batch_size: int | None = None  # batched in-process replay: None = auto on CUDA, off on CPU
    kernel_check_every: int = 16  # batched replay: decode steps between kernel-vs-fp64 checks

    def __post_init__(self):
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.kernel_check_every < 1:
            raise ValueError(f"--kernel-check-every must be >= 1, got {self.kernel_check_every}")

    @property
    def batched(self) -> bool:
        return self.batch_size is not None or self.device != "cpu"


def default_models() -> tuple[tuple[Path, ...], str | None]:
    """The bundled canaries; until they exist, tiny random-weight models, with a warning to show."""
    canaries = tuple(CANARY_WEIGHTS / arch for arch in CANARY_ARCHS if (CANARY_WEIGHTS / arch / "config.json").exists())
    if canaries:
        return canaries, None
    from harness.canary.tiny_models import build_tiny_model

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
    if not config.reference_url and [p["name"] for p in manifest.get("paths", [])] != [p.name for p in config.paths]:
        raise RunStoreError(f"cannot resume {config.out}: it ran paths "
                            f"{[p['name'] for p in manifest['paths']]}, not {[p.name for p in config.paths]}")


def candidate_labels(urls: tuple[str, ...]) -> list[tuple[str, str]]:
    """`LABEL=URL` or `URL` -> (label, url); unnamed candidates are `candidate`, `candidate-2`, ..."""
    pairs = []
    for i, item in enumerate(urls, start=1):
        label, sep, url = item.partition("=")
        if not sep or "://" in label:
            label, url = ("candidate" if len(urls) == 1 else f"candidate-{i}"), item
        pairs.append((label, url))
    labels = [label for label, _ in pairs]
    if len(set(labels)) != len(labels) or "reference" in labels:
        raise ValueError(f"--candidate labels must be unique and not 'reference', got {labels}")
    return pairs


def run_job(config: RunConfig, progress=None, warn=print) -> Path:
    """Run everything in `config`; returns the run directory. Safe to interrupt and `resume`."""
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
    targets = len(config.candidate_urls) if config.reference_url else len(config.paths)
    total = max(1, len(config.models)) * len(scenarios) * (1 + targets)
    bar = progress(total) if progress else None
    try:
        if config.reference_url:
            asyncio.run(_replay_endpoints(config, scenarios, store, bar))
        else:
            _replay_models(config, scenarios, calibration_chats, store, bar, warn)
        asyncio.run(_judge(config, scenarios, store))
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


def _replay_models(config: RunConfig, scenarios, calibration_chats, store: RunStore, bar, warn) -> None:
    jobs = min(config.jobs, len(config.models))
    if jobs <= 1 or config.device != "cpu":
        for directory in config.models:
            _replay_model(config, directory, scenarios, calibration_chats, store, bar.update if bar else None, warn)
        return
    _replay_models_in_processes(config, scenarios, calibration_chats, store, bar, jobs)


def _replay_model(config: RunConfig, directory: Path, scenarios, calibration_chats, store: RunStore,
                  on_unit_done, warn) -> None:
    from harness.replay.inprocess import InProcessModel

    loaded = InProcessModel.load(directory, device=config.device)
    loaded.calibration_chats = calibration_chats
    label = model_label(directory)
    _note_model(store, label, loaded, warn)
    backends = [loaded.backend(path) for path in config.paths]
    _note_scales(store, label, backends)
    if config.batched:
        _replay_batched(config, label, loaded, backends, scenarios, store, on_unit_done)
        return
    replay = Replay(label, loaded.backend(None), backends, store, config.history_mode, on_unit_done=on_unit_done)
    asyncio.run(replay.run(scenarios))


def _replay_batched(config: RunConfig, label: str, loaded, backends, scenarios, store: RunStore, on_unit_done) -> None:
    from harness.replay.batched import BatchSettings
    from harness.replay.batched_runner import BatchedReplay

    settings = BatchSettings(config.batch_size, config.kernel_check_every)
    replay = BatchedReplay(label, loaded.backend(None), backends, store, config.history_mode, settings, on_unit_done)
    batching = replay.run(scenarios)

    def edit(manifest: dict) -> None:
        manifest.setdefault("batching", {})[label] = batching
        for fallback in batching["one_at_a_time_fallbacks"]:
            manifest["warnings"].append(f"model {label}: batched replay failed, ran one at a time: {fallback}")

    store.edit_manifest(edit)


def _replay_models_in_processes(config: RunConfig, scenarios, calibration_chats, store: RunStore, bar,
                                jobs: int) -> None:
    """One worker process per model (at most `jobs` at once): CPU decoding of small models is bound by
    per-op overhead on one core, so models in parallel use the machine's cores; all write one run."""
    import concurrent.futures as futures
    import multiprocessing

    done_before = len(store.read("done"))
    with futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                     initializer=_worker_init) as pool:
        pending = {pool.submit(_model_worker, config, directory, scenarios, calibration_chats)
                   for directory in config.models}
        try:
            while pending:
                finished, pending = futures.wait(pending, timeout=0.5, return_when=futures.FIRST_EXCEPTION)
                finished_units = len(store.read("done")) - done_before
                if bar and finished_units != bar.n:
                    bar.update(finished_units - bar.n)
                for future in finished:
                    future.result()  # a worker's exception stops the run here, its finished units kept
        except BaseException:  # Ctrl-C, SIGTERM or a worker's error: stop the other workers now
            for process in list(pool._processes.values()):  # noqa: SLF001 - the executor has no public kill
                process.terminate()
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def _worker_init() -> None:
    """Model workers: one intra-op thread each, and they die with the parent (a killed run leaves no
    orphan still writing into it)."""
    import ctypes
    import signal

    torch.set_num_threads(1)
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _model_worker(config: RunConfig, directory: Path, scenarios, calibration_chats) -> None:
    store = RunStore.attach(config.out)
    _replay_model(config, directory, scenarios, calibration_chats, store, None,
                  lambda message: print(message, file=sys.stderr))


ENDPOINT_MODEL = "endpoint"  # the model label of runs against live servers


async def _replay_endpoints(config: RunConfig, scenarios, store: RunStore, bar) -> None:
    from harness.replay.endpoint import open_endpoint

    common = dict(api_key_env=config.api_key_env, tokenizer=config.tokenizer, seed=config.seed,
                  cache_dir=store.directory / "http-cache")  # per run: --resume reuses it, a new run does not
    reference = open_endpoint(config.reference_url, label="reference", **common)
    candidates = [open_endpoint(url, label=label, **common) for label, url in candidate_labels(config.candidate_urls)]
    manifest = store.read_manifest()
    described = reference.describe()
    manifest["models"] = [{"label": ENDPOINT_MODEL, "path": config.reference_url, "sha256": None,
                           "arch": described.get("model") or "endpoint", "random_weights": False,
                           "reference": described}]
    manifest["paths"] = [{"name": b.label, "canonical": b.label, "description": b.describe()} for b in candidates]
    store.write_manifest(manifest)
    try:
        replay = Replay(ENDPOINT_MODEL, reference, candidates, store, config.history_mode,
                        on_unit_done=(bar.update if bar else None))
        await replay.run(scenarios, concurrency=config.concurrency)
    finally:
        for backend in [reference, *candidates]:
            await backend.aclose()


async def _judge(config: RunConfig, scenarios, store: RunStore) -> None:
    """Rule and reference-agreement judges on every reply; the LLM judge too when --judge is given."""
    from harness.judges import JudgeConfig, LLMJudge, judge_run

    llm = LLMJudge(config.judge_url, api_key_env=config.api_key_env, cache_dir=store.directory / "http-cache",
                   seed=config.seed) if config.judge_url else None
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


def _note_model(store: RunStore, label: str, loaded, warn) -> None:
    described = {"label": label, **loaded.describe()}
    message = f"model {label} has RANDOM WEIGHTS ({loaded.directory}): its answers are noise"

    def edit(manifest: dict) -> None:
        manifest["models"] = [m for m in manifest["models"] if m["label"] != label] + [described]
        if loaded.random_weights and message not in manifest["warnings"]:
            manifest["warnings"].append(message)

    store.edit_manifest(edit)
    if loaded.random_weights:
        warn(f"warning: {message}")


def _note_scales(store: RunStore, label: str, backends) -> None:
    store.edit_manifest(lambda m: m["scales"].__setitem__(label, {b.label: b.describe().get("scales")
                                                                  for b in backends}))


def _finish(store: RunStore, status: str) -> None:
    records = store.read("records")
    floors = {}
    for model in sorted({r["model"] for r in records}):
        floors[model] = noise_floor(r for r in records if r["model"] == model and r["path"] == "bf16")
    store.update_manifest(status=status, noise_floor=floors,
                          finished_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))


def write_report(run_dir: Path) -> Path | str:
    """Render the run's HTML report; a rendering failure is reported, and the stored run stays intact."""
    from harness.runs.report import render_run_report

    try:
        return render_run_report(run_dir)
    except Exception as error:  # noqa: BLE001 - the run is already stored; say what failed
        return f"not written ({type(error).__name__}: {error}); re-render with: harness report {run_dir}"
