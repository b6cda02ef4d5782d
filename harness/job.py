"""`harness run` as a function: load models and scenarios, replay every path, store, summarise."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import platform
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import harness
from harness.analysis.metrics import noise_floor
from harness.kv_paths.spec import DEFAULT_PATHS, KVPath, parse_paths  # noqa: F401 - DEFAULT_PATHS: the CLI's
from harness.replay.runner import REFERENCE, Replay
from harness.run_inputs import InputError, candidate_labels, check_run_inputs, scenario_budget_problems
from harness.runs.gate import write_verdicts
from harness.runs.status import expected_units, final_status, unfinished_units
from harness.runs.store import RunStore, RunStoreError, hold_run_lock
from harness.scenarios.load import Scenario
from harness.scenarios.select import select_scenarios
from harness.scenarios.sources import load_scenarios
from harness.types import Message, Scores

REPO_ROOT = Path(__file__).resolve().parent.parent
CANARY_WEIGHTS = Path(__file__).resolve().parent / "canary" / "weights"
CANARY_ARCHS = ("gqa", "mla", "hybrid")
DEFAULT_SCENARIOS = REPO_ROOT / "scenarios" / "canary"
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
    reference_model: str | None = None  # served model names; None: the one /v1/models lists
    candidate_models: tuple[str, ...] = ()  # "NAME" (every candidate) or "LABEL=NAME"
    judge_model: str | None = None
    api_key_envs: tuple[tuple[str, str], ...] = ()  # (reference|candidate|judge, VAR): overrides api_key_env
    jobs: int = 1  # worker processes of a CPU in-process replay (1: everything in this process)
    # ((model dir, (path name, ...)), ...): models that run only some of `paths` (the zoo); others run all
    paths_by_model: tuple[tuple[str, tuple[str, ...]], ...] = ()
    thresholds: tuple[str, ...] = ()  # verdict overrides, "METRIC:LIMIT" (harness.analysis.verdicts)
    yardstick: str | None = None  # accepted path the verdicts divide by (None: the default, docs/VERDICTS.md)
    scenario_ids: tuple[str, ...] = ()  # replay only these scenarios of the files (empty: all); the pytest plugin
    select: tuple[str, ...] = ()  # --select terms (tag:X, kind:X, id:GLOB); empty: every scenario loaded
    attention: object | None = None  # harness.replay.attention.AttentionOptions: capture attention error
    scales_file: Path | None = None  # k_scale/v_scale file for ':checkpoint' paths (else the model directory)
    batch_size: int | None = None  # batched in-process replay: None = auto on CUDA, off on CPU
    kernel_check_every: int = 16  # batched replay: decode steps between kernel-vs-fp64 checks
    decode: str = "auto"  # batched replay's decode mode (harness.replay.batched.DECODE_MODES)
    request_timeout_s: float = 120.0  # endpoints: one HTTP attempt, connect to last byte (--request-timeout)
    # "layers": each model's decoder layers split over the GPUs of `device`; "tensor": a process per GPU, each
    # holding its slice of every layer (tensor parallel; `device` may be cpu,cpu,... for gloo ranks) (--shard)
    shard: str | None = None
    # each candidate server's decode against its own prefill of the same tokens (--self-consistency); with no
    # reference_url the run is that check alone (harness/replay/self_consistency.py)
    self_consistency: bool = False

    def __post_init__(self):
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if not self.request_timeout_s > 0:  # NaN too
            raise ValueError(f"--request-timeout must be a positive number of seconds, got {self.request_timeout_s}")
        if self.kernel_check_every < 1:
            raise ValueError(f"--kernel-check-every must be >= 1, got {self.kernel_check_every}")
        if self.decode == "graph" and not str(self.device).startswith("cuda"):
            raise ValueError(f"--decode graph replays CUDA graphs: it needs a CUDA device, not {self.device!r}")
        if self.shard != "tensor" and re.fullmatch(r"cpu(,cpu)+", str(self.device)):
            raise ValueError(f"--device {self.device}: several CPU ranks are for --shard tensor (gloo) only")
        if self.shard is not None:
            self._check_shard()
        if self.self_consistency and not self.candidate_urls:
            raise ValueError("--self-consistency checks live servers against themselves: name them with "
                             "--candidate [LABEL=]URL (an in-process path has no server to ask)")
        if self.candidate_urls and not self.reference_url and not self.self_consistency:
            raise ValueError("--candidate needs --reference (a reference server), or --self-consistency to check "
                             "each candidate against itself with no reference")

    def _check_shard(self) -> None:
        from harness.replay.sharding import check_shard

        check_shard(self.shard, self.shard_devices)
        if self.reference_url:
            raise ValueError("--shard splits an in-process model over GPUs; an endpoint run has none (the server "
                             "shards its model itself, e.g. vllm serve --tensor-parallel-size)")
        if self.batch_size is not None or self.decode not in ("auto", "dynamic"):
            raise ValueError(f"--shard {self.shard}: a sharded model replays one sequence at a time; "
                             f"leave out --batch-size and --decode")
        if self.attention is not None:
            raise ValueError(f"--shard {self.shard}: attention capture (--attention) is not built for a "
                             f"sharded model; run it on a model that fits one GPU")
        if any(p.is_reference_noise for p in self.paths):
            raise ValueError(f"--shard {self.shard}: the fp32 path replays a float32 copy of the whole model (twice "
                             f"its bf16 weights again on the same GPUs); it is not built for a sharded model: "
                             f"leave fp32 out of --paths")

    @property
    def shard_devices(self) -> list[str]:
        """The GPUs (or, for --shard tensor, the gloo CPU ranks) a sharded model is split over."""
        if self.shard == "tensor":
            from harness.replay.tensor_parallel import split_world

            return split_world(self.device)
        return run_devices(self.device)

    @property
    def endpoints(self) -> bool:
        """A run against live servers (a reference and candidates, or candidates alone with self-consistency)."""
        return bool(self.reference_url or self.candidate_urls)

    @property
    def batched(self) -> bool:
        return (self.batch_size is not None or self.device != "cpu") and self.shard is None


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
    """`cpu`, `auto`, `cuda`, `cuda:N`, or several GPUs of this host for a data-parallel run: `cuda:0,1,3` or
    `cuda:all` (returned as the list, e.g. `cuda:0,1`); anything else is refused before a model loads."""
    if re.fullmatch(r"cpu(,cpu)+", device):  # gloo CPU ranks of --shard tensor (tests; RunConfig checks the pair)
        return device
    if device not in ("cpu", "auto", "cuda", "cuda:all") and not re.fullmatch(r"cuda:\d+(,\d+)*", device):
        raise ValueError(f"--device {device}: unknown device; expected cpu, cuda, cuda:N, cuda:N,M,..., cuda:all "
                         f"or auto")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA device (torch {torch.__version__})")
    count = torch.cuda.device_count()
    if device == "cuda:all":
        return "cuda" if count == 1 else "cuda:" + ",".join(map(str, range(count)))
    if device.startswith("cuda:"):
        indices = [int(i) for i in device[5:].split(",")]
        if max(indices) >= count:
            raise ValueError(f"--device {device}: torch sees {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
        if len(set(indices)) != len(indices):
            raise ValueError(f"--device {device}: a GPU is named twice")
    return device


def run_devices(device: str) -> list[str]:
    """The devices of a resolved --device: one, or each GPU of a data-parallel run (`cuda:0,1` -> two)."""
    if not re.fullmatch(r"cuda:\d+(,\d+)+", device):
        return [device]
    return [f"cuda:{i}" for i in device[5:].split(",")]


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


def model_label(directory: Path) -> str:
    return directory.name


def new_run_dir() -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{uuid.uuid4().hex[:6]}"


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


def run_job(config: RunConfig, progress=None, warn=print) -> Path:
    """Run everything in `config`; returns the run directory. Safe to interrupt and `resume`.
    Every input is checked before the run directory is touched; one run at a time writes it."""
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
        return _run_locked(config, scenarios, calibration_chats, progress, warn)


def _run_locked(config: RunConfig, scenarios: list[Scenario], calibration_chats, progress, warn) -> Path:
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
    try:
        if config.endpoints:
            asyncio.run(_replay_endpoints(config, scenarios, store, bar))
        else:
            _replay_models(config, scenarios, calibration_chats, store, bar, warn)
        asyncio.run(_judge(config, scenarios, store))
        write_verdicts(store, list(config.thresholds), config.yardstick)
        unfinished = unfinished_units(store, _expected_units(config, scenarios))
        _finish(store, final_status(unfinished), unfinished_units=len(unfinished))
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
    devices = run_devices(config.device)
    if config.shard == "tensor":  # a process per GPU, each replaying every unit on its slice of the model
        _replay_tensor_parallel(config, scenarios, calibration_chats, store, bar)
        return
    if config.shard is not None:  # every model over all the GPUs, in this process, one after another
        for directory in config.models:
            _replay_model(config, directory, scenarios, calibration_chats, store, bar.update if bar else None, warn)
        return
    if len(devices) > 1:
        _replay_data_parallel(config, devices, scenarios, calibration_chats, store, bar)
        return
    # the batched replay is one model's waves: at most one worker per model
    jobs = min(config.jobs, len(config.models)) if config.batched else config.jobs
    if jobs <= 1 or config.device != "cpu":
        for directory in config.models:
            _replay_model(config, directory, scenarios, calibration_chats, store, bar.update if bar else None, warn)
        return
    if config.batched:
        _replay_models_in_processes(config, scenarios, calibration_chats, store, bar, jobs)
        return
    _replay_units_in_processes(config, scenarios, calibration_chats, store, bar)


def _replay_model(config: RunConfig, directory: Path, scenarios, calibration_chats, store: RunStore,
                  on_unit_done, warn) -> None:
    from harness.replay.inprocess import InProcessModel

    if config.device.startswith("cuda:") and config.shard != "tensor":  # a rank set its own GPU (init_rank)
        torch.cuda.set_device(run_devices(config.device)[0])  # a sharded model: its first GPU (each layer: its own)
    loaded = InProcessModel.load(directory, device=config.device, shard=config.shard)
    loaded.calibration_chats = calibration_chats
    loaded.scales_file = config.scales_file
    label = model_label(directory)
    _note_model(store, label, loaded, warn)
    if loaded.shard_plan is not None:
        _note_shards(store, label, loaded.shard_plan, warn)
    if loaded.tensor_parallel:
        _note_tensor_parallel(store, label, loaded, warn)
    paths = _model_paths(config, directory)
    backends = [loaded.backend(path) for path in paths]
    _note_scales(store, label, backends)
    _note_family(store, label, loaded, paths)
    reference, routes = _note_routes(store, config, label, loaded, paths)
    unbatchable = reference.batch_refusal if config.batched else None
    if unbatchable:  # the whole model (its reference too): said, and recorded beside the batch settings
        warn(f"{label}: replayed one sequence at a time: {unbatchable}")
        store.edit_manifest(lambda m: m.setdefault("batching", {}).__setitem__(label, {"off": unbatchable}))
    elif config.batched:
        for path, route in zip(paths, routes):  # only these paths: the rest of the model runs batched
            if route.batch_refusal:
                warn(f"{label}: path {path.name} replayed one sequence at a time: {route.batch_refusal}")
        _replay_batched(config, label, loaded, backends, scenarios, store, on_unit_done)
        return
    reference = loaded.backend(None)
    if config.shard is None:  # the CPU: generations in rows where the routes say so
        reference, replies = _in_rows(config, store, label, loaded, None, scenarios)
        replies = {**_stored_replies(store, label, scenarios), **(replies or {})}
        backends = [_in_rows(config, store, label, loaded, path, scenarios, replies)[0] for path in paths]
    replay = Replay(label, reference, backends, store, config.history_mode, on_unit_done=on_unit_done,
                    attention=config.attention)
    asyncio.run(replay.run(scenarios))


SHARDED_ONE_AT_A_TIME = ("layer-sharded over several GPUs: one sequence at a time (the batched engine keeps its "
                         "per-row state and CUDA graphs on one GPU)")


def _note_shards(store: RunStore, label: str, plan, warn) -> None:
    """`manifest.parallel` of a layer-sharded run (each model's layer blocks per GPU) and why it is not batched."""
    from harness.replay.sharding import layout

    def edit(manifest: dict) -> None:
        parallel = manifest.get("parallel") or layout({})
        parallel["devices"] = list(plan.devices)
        parallel.setdefault("models", {})[label] = plan.describe()
        manifest["parallel"] = parallel
        manifest.setdefault("batching", {})[label] = {"off": SHARDED_ONE_AT_A_TIME}

    store.edit_manifest(edit)
    blocks = ", ".join(f"{d}: layers {span}" for d, span in plan.describe()["layers"].items())
    warn(f"{label}: layer-sharded ({blocks}); {SHARDED_ONE_AT_A_TIME}")


def _replay_tensor_parallel(config: RunConfig, scenarios, calibration_chats, store: RunStore, bar) -> None:
    """One process per rank (`harness.replay.tensor_parallel`), every rank replaying every unit of every model in
    lockstep (the collectives of each forward pass keep them there); rank 0 writes the run directory, the others
    a private copy of it (so their resume state is the same) that is deleted when they finish."""
    import concurrent.futures as futures
    import multiprocessing

    from harness.replay.tensor_parallel import free_port, layout

    devices = config.shard_devices
    store.edit_manifest(lambda manifest: manifest.__setitem__("parallel", layout(devices, {})))
    port = free_port()
    threads = 1 if devices[0] == "cpu" else 0
    with futures.ProcessPoolExecutor(len(devices), mp_context=multiprocessing.get_context("spawn"),
                                     initializer=_worker_init, initargs=(config.out, threads, _format_modules())) as pool:
        _wait_for_workers(pool, {pool.submit(_tensor_parallel_rank, config, rank, port, scenarios, calibration_chats)
                                 for rank in range(len(devices))}, store, bar)


def _tensor_parallel_rank(config: RunConfig, rank: int, port: int, scenarios, calibration_chats) -> None:
    import shutil
    import tempfile

    import torch.distributed as dist

    from harness.replay import tensor_parallel

    devices = config.shard_devices
    tensor_parallel.init_rank(rank, devices, port)
    scratch = None
    try:
        if rank == 0:
            store = RunStore.attach(config.out)
        else:  # the same units, resume state and reads as rank 0; its rows are rank 0's, so they are dropped
            scratch = Path(tempfile.mkdtemp(prefix=f"tp-rank{rank}-"))
            shutil.copytree(config.out, scratch / "run")
            store = RunStore.attach(scratch / "run")
        say = (lambda message: print(message, file=sys.stderr)) if rank == 0 else (lambda message: None)
        for directory in config.models:
            _replay_model(config, directory, scenarios, calibration_chats, store, None, say)
        dist.barrier()
    finally:
        dist.destroy_process_group()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _note_tensor_parallel(store: RunStore, label: str, loaded, warn) -> None:
    from harness.replay.tensor_parallel import describe_model, world

    rank, size = world()
    described = describe_model(loaded.model, size)

    def edit(manifest: dict) -> None:
        manifest["parallel"].setdefault("models", {})[label] = described
        manifest.setdefault("batching", {})[label] = {"off": TENSOR_PARALLEL_ONE_AT_A_TIME}

    store.edit_manifest(edit)
    warn(f"{label}: tensor parallel over {size} ranks ({described['kv_heads_per_rank']} KV heads a rank); "
         f"{TENSOR_PARALLEL_ONE_AT_A_TIME}")


TENSOR_PARALLEL_ONE_AT_A_TIME = ("tensor parallel: one sequence at a time (the batched engine's per-row state, "
                                 "static columns and CUDA graphs are not built for a rank's slice of the model)")


def _note_routes(store: RunStore, config: RunConfig, label: str, loaded, paths: list[KVPath]) -> tuple:
    """The reference's route and each path's on this model (`harness.replay.route`), the paths' stored in the
    manifest's `paths[].routes`. A refusal of the reference's (attention capture) keeps the whole model one
    sequence at a time; a path's own refusal keeps only that path so (`BatchedReplay`)."""
    from harness.replay.route import decide

    def route_of(path: KVPath | None, batched: bool):
        return decide(path, loaded.model.config, loaded.device.type, loaded.use_kernels, batched=batched,
                      decode=config.decode, capture=config.attention is not None, rows=config.shard is None)

    reference = route_of(None, config.batched)
    whole_model = reference.batch_refusal if config.batched else None
    routes = [route_of(path, config.batched and whole_model is None) for path in paths]
    described = {path.name: {**route.describe(), "batch_refusal": route.batch_refusal or whole_model}
                 for path, route in zip(paths, routes)}

    def edit(manifest: dict) -> None:
        for entry in manifest["paths"]:
            if entry["name"] in described:
                entry.setdefault("routes", {})[label] = described[entry["name"]]

    store.edit_manifest(edit)
    return reference, routes


def _replay_batched(config: RunConfig, label: str, loaded, backends, scenarios, store: RunStore, on_unit_done) -> None:
    from harness.replay.batched import BatchSettings
    from harness.replay.batched_runner import BatchedReplay

    settings = BatchSettings(config.batch_size, config.kernel_check_every, config.decode)
    replay = BatchedReplay(label, loaded.backend(None), backends, store, config.history_mode, settings, on_unit_done,
                           attention=config.attention)
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

    with futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                     initializer=_worker_init, initargs=(config.out, 1, _format_modules())) as pool:
        _wait_for_workers(pool, {pool.submit(_model_worker, config, directory, scenarios, calibration_chats)
                                 for directory in config.models}, store, bar)


