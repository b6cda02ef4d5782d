"""A stored run's verdicts: `verdicts.jsonl` (per turn), `path_verdicts.jsonl` (per model and path) and the
manifest's `verdicts` matrix, written after the judges, or computed on the fly (by the same functions) for a run
made before verdicts existed."""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.analysis.verdicts import Limit, parse_threshold_overrides, verdict_matrix
from harness.runs.read import finite_text as _finite
from harness.runs.read import read_run, yardstick_label
from harness.runs.store import RunStore

VERDICTS_TABLE = "verdicts"
PATH_VERDICTS_TABLE = "path_verdicts"
__all__ = ["yardstick_label", "with_controls", "write_verdicts", "run_verdicts", "run_path_verdicts", "run_matrix",
           "compute_run_verdicts", "compute_run_path_verdicts"]


def with_controls(paths: tuple, spec: str | None) -> tuple:
    """The run's KV paths with the yardstick path added when it is not among them (in-process runs: the
    yardstick is measured in the same run, docs/VERDICTS.md), then its twin (its format emulated outside the
    engine, `harness.kv_paths.emulated`: what the yardstick itself is judged by) and the control arm (`CONTROL_ARM`:
    BF16 against BF16 under a perturbation the engine has, the floor of agreement, flips and length). `spec` None
    or "none": no yardstick, no twin, and still the control arm."""
    from harness.kv_paths.spec import CONTROL_ARM, parse_path

    if spec and spec != "none":
        paths = _with_yardstick_and_twin(paths, spec)
    control = parse_path(CONTROL_ARM)
    return paths if any(p.canonical == control.canonical for p in paths) else (*paths, control)


def _with_yardstick_and_twin(paths: tuple, spec: str) -> tuple:
    from harness.kv_paths.spec import parse_path, twin_of

    stick = parse_path(spec)
    if not any(p.canonical == stick.canonical or p.name == spec for p in paths):
        paths = (*paths, stick)
    twin = twin_of(spec)
    if twin is not None and not any(p.canonical == twin for p in paths):
        paths = (*paths, parse_path(f"{spec}:emulated"))
    return paths


def compute_run_verdicts(store: RunStore, overrides: dict[str, Limit] | None = None) -> list[dict]:
    return read_run(store.directory).computed_verdicts(overrides)


def compute_run_path_verdicts(store: RunStore, overrides: dict[str, Limit] | None = None) -> list[dict]:
    return read_run(store.directory).computed_path_verdicts(overrides)


def _write_table(store: RunStore, table: str, rows: list[dict]) -> None:
    target = store.directory / f"{table}.jsonl"
    tmp = target.with_suffix(f".jsonl.tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(row, allow_nan=False, ensure_ascii=False, default=_jsonable) + "\n"
                           for row in rows))
    os.replace(tmp, target)


def _jsonable(value):
    raise TypeError(f"verdict row holds a {type(value).__name__}: {value!r}")


def write_verdicts(store: RunStore, threshold_specs: list[str] | None = None, yardstick: str | None = None) -> dict:
    """Compute the run's verdicts, write verdicts.jsonl and path_verdicts.jsonl (replacing earlier ones: a resumed
    run is judged whole) and the manifest's `verdicts`, `verdict_thresholds`, `yardstick` and `control_floor` (per
    model, the control arm's: harness.analysis.verdicts.control_floors); returns the matrix."""
    specs = list(threshold_specs or [])
    overrides = parse_threshold_overrides(specs)
    store.update_manifest(yardstick=yardstick_label(store.read_manifest(), yardstick))
    stored = read_run(store.directory)
    rows = stored.computed_verdicts(overrides)
    path_rows = _finite(stored.computed_path_verdicts(overrides))
    _write_table(store, VERDICTS_TABLE, _finite(rows))
    _write_table(store, PATH_VERDICTS_TABLE, path_rows)
    matrix = verdict_matrix(rows, path_rows)
    floors = {r["model"]: r["numbers"]["control"] for r in path_rows if "control" in r["numbers"]}
    store.update_manifest(verdicts=_finite(matrix), verdict_thresholds=specs, control_floor=floors)
    return matrix


def run_verdicts(run_dir: Path | str) -> list[dict]:
    """The run's verdict rows: verdicts.jsonl when it was written, else computed now from its rows."""
    return read_run(run_dir).verdicts


def run_path_verdicts(run_dir: Path | str) -> list[dict]:
    """The run's per-path verdict rows: path_verdicts.jsonl when written, else computed now."""
    return read_run(run_dir).path_verdicts


def run_matrix(run_dir: Path | str) -> dict:
    return read_run(run_dir).matrix
