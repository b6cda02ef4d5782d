"""The one place a run's configuration is built: defaults, device resolution, the stored command, the run directory.

`harness run`, `harness attention`, `harness nightly`, `harness zoo` and `pytest harness` all build their
`RunConfig` here, so a default (models, scenarios, KV paths), the device check and the credential scrub of the
stored command are the same whichever front door a run came through.
"""

from __future__ import annotations

import datetime as dt
import shlex
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.analysis.verdicts import DEFAULT_YARDSTICK
from harness.kv_paths.spec import DEFAULT_PATHS, KVPath, PathSpecError, parse_paths
from harness.records import scrub_credentials
from harness.replay.devices import CPU_RANKS, device_list, resolve_device
from harness.replay.route import layout_decode_refusal
from harness.runs.gate import with_controls

__all__ = ["RunConfig", "build_run_config", "default_models", "default_scenarios", "new_run_dir", "parse_kv_paths",
           "resolve_device", "single_device", "stored_command"]

REPO_ROOT = Path(__file__).resolve().parent.parent
CANARY_WEIGHTS = Path(__file__).resolve().parent / "canary" / "weights"
CANARY_ARCHS = ("gqa", "mla", "hybrid")
DEFAULT_SCENARIOS = REPO_ROOT / "scenarios" / "canary"
RANDOM_MODEL_CACHE = Path.home() / ".cache" / "fp8-harness" / "random-models"
EXECUTORS = ("auto", "local", "ray")  # --executor (harness/executor)


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
    # where units run (harness/executor): "auto" (in this process, worker processes on the CPU, a process per GPU of a
    # GPU list, or the --shard layout), "local" (the same, said explicitly) or "ray" (actors of a Ray cluster) (--executor)
    executor: str = "auto"
    ray_address: str | None = None  # an existing Ray cluster (--ray-address; None: a local one for this run)
    workers: int | None = None  # GPUs / actors to use (--workers); None: as many as pay off for the run's work
    stall_timeout_s: float | None = None  # a worker storing no unit for this long after its first is stopped

    def __post_init__(self):
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if not self.request_timeout_s > 0:  # NaN too
            raise ValueError(f"--request-timeout must be a positive number of seconds, got {self.request_timeout_s}")
        if self.kernel_check_every < 1:
            raise ValueError(f"--kernel-check-every must be >= 1, got {self.kernel_check_every}")
        if self.decode == "graph" and not str(self.device).startswith("cuda"):
            raise ValueError(f"--decode graph replays CUDA graphs: it needs a CUDA device, not {self.device!r}")
        self._check_executor()
        self._check_torchrun()
        if self.shard != "tensor" and CPU_RANKS.fullmatch(str(self.device)):
            raise ValueError(f"--device {self.device}: several CPU ranks are for --shard tensor (gloo) only")
        if self.shard is not None:
            self._check_shard()
        if self.self_consistency and not self.candidate_urls:
            raise ValueError("--self-consistency checks live servers against themselves: name them with "
                             "--candidate [LABEL=]URL (an in-process path has no server to ask)")
        if self.candidate_urls and not self.reference_url and not self.self_consistency:
            raise ValueError("--candidate needs --reference (a reference server), or --self-consistency to check "
                             "each candidate against itself with no reference")

    def _check_executor(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"--executor {self.executor}: unknown; expected one of {', '.join(EXECUTORS)}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.stall_timeout_s is not None and not self.stall_timeout_s > 0:  # NaN too
            raise ValueError(f"--stall-timeout must be a positive number of seconds, got {self.stall_timeout_s}")
        if self.ray_address is not None and self.executor != "ray":
            raise ValueError(f"--ray-address {self.ray_address}: a Ray cluster is used by --executor ray only")
        if self.executor == "ray" and (self.shard is not None or self.endpoints):
            what = f"--shard {self.shard}" if self.shard else "an endpoint run"
            raise ValueError(f"--executor ray: {what} is not spread over Ray actors; leave out --executor ray")

    def _check_torchrun(self) -> None:
        from harness.replay import tensor_parallel

        if tensor_parallel.torchrun_launch() is not None:
            why = tensor_parallel.torchrun_refusal(str(self.device), self.shard)
            if why:
                raise ValueError(why)

    def _check_shard(self) -> None:
        from harness.replay import sharding

        sharding.check_shard(self.shard, self.shard_devices)
        if self.reference_url:
            raise ValueError("--shard splits an in-process model over GPUs; an endpoint run has none (the server "
                             "shards its model itself, e.g. vllm serve --tensor-parallel-size)")
        if self.decode not in ("auto", "dynamic") and layout_decode_refusal(self.shard) is not None:
            raise ValueError(f"--shard {self.shard} --decode {self.decode}: refused for "
                             f"{layout_decode_refusal(self.shard)}; leave out --decode (a tensor-parallel model's "
                             f"batches decode dynamically)")
        if self.attention is not None:
            raise ValueError(f"--shard {self.shard}: attention capture (--attention) is not built for a "
                             f"sharded model; run it on a model that fits one GPU")
        if any(p.is_reference_noise for p in self.paths):
            raise ValueError(f"--shard {self.shard}: the fp32 path replays a float32 copy of the whole model (twice "
                             f"its bf16 weights again on the same GPUs); it is not built for a sharded model: "
                             f"leave fp32 out of --paths")

    @property
    def shard_devices(self) -> list[str]:
        """The GPUs (or, for --shard tensor, the gloo CPU ranks) a sharded model is split over; under torchrun, one
        device per global rank (`tensor_parallel.torchrun_devices`)."""
        from harness.replay import tensor_parallel

        if self.shard == "tensor" and tensor_parallel.torchrun_launch() is not None:
            return tensor_parallel.torchrun_devices(self.device)
        return device_list(self.device)

    @property
    def endpoints(self) -> bool:
        """A run against live servers (a reference and candidates, or candidates alone with self-consistency)."""
        return bool(self.reference_url or self.candidate_urls)

    @property
    def batched(self) -> bool:
        """Batched in-process replay: asked for (--batch-size), or on GPUs (the CPU, and CPU ranks of --shard
        tensor, replay one sequence at a time unless asked)."""
        return self.batch_size is not None or not (self.device == "cpu" or CPU_RANKS.fullmatch(str(self.device)))


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


def new_run_dir() -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{uuid.uuid4().hex[:6]}"




def stored_command(command: str | Sequence[str]) -> str:
    """The command line as the manifest keeps it: one shell string, API keys and tokens scrubbed."""
    return scrub_credentials(command if isinstance(command, str) else shlex.join(command))


def build_run_config(*, command: str | Sequence[str], out: Path | None = None, device: str = "cpu",
                     models: Sequence[Path] | None = None, scenario_paths: Sequence[Path] | None = None,
                     paths: str | Sequence[KVPath] | None = None, yardstick: str | None = None,
                     warn: Callable[[str], None] | None = None, **fields) -> RunConfig:
    """A checked `RunConfig`. Left out: the bundled canaries (random-weight stand-ins with a warning when none
    are trained), the canary scenarios, the default KV paths (`bf16` always added, and the verdicts' yardstick
    path: `DEFAULT_YARDSTICK` unless `yardstick` names another or "none"), a new `runs/<time>-<id>`.
    An endpoint run (`reference_url`, or `candidate_urls` alone with self-consistency) has no in-process models or paths. Bad values raise ValueError naming
    the flag."""
    if yardstick is not None and not yardstick.strip():
        raise ValueError(f"--yardstick {yardstick!r}: empty; name a KV path spec (default {DEFAULT_YARDSTICK}) "
                         f"or 'none' for no yardstick")
    endpoint = bool(fields.get("reference_url") or fields.get("candidate_urls"))
    if endpoint:
        models, kv_paths = (), ()
    else:
        if models is None:
            models, warning = default_models()
            if warning and warn:
                warn(warning)
        if paths is None or isinstance(paths, str):
            try:
                kv_paths = parse_kv_paths(DEFAULT_PATHS if paths is None else paths)  # "" is refused, not defaulted
            except PathSpecError as error:  # one line naming the flag, then the spec and what is wrong with it
                raise PathSpecError(f"--paths: {error}") from None
        else:
            kv_paths = tuple(paths)
        kv_paths = with_controls(kv_paths, DEFAULT_YARDSTICK if yardstick is None else yardstick)
    return RunConfig(models=tuple(models), scenario_paths=tuple(scenario_paths or default_scenarios()),
                     paths=kv_paths, out=out or new_run_dir(), device=resolve_device(device),
                     command=stored_command(command), yardstick=yardstick, **fields)


def single_device(spec: str, command: str) -> str:
    """A resolved --device for a command that loads one model on one device (serve, calibrate, sensitivity);
    that device is made this process's current CUDA device, so graphs, streams and kernel launches go there."""
    device = resolve_device(spec)
    if "," in device:
        raise ValueError(f"--device {spec}: harness {command} runs one model on one device; name one GPU (cuda:N)")
    if device.startswith("cuda:"):
        import torch

        torch.cuda.set_device(device)
    return device
