"""A stored run's verdicts: `verdicts.jsonl` and the manifest's `verdicts` matrix, written after the judges,
or computed on the fly (by the same function) for a run made before verdicts existed."""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.analysis.verdicts import Limit, compute_verdicts, parse_threshold_overrides, verdict_matrix
from harness.runs.store import RunStore

VERDICTS_TABLE = "verdicts"


def _overrides(manifest: dict) -> dict[str, Limit]:
    return parse_threshold_overrides(manifest.get("verdict_thresholds") or [])


def compute_run_verdicts(store: RunStore, overrides: dict[str, Limit] | None = None) -> list[dict]:
    manifest = store.read_manifest()
    sources = {s["id"]: s.get("source", "scenario file") for s in manifest.get("scenarios", [])}
    noise = [m["label"] for m in manifest.get("models", []) if m.get("random_weights")]
    return compute_verdicts(store.read("records"), store.read("checks"), store.read("judgements"),
                            store.read("errors"), overrides if overrides is not None else _overrides(manifest),
                            sources, noise)


def write_verdicts(store: RunStore, threshold_specs: list[str] | None = None) -> dict:
    """Compute the run's verdicts, write verdicts.jsonl (replacing any earlier one: a resumed run is judged
    whole) and the manifest's `verdicts` and `verdict_thresholds`; returns the matrix."""
    specs = list(threshold_specs or [])
    rows = compute_run_verdicts(store, parse_threshold_overrides(specs))
    target = store.directory / f"{VERDICTS_TABLE}.jsonl"
    tmp = target.with_suffix(f".jsonl.tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(row, allow_nan=False, ensure_ascii=False) + "\n" for row in rows))
    os.replace(tmp, target)
    matrix = verdict_matrix(rows)
    store.update_manifest(verdicts=matrix, verdict_thresholds=specs)
    return matrix


def run_verdicts(run_dir: Path | str) -> list[dict]:
    """The run's verdict rows: verdicts.jsonl when it was written, else computed now from its rows."""
    store = RunStore(Path(run_dir))
    if (store.directory / f"{VERDICTS_TABLE}.jsonl").exists():
        return store.read(VERDICTS_TABLE)
    return compute_run_verdicts(store)


def run_matrix(run_dir: Path | str) -> dict:
    manifest = RunStore(Path(run_dir)).read_manifest()
    return manifest["verdicts"] if "verdicts" in manifest else verdict_matrix(run_verdicts(run_dir))
