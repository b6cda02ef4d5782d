"""The one place a run's configuration is built: defaults, device resolution, the stored command, the run directory.

`harness run`, `harness attention`, `harness nightly`, `harness zoo` and `pytest harness` all build their
`RunConfig` here, so a default (models, scenarios, KV paths), the device check and the credential scrub of the
stored command are the same whichever front door a run came through.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from pathlib import Path

from harness.analysis.verdicts import DEFAULT_YARDSTICK
from harness.job import (DEFAULT_PATHS, RunConfig, default_models, default_scenarios, new_run_dir, parse_kv_paths,
                         resolve_device)
from harness.kv_paths.spec import KVPath, PathSpecError
from harness.records import scrub_credentials
from harness.runs.gate import with_controls

__all__ = ["build_run_config", "resolve_device", "single_device", "stored_command"]


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
