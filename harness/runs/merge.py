"""Merge stored runs of disjoint work (the pytest plugin's per-model parts, one per worker) into one run."""

from __future__ import annotations

import json
from pathlib import Path

from harness.runs.store import RunStore

TABLES = ("records", "series", "texts", "checks", "judgements", "done", "errors")
STATUS_ORDER = ("complete", "complete_with_errors", "interrupted", "failed", "running")


def _union(items: list[dict], key: str) -> list[dict]:
    seen = {}
    for item in items:
        seen.setdefault(item[key], item)
    return list(seen.values())


def merged_manifest(manifests: list[dict], run_id: str, command: str) -> dict:
    merged = dict(manifests[0]) | {"run_id": run_id, "command": command}
    for field, key in (("models", "label"), ("scenarios", "id"), ("scenario_files", "file"), ("paths", "name")):
        merged[field] = _union([item for m in manifests for item in m.get(field, [])], key)
    for field in ("scales", "noise_floor"):
        merged[field] = {k: v for m in manifests for k, v in (m.get(field) or {}).items()}
    merged["warnings"] = list(dict.fromkeys(w for m in manifests for w in m.get("warnings", [])))
    merged["status"] = max((m.get("status", "running") for m in manifests), key=STATUS_ORDER.index)
    merged["started_at"] = min(m["started_at"] for m in manifests)
    merged["finished_at"] = max((m.get("finished_at") or "" for m in manifests), default="") or None
    merged.pop("verdicts", None)
    merged.pop("units_expected", None)  # parts share reference units: counted from models x scenarios x paths
    return merged


def merge_runs(parts: list[Path], out: Path, command: str = "") -> RunStore:
    """Write one run at `out` holding every part's rows (identical rows once: a reference replayed by two
    parts); the caller computes verdicts and the report on it."""
    if not parts:
        raise ValueError("merge_runs: no parts to merge")
    stores = [RunStore(Path(p)) for p in parts]
    store = RunStore.create(Path(out), merged_manifest([s.read_manifest() for s in stores], Path(out).name, command))
    for table in TABLES:
        rows, seen = [], set()
        for part in stores:
            for row in part.read(table):
                text = json.dumps(row, sort_keys=True)
                if text not in seen:
                    seen.add(text)
                    rows.append(row)
        store.append(table, rows)
    return store
