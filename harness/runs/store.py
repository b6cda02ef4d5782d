"""A stored run: one directory, append-only JSONL tables, a manifest, and resume bookkeeping.

A unit of work (model, scenario, path) appends its records, series and texts and then one line to
`done.jsonl`. On resume, rows of units without a done line (a run killed mid-unit) are dropped and
those units recomputed; finished units are never recomputed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

# Tables whose rows belong to a unit; errors.jsonl is a log and keeps every failure across resumes.
UNIT_TABLES = ("records", "series", "texts", "checks", "attention", "attention_channels")


class RunStoreError(RuntimeError):
    pass


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _dump(row: dict) -> str:
    return json.dumps(row, default=_json_default, allow_nan=False, ensure_ascii=False)


@dataclass
class RunStore:
    directory: Path
    done: set[tuple[str, str, str]] = field(default_factory=set)
    # Units finish from worker threads (fsync off the event loop) and model worker processes; one writer
    # at a time (a thread lock plus an flock on .lock) keeps lines whole and a unit's rows together.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)

    @classmethod
    def create(cls, directory: Path, manifest: dict) -> "RunStore":
        if directory.exists() and any(directory.iterdir()):
            raise RunStoreError(f"run directory {directory} is not empty; pass --resume to continue it "
                                f"or choose another --out")
        directory.mkdir(parents=True, exist_ok=True)
        store = cls(directory)
        store.write_manifest(manifest)
        return store

    @classmethod
    def resume(cls, directory: Path) -> "RunStore":
        if not (directory / "manifest.json").is_file():
            raise RunStoreError(f"cannot resume {directory}: no manifest.json there")
        store = cls(directory)
        store.done = {(r["model"], r["scenario"], r["path"]) for r in store.read("done")}
        store._drop_unfinished()
        return store

    # -- manifest -------------------------------------------------------------------------------------
    @classmethod
    def attach(cls, directory: Path) -> "RunStore":
        """Another process's handle on a run being written (model workers): knows what is done."""
        store = cls(directory)
        store.done = {(r["model"], r["scenario"], r["path"]) for r in store.read("done")}
        return store

    @contextlib.contextmanager
    def _exclusive(self):
        """One writer at a time across threads and processes (several model workers share a run)."""
        with self._lock, open(self.directory / ".lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def read_manifest(self) -> dict:
        return json.loads((self.directory / "manifest.json").read_text())

    def write_manifest(self, manifest: dict) -> None:
        tmp = self.directory / f"manifest.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps(manifest, indent=2, default=_json_default, allow_nan=False) + "\n")
        os.replace(tmp, self.directory / "manifest.json")

    def edit_manifest(self, edit) -> dict:
        """Read, `edit(manifest)` in place, write: atomic with respect to other writers."""
        with self._exclusive():
            manifest = self.read_manifest()
            edit(manifest)
            self.write_manifest(manifest)
        return manifest

    def update_manifest(self, **fields) -> dict:
        return self.edit_manifest(lambda manifest: manifest.update(fields))

    # -- tables ---------------------------------------------------------------------------------------
    def read(self, table: str) -> list[dict]:
        path = self.directory / f"{table}.jsonl"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill: it belongs to an unfinished unit
                continue
        return rows

    def append(self, table: str, rows: Iterable[dict]) -> None:
        with self._exclusive():
            self._append_locked(table, rows)

    def _append_locked(self, table: str, rows: Iterable[dict]) -> None:
        text = "".join(_dump(row) + "\n" for row in rows)
        if not text:
            return
        with open(self.directory / f"{table}.jsonl", "a", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())

    def finish_unit(self, model: str, scenario: str, path: str, tables: dict[str, list[dict]]) -> None:
        """Append a unit's rows, then mark it done: a kill between the two recomputes only this unit."""
        with self._exclusive():
            for table, rows in tables.items():
                self._append_locked(table, rows)
            self._append_locked("done", [{"model": model, "scenario": scenario, "path": path}])
            self.done.add((model, scenario, path))

    def is_done(self, model: str, scenario: str, path: str) -> bool:
        return (model, scenario, path) in self.done

    def _drop_unfinished(self) -> None:
        for table in UNIT_TABLES:
            path = self.directory / f"{table}.jsonl"
            if not path.exists():
                continue
            rows = self.read(table)
            kept = [r for r in rows if (r.get("model"), r.get("scenario"), r.get("path")) in self.done]
            if len(kept) != len(rows) or path.read_text().count("\n") != len(rows):
                tmp = path.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(_dump(r) + "\n" for r in kept))
                os.replace(tmp, path)