def data_parallel_shards(models: tuple[Path, ...], scenarios: list[Scenario],
                         devices: list[str]) -> list[list[tuple[Path, list[Scenario]]]]:
    """Work for each GPU: (model, its scenarios) pairs. With at least as many models as GPUs each model stays
    whole on one GPU (its batches, and so its records, are those of a one-GPU run); with fewer, a model's
    scenarios are split in contiguous shards over the GPUs left, which changes batch composition (measured by
    the run's batch-invariance floor). Largest first onto the least loaded GPU, by scenario count."""
    per_model = max(1, len(devices) // max(len(models), 1))
    pieces = []
    for model in models:
        shards = min(per_model, len(scenarios)) or 1
        size = -(-len(scenarios) // shards)
        pieces += [(model, scenarios[i:i + size]) for i in range(0, len(scenarios), size)] or [(model, [])]
    load = [0] * len(devices)
    plan: list[list[tuple[Path, list[Scenario]]]] = [[] for _ in devices]
    for model, chunk in sorted(pieces, key=lambda piece: -len(piece[1])):
        gpu = load.index(min(load))
        plan[gpu].append((model, chunk))
        load[gpu] += len(chunk)
    return plan


def _replay_data_parallel(config: RunConfig, devices: list[str], scenarios, calibration_chats, store: RunStore,
                          bar) -> None:
    """One worker process per GPU, each replaying its shards into the one run directory (the store's group
    commit takes rows from several processes); the manifest records the layout."""
    import concurrent.futures as futures
    import multiprocessing

    plan = data_parallel_shards(config.models, scenarios, devices)
    whole = len(config.models) >= len(devices)
    layout = {"kind": "data-parallel", "devices": devices,
              "shards": {device: [{"model": model_label(m), "scenarios": [s.id for s in chunk]} for m, chunk in work]
                         for device, work in zip(devices, plan)},
              "batch_composition": "as on one GPU: every model whole on one GPU" if whole else
              "differs from one GPU: a model's scenarios are split over GPUs (see noise_floor)"}
    store.edit_manifest(lambda manifest: manifest.__setitem__("parallel", layout))
    with futures.ProcessPoolExecutor(len(devices), mp_context=multiprocessing.get_context("spawn"),
                                     initializer=_worker_init, initargs=(config.out, 0, _format_modules())) as pool:
        _wait_for_workers(pool, {pool.submit(_gpu_worker, replace(config, device=device), work, calibration_chats)
                                 for device, work in zip(devices, plan) if work}, store, bar)


def _gpu_worker(config: RunConfig, work: list[tuple[Path, list[Scenario]]], calibration_chats) -> None:
    store = RunStore.attach(config.out)
    for directory, chunk in work:
        _replay_model(config, directory, chunk, calibration_chats, store, None,
                      lambda message: print(message, file=sys.stderr))


def _wait_for_workers(pool, pending: set, store: RunStore, bar) -> None:
    """Progress from the store's done lines until every worker returns; a worker's error, Ctrl-C or SIGTERM
    stops the others at once (their finished units are kept for --resume)."""
    import concurrent.futures as futures

    done_before = len(store.read("done"))
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


def _format_modules() -> tuple[str, ...]:
    from harness.kv_paths import formats

    return formats.extension_modules()


def _worker_init(run_dir: Path | None = None, threads: int = 1, format_modules: tuple[str, ...] | None = None) -> None:
    """Model workers: one intra-op thread each on the CPU (GPU workers keep torch's default: 0), and they die
    with the parent (a killed run leaves no orphan still writing into it). Library noise goes to the run's
    library.log, as in the parent. KV formats registered by other modules in the parent are registered here too."""
    import ctypes
    import signal

    from harness.kv_paths import formats

    formats.load_extensions(format_modules if format_modules is not None else ())

    if run_dir is not None:
        from harness.runs.library_log import quiet_libraries

        quiet_libraries(run_dir)

    if threads:
        torch.set_num_threads(threads)
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _model_worker(config: RunConfig, directory: Path, scenarios, calibration_chats) -> None:
    store = RunStore.attach(config.out)
    _replay_model(config, directory, scenarios, calibration_chats, store, None,
                  lambda message: print(message, file=sys.stderr))


def _model_paths(config: RunConfig, directory: Path) -> list[KVPath]:
    wanted = dict(config.paths_by_model).get(str(directory))
    return [path for path in config.paths if wanted is None or path.name in wanted]


def _replay_units_in_processes(config: RunConfig, scenarios, calibration_chats, store: RunStore, bar) -> None:
    """One-at-a-time CPU replay as tasks of one model's reference, then one task per (model, path) once that
    model's reference is stored, on `config.jobs` worker processes. A task per model left cores idle while the
    last model ran alone (3 canaries on 2 cores: 167 s of CPU in a 168 s run); every task computes what the
    model's own worker computed for that backend (same code, one intra-op thread), so the stored rows are the
    same. The reference task also scores the reference's turns (teacher-forced log-probs, which every path
    compares against) and hands them to its model's path tasks, as one process scored them once for all paths."""
    import concurrent.futures as futures
    import multiprocessing

    jobs = min(config.jobs, sum(1 + len(_model_paths(config, d)) for d in config.models))
    done_before = len(store.read("done"))
    # tasks wait here, not in the pool's queue, so a free worker takes the longest one ready: a path task costs about
    # what its model's reference task took (the same turns through one backend), and the heaviest model's paths
    # last would leave one core idle at the end; references (cost not yet known) go first, in the run's order
    ready = [(float("inf"), Path(directory), None, None) for directory in config.models]
    with futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                     initializer=_worker_init, initargs=(config.out, 1, _format_modules())) as pool:
        pending: dict = {}  # future -> (model directory, path name or None for its reference, start time)
        try:
            while pending or ready:
                while ready and len(pending) < jobs:
                    _, directory, path_name, scores = ready.pop(0)
                    future = pool.submit(_unit_worker, config, directory, path_name, scenarios, calibration_chats,
                                         scores)
                    pending[future] = (directory, path_name, time.monotonic())
                finished, _ = futures.wait(pending, timeout=0.5, return_when=futures.FIRST_COMPLETED)
                finished_units = len(store.read("done")) - done_before
                if bar and finished_units != bar.n:
                    bar.update(finished_units - bar.n)
                for future in finished:
                    reference_scores = future.result()  # a worker's exception stops the run, finished units kept
                    directory, path_name, started = pending.pop(future)
                    if path_name is None:  # a reference task: its model's paths may start
                        took = time.monotonic() - started
                        ready += [(took, directory, path.name, reference_scores)
                                  for path in _model_paths(config, directory)]
                        ready.sort(key=lambda task: -task[0])
            if bar:
                bar.update(len(store.read("done")) - done_before - bar.n)
            store.edit_manifest(lambda m: _in_config_order(m, config))
        except BaseException:  # Ctrl-C, SIGTERM or a worker's error: stop the other workers now
            for process in list(pool._processes.values()):  # noqa: SLF001 - the executor has no public kill
                process.terminate()
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def _in_config_order(manifest: dict, config: RunConfig) -> None:
    """Models and each model's scales in the order the run names them (tasks note them as they finish)."""
    labels = [model_label(d) for d in config.models]
    manifest["models"].sort(key=lambda m: labels.index(m["label"]) if m["label"] in labels else len(labels))
    names = [p.name for p in config.paths]
    for label, scales in manifest["scales"].items():
        manifest["scales"][label] = dict(sorted(scales.items(), key=lambda kv: names.index(kv[0])
                                                if kv[0] in names else len(names)))


_WORKER_MODELS: dict = {}  # a unit worker's loaded models, by directory (each is loaded once per process)


def _unit_worker(config: RunConfig, directory: Path, path_name: str | None, scenarios, calibration_chats,
                 reference_scores: dict | None = None) -> dict | None:
    """One task of `_replay_units_in_processes`: the model's reference (path_name None; returns its teacher-forced
    scores), or one path of it on the stored reference and those scores (scenarios whose reference failed stay
    unfinished, as `Replay` leaves them)."""
    from harness.replay.batched_runner import PrecomputedBackend
    from harness.replay.inprocess import InProcessModel

    store = RunStore.attach(config.out)
    label = model_label(directory)
    loaded = _WORKER_MODELS.get(str(directory))
    if loaded is None:
        loaded = _WORKER_MODELS[str(directory)] = InProcessModel.load(directory, device=config.device)
        loaded.calibration_chats, loaded.scales_file = calibration_chats, config.scales_file
    if path_name is None:
        _note_model(store, label, loaded, lambda message: print(message, file=sys.stderr))
        _note_family(store, label, loaded, _model_paths(config, directory))
        reference, _ = _in_rows(config, store, label, loaded, None, scenarios)
        asyncio.run(Replay(label, reference, [], store, config.history_mode).run(scenarios))
        # scored by the backend that generated: each turn's prefill, kept for scoring its prompt, is reused
        inner = getattr(reference, "inner", reference)
        return _as_arrays(_reference_scores(RunStore.attach(config.out), label, inner, scenarios))
    path = next(p for p in config.paths if p.name == path_name)
    _note_routes(store, config, label, loaded, [path])
    ready = [s for s in scenarios if store.is_done(label, s.id, REFERENCE)]
    backend, _ = _in_rows(config, store, label, loaded, path, ready, _stored_replies(store, label, ready))
    store.edit_manifest(lambda m: m["scales"].setdefault(label, {}).__setitem__(backend.label,
                                                                               backend.describe().get("scales")))
    reference = PrecomputedBackend(loaded.backend(None), REFERENCE)
    reference.scores = _as_scores(reference_scores or {})
    asyncio.run(Replay(label, reference, [backend], store, config.history_mode,
                       attention=config.attention).run(ready))
    return None


def _in_rows(config: RunConfig, store: RunStore, label: str, loaded, path: KVPath | None, scenarios,
             reference_replies: dict | None = None) -> tuple:
    """(backend, its replies or None): `loaded`'s backend of `path` (None: the reference) for a replay that is not
    batched. Where the route says rows (`route.ROWS`: the CPU), the turns of `scenarios` not yet stored are generated
    first in rows (`batched_runner.rows_replies`: one sequence's bits, decode steps batched) and `Replay` reads them
    from the returned `PrecomputedBackend`; reference_replies: the reference's, for a path on the reference's history.
    If the rows engine fails, the run names why and `Replay` generates what is missing one sequence at a time."""
    from harness.replay.batched_runner import PrecomputedBackend, rows_replies
    from harness.replay.route import ROWS, decide

    inner = loaded.backend(path)
    route = decide(path, loaded.model.config, loaded.device.type, loaded.use_kernels, decode=config.decode,
                   capture=config.attention is not None, rows=config.shard is None)
    history = None if path is None or config.history_mode == "own-history" else reference_replies
    if route.decode != ROWS or (path is not None and config.history_mode != "own-history" and history is None):
        return inner, None
    backend = PrecomputedBackend(inner, inner.label)
    name = REFERENCE if path is None else inner.label
    todo = [s for s in scenarios if not store.is_done(label, s.id, name) and (history is None or s.id in history)]
    try:
        return backend, rows_replies(backend, todo, history)
    except Exception as error:  # noqa: BLE001 - named in the run; what was generated stays, Replay makes the rest
        why = f"model {label}: {name} replayed one sequence at a time, rows failed: {type(error).__name__}: {error}"
        store.edit_manifest(lambda m: m["warnings"].append(why[:300]))
        return backend, None


def _stored_replies(store: RunStore, label: str, scenarios) -> dict:
    """{scenario id: [TurnReply]} of the reference's stored turns."""
    from harness.replay.runner import TurnReply

    texts = [r for r in store.read("texts") if r["model"] == label and r["path"] == REFERENCE]
    replies = {s.id: [] for s in scenarios}
    for r in sorted(texts, key=lambda r: r["turn"]):
        if r["scenario"] in replies:
            replies[r["scenario"]].append(TurnReply(r["turn"], r["user"], r["token_ids"], r["text"],
                                                    r.get("fixed", False)))
    return replies


def _as_arrays(scores: dict) -> dict:
    """Scores as numpy arrays for the trip between processes: a torch tensor crosses a process pool through shared
    memory and a file descriptor handed over by `multiprocessing.resource_sharer`, whose thread printed a traceback
    when the run was interrupted mid-handover (a flaky Ctrl-C test); an array is pickled by value, same bits."""
    return {key: (None if s.logprobs is None else s.logprobs.numpy(), s.top_logprobs, s.unavailable)
            for key, s in scores.items()}


def _as_scores(arrays: dict) -> dict:
    return {key: Scores(None if logprobs is None else torch.from_numpy(logprobs), top, unavailable)
            for key, (logprobs, top, unavailable) in arrays.items()}


# Reference log-probs a reference task hands its path tasks (float32 [T, V] per turn): a memory bound, not a tuning
# knob (the canaries' whole default run holds ~1 MB; past the bound a path task scores the rest itself, as before)
SHARED_SCORE_BYTES = 1 << 30


def _reference_scores(store: RunStore, label: str, reference, scenarios) -> dict:
    """{(prompt ids, reply ids): Scores} of every generated reference turn, keyed as `PrecomputedBackend` asks:
    what `Replay` computes once per turn for all of a model's paths (`reference.score_sync`, same inputs)."""
    from harness.replay.runner import _messages

    done = [s for s in scenarios if store.is_done(label, s.id, REFERENCE)]
    stored = _stored_replies(store, label, done)
    scores, held = {}, 0
    for scenario in done:
        replies = stored[scenario.id]
        for turn, reply in enumerate(replies):
            if reply.fixed or held >= SHARED_SCORE_BYTES:
                continue
            messages = _messages(scenario, replies, turn)
            scored = reference.score_sync(messages, reply.token_ids)
            scores[(tuple(reference.owner.encode_chat(messages)), tuple(reply.token_ids))] = scored
            held += scored.logprobs.numel() * 4
    return scores


ENDPOINT_MODEL = "endpoint"  # the model label of runs against live servers
# What the client knows of an endpoint's route: the server decides kernels and batching, and does not say
ENDPOINT_ROUTE = {"decode_kernel": "the server's (not observable from the client)", "batched": None,
                  "batch_refusal": None, "batch_floor": None, "decode": "the server's", "capture": None}


async def _replay_endpoints(config: RunConfig, scenarios, store: RunStore, bar) -> None:
    from harness.replay import live

    reference, candidates = _open_endpoints(config, store.directory / "http-cache")
    servers = [b for b in (reference, *candidates) if b is not None]
    _carry_failed_attempts(store.read_manifest(), reference, candidates)
    try:
        await live.preflight(servers)  # capabilities are known before the manifest is written
        _note_endpoints(store, config, reference, candidates, live.degraded(servers))
        await _endpoint_replay(config, reference, candidates, store, bar).run(scenarios,
                                                                             concurrency=config.concurrency)
        _note_endpoints(store, config, reference, candidates, live.degraded(servers))
    finally:
        for backend in servers:
            await backend.aclose()


def _endpoint_replay(config: RunConfig, reference, candidates, store: RunStore, bar) -> Replay:
    """Reference and candidates (each candidate turn also against itself with --self-consistency), or with no
    reference the candidates' self-consistency alone."""
    done = bar.update if bar else None
    if reference is None:
        from harness.replay.runner import SelfConsistencyReplay

        return SelfConsistencyReplay(ENDPOINT_MODEL, candidates, store, on_unit_done=done)
    return Replay(ENDPOINT_MODEL, reference, candidates, store, config.history_mode, on_unit_done=done,
                  self_consistency=config.self_consistency)


async def preflight_endpoints(config: RunConfig) -> None:
    """`PreflightError` (exit 2) naming every server, judge included, that cannot serve the run."""
    from harness.replay import live

    reference, candidates = _open_endpoints(config, None)
    servers = [b for b in (reference, *candidates) if b is not None]
    try:
        await live.preflight(servers)
    finally:
        for backend in servers:
            await backend.aclose()
    if config.judge_url:
        key = live.api_key_env_for("judge", config.api_key_envs, config.api_key_env)
        await live.judge_model(config.judge_url, config.judge_model, key, None, config.request_timeout_s)


def _open_endpoints(config: RunConfig, cache_dir: Path | None):
    """The reference (None in a self-consistency-only run) and candidate backends, each with its own model name
    and API key variable."""
    from harness.replay.endpoint import open_endpoint
    from harness.replay.live import api_key_env_for, per_label

    labelled = candidate_labels(config.candidate_urls)
    models = per_label(config.candidate_models, [label for label, _ in labelled], "--candidate-model")
    common = dict(tokenizer=config.tokenizer, seed=config.seed, cache_dir=cache_dir,  # per run: --resume reuses it
                  timeout_s=config.request_timeout_s)
    reference = open_endpoint(config.reference_url, label="reference", model=config.reference_model,
                              api_key_env=api_key_env_for("reference", config.api_key_envs, config.api_key_env),
                              **common) if config.reference_url else None
    key = api_key_env_for("candidate", config.api_key_envs, config.api_key_env)
    candidates = [open_endpoint(url, label=label, model=models.get(label), api_key_env=key, **common)
                  for label, url in labelled]
    return reference, candidates


def endpoint_path_entry(label: str, described: dict) -> dict:
    """A candidate server in `manifest.paths[]`, in the shape of an in-process path: name, canonical, kind, a
    one-line description; what the server was found to do under `endpoint`."""
    served = described.get("model") or "the served model"
    return {"name": label, "canonical": label, "kind": "endpoint",
            "description": f"endpoint {described.get('url')} serving {served} (KV cache as the server keeps it)",
            "endpoint": described}


def _carry_failed_attempts(manifest: dict, reference, candidates) -> None:
    """A --resume's servers start from the failed attempts earlier sessions stored: the count accumulates."""
    stored = {p.get("name"): p.get("endpoint") for p in manifest.get("paths") or [] if isinstance(p, dict)}
    stored["reference"] = next((m.get("reference") for m in manifest.get("models") or []
                                if isinstance(m, dict) and m.get("label") == ENDPOINT_MODEL), None)
    for backend in (b for b in (reference, *candidates) if b is not None):  # no reference: --self-consistency alone
        earlier = stored.get(backend.label)
        count = earlier.get("failed_attempts") if isinstance(earlier, dict) else None
        backend.earlier_failed_attempts = count if isinstance(count, int) and count > 0 else 0


def _note_endpoints(store: RunStore, config: RunConfig, reference, candidates, degraded: list[str]) -> None:
    """The servers as detected (model, capabilities, failed attempts) and what they could not measure."""
    from harness.replay.live import with_earlier_capabilities

    def edit(manifest: dict) -> None:  # a --resume keeps what the earlier session found (issue 28, D6)
        earlier = {p.get("name"): p.get("endpoint") for p in manifest.get("paths") or []}
        earlier["reference"] = next((m.get("reference") for m in manifest.get("models") or []
                                     if m.get("label") == ENDPOINT_MODEL), None)
        described = with_earlier_capabilities(earlier["reference"], reference.describe()) if reference else {}
        manifest["models"] = [{"label": ENDPOINT_MODEL, "path": config.reference_url, "sha256": None,
                               "arch": described.get("model") or "endpoint", "random_weights": False,
                               "reference": described}]
        manifest["paths"] = [{**endpoint_path_entry(b.label, with_earlier_capabilities(earlier.get(b.label),
                                                                                        b.describe())),
                              "routes": {ENDPOINT_MODEL: ENDPOINT_ROUTE}} for b in candidates]
        manifest["warnings"] = [w for w in manifest.get("warnings", []) if w not in degraded] + degraded
        manifest["request_timeout_s"] = config.request_timeout_s

    store.edit_manifest(edit)


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


def _note_family(store: RunStore, label: str, loaded, paths: list[KVPath]) -> None:
    """Per layer: FP8, kept in BF16 (and why) or a linear/SSM state; attention kinds; kernels (replay/families.py)."""
    from harness.replay.families import route_facts

    facts = route_facts(loaded.model.config, paths)
    store.edit_manifest(lambda m: m.setdefault("families", {}).__setitem__(label, facts))


def _note_scales(store: RunStore, label: str, backends) -> None:
    store.edit_manifest(lambda m: m["scales"].__setitem__(label, {b.label: b.describe().get("scales")
                                                                  for b in backends}))


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


def write_report(run_dir: Path) -> Path | str:
    """Render the run's HTML report; a rendering failure is reported, and the stored run stays intact."""
    from harness.runs.report import render_run_report

    try:
        return render_run_report(run_dir)
    except Exception as error:  # noqa: BLE001 - the run is already stored; say what failed
        return f"not written ({type(error).__name__}: {error}); re-render with: harness report {run_dir}"
