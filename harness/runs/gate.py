"""A stored run's verdicts: `verdicts.jsonl` (per turn), `path_verdicts.jsonl` (per model and path) and the
manifest's `verdicts` matrix, written after the judges, or computed on the fly (by the same functions) for a run
made before verdicts existed."""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.analysis.verdicts import (
    DEFAULT_YARDSTICK,
    Limit,
    compute_path_verdicts,
    compute_verdicts,
    parse_threshold_overrides,
    verdict_matrix,
)
from harness.runs.store import RunStore

VERDICTS_TABLE = "verdicts"
PATH_VERDICTS_TABLE = "path_verdicts"


def _overrides(manifest: dict) -> dict[str, Limit]:
    return parse_threshold_overrides(manifest.get("verdict_thresholds") or [])


def yardstick_label(manifest: dict, spec: str | None = None) -> str:
    """The run's label for the yardstick path: the manifest's `yardstick`, else the default; matched to the
    run's paths by canonical spec (`fp8:calibrated` is `fp8_e4m3:calibrated`)."""
    from harness.kv_paths.spec import PathSpecError, parse_path

    wanted = spec or manifest.get("yardstick") or DEFAULT_YARDSTICK
    try:
        canonical = parse_path(wanted).canonical
    except (PathSpecError, ValueError):
        return wanted  # an endpoint label
    return next((p["name"] for p in manifest.get("paths", []) if p.get("canonical") == canonical), wanted)


def with_yardstick(paths: tuple, spec: str | None) -> tuple:
    """The run's KV paths with the yardstick path added last when it is not among them (in-process runs: the
    yardstick is measured in the same run, docs/VERDICTS.md). `spec` None or "none": no yardstick."""
    from harness.kv_paths.spec import parse_path

    if not spec or spec == "none":
        return paths
    stick = parse_path(spec)
    return paths if any(p.canonical == stick.canonical for p in paths) else (*paths, stick)


def compute_run_verdicts(store: RunStore, overrides: dict[str, Limit] | None = None) -> list[dict]:
    manifest = store.read_manifest()
    sources = {s["id"]: s.get("source", "scenario file") for s in manifest.get("scenarios", [])}
    return compute_verdicts(store.read("records"), store.read("checks"), store.read("judgements"),
                            store.read("errors"), overrides if overrides is not None else _overrides(manifest),
                            sources, _noise_models(manifest), yardstick_label(manifest))


def compute_run_path_verdicts(store: RunStore, overrides: dict[str, Limit] | None = None) -> list[dict]:
    manifest = store.read_manifest()
    kl_series = [row for row in store.read("series") if row.get("series") == "kl"]
    return compute_path_verdicts(store.read("records"), store.read("judgements"), kl_series,
                                 overrides if overrides is not None else _overrides(manifest),
                                 _noise_models(manifest), yardstick_label(manifest))


def _noise_models(manifest: dict) -> list[str]:
    return [m["label"] for m in manifest.get("models", []) if m.get("random_weights")]


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
    run is judged whole) and the manifest's `verdicts`, `verdict_thresholds` and `yardstick`; returns the matrix."""
    specs = list(threshold_specs or [])
    overrides = parse_threshold_overrides(specs)
    store.update_manifest(yardstick=yardstick_label(store.read_manifest(), yardstick))
    rows = compute_run_verdicts(store, overrides)
    path_rows = _finite(compute_run_path_verdicts(store, overrides))
    _write_table(store, VERDICTS_TABLE, _finite(rows))
    _write_table(store, PATH_VERDICTS_TABLE, path_rows)
    matrix = verdict_matrix(rows, path_rows)
    store.update_manifest(verdicts=_finite(matrix), verdict_thresholds=specs)
    return matrix


def _finite(value):
    """NaN/inf inside verdict rows (an inf ratio of a broken path) as the strings "nan" / "inf" / "-inf": JSON
    has no such numbers, and the reason's message already says what happened."""
    if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def run_verdicts(run_dir: Path | str) -> list[dict]:
    """The run's verdict rows: verdicts.jsonl when it was written, else computed now from its rows."""
    store = RunStore(Path(run_dir))
    if (store.directory / f"{VERDICTS_TABLE}.jsonl").exists():
        return store.read(VERDICTS_TABLE)
    return _finite(compute_run_verdicts(store))


def run_path_verdicts(run_dir: Path | str) -> list[dict]:
    """The run's per-path verdict rows: path_verdicts.jsonl when written, else computed now."""
    store = RunStore(Path(run_dir))
    if (store.directory / f"{PATH_VERDICTS_TABLE}.jsonl").exists():
        return store.read(PATH_VERDICTS_TABLE)
    return _finite(compute_run_path_verdicts(store))


def run_matrix(run_dir: Path | str) -> dict:
    manifest = RunStore(Path(run_dir)).read_manifest()
    if "verdicts" in manifest and all("questions" in cell for cells in manifest["verdicts"].values()
                                      for cell in cells.values()):
        return manifest["verdicts"]
    return _finite(verdict_matrix(run_verdicts(run_dir), run_path_verdicts(run_dir)))
