"""A stored run: one directory, append-only JSONL tables, a manifest, and resume bookkeeping.

A unit of work (model, scenario, path) appends its records, series and texts and then one line to
`done.jsonl`. On resume, rows of units without a done line (a run killed mid-unit) are dropped and
those units recomputed; finished units are never recomputed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
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


def _dump(row: dict, indent: int | None = None) -> str:
    """Strict JSON. A NaN/inf the writer did not encode itself (`harness.records.encode_value`) never
    fails its unit: it is stored as null, with its text under `nonfinite` {"field.path": "inf"}."""
    try:
        return json.dumps(row, default=_json_default, allow_nan=False, ensure_ascii=False, indent=indent)
    except ValueError:
        found: dict[str, str] = {}
        clean = _finite(json.loads(json.dumps(row, default=_json_default)), "", found)
        return json.dumps({**clean, "nonfinite": found}, allow_nan=False, ensure_ascii=False, indent=indent)


def _finite(value, path: str, found: dict[str, str]):
    if isinstance(value, float) and not math.isfinite(value):
        found[path] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return None
    if isinstance(value, dict):
        return {k: _finite(v, f"{path}.{k}" if path else str(k), found) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v, f"{path}[{i}]", found) for i, v in enumerate(value)]
    return value


def _judge_key(row: dict) -> tuple:
    return row.get("model"), row.get("scenario"), row.get("path"), row.get("turn"), row.get("metric")


@dataclass(slots=True)
class _PendingUnit:
    key: tuple[str, str, str]  # (model, scenario, path)
    texts: dict[str, str]  # table -> its serialised rows
    finished: bool = False  # a group write took this unit and ended
    error: BaseException | None = None  # set when that write failed


RUN_LOCK = ".run.lock"  # held (flock) by the one `harness run` writing the directory, for the whole run


@contextlib.contextmanager
def hold_run_lock(directory: Path):
    """One writer per run directory: an exclusive flock on `directory/.run.lock`, held until the block
    ends (the kernel drops it when the process dies, so a killed run never leaves a stale lock). A second
    run on the same directory is refused at once, naming the holder's pid. Creates the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / RUN_LOCK, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise RunStoreError(f"run directory {directory} is being written by another harness run (pid {holder}); "
                            f"wait for it to finish, or choose another --out") from None
    try:
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


@dataclass
class RunStore:
    directory: Path
    done: set[tuple[str, str, str]] = field(default_factory=set)
    # Units finish from worker threads (fsync off the event loop) and model worker processes; one writer
    # at a time (a thread lock plus an flock on .lock) keeps lines whole and a unit's rows together.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # `finish_unit`'s group commit: units waiting to be written, and whether a thread is writing a group now
    _pending: list = field(default_factory=list, repr=False)
    _writing: bool = field(default=False, repr=False)
    _queue: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)

    @classmethod
    def create(cls, directory: Path, manifest: dict) -> "RunStore":
        if directory.exists() and any(p.name != RUN_LOCK for p in directory.iterdir()):
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
        tmp.write_text(_dump(manifest, indent=2) + "\n")
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

    def _append_locked(self, table: str, rows: Iterable[dict] | str) -> None:
        text = rows if isinstance(rows, str) else "".join(_dump(row) + "\n" for row in rows)
        if not text:
            return
        with open(self.directory / f"{table}.jsonl", "a", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())

    def finish_unit(self, model: str, scenario: str, path: str, tables: dict[str, list[dict]]) -> None:
        """Append a unit's rows, then mark it done: a kill between the two recomputes only this unit.

        Group commit: units finished from several threads at once (the batched replay finishes a model's units
        back to back) queue while one thread writes; the next writer takes every queued unit and writes each
        table once (one fsync) for all of them, then all their done lines. A caller returns when its unit is
        written, and raises what its group's write raised."""
        texts = {table: "".join(_dump(row) + "\n" for row in rows) for table, rows in tables.items()}
        unit = _PendingUnit((model, scenario, path), texts)  # every row serialised first: a bad row writes nothing
        with self._queue:
            self._pending.append(unit)
            while self._writing and not unit.finished:
                self._queue.wait()
            if unit.finished:
                return self._raise_if_failed(unit)
            self._writing, group, self._pending = True, self._pending, []
        try:
            with self._exclusive():
                self._commit(group)
        except BaseException as error:  # the lock itself failed: nothing of the group was written
            for queued in group:
                queued.error = queued.error or error
            raise
        finally:
            with self._queue:
                self._writing = False
                for queued in group:
                    queued.finished = True
                self._queue.notify_all()
        self._raise_if_failed(unit)

    def _commit(self, group: list["_PendingUnit"]) -> None:
        try:
            for table in dict.fromkeys(t for unit in group for t in unit.texts):
                self._append_locked(table, "".join(unit.texts.get(table, "") for unit in group))
            self._append_locked("done", [dict(zip(("model", "scenario", "path"), unit.key)) for unit in group])
        except BaseException as error:  # every unit of the group failed with it: none is marked done
            for unit in group:
                unit.error = error
            return
        self.done.update(unit.key for unit in group)

    @staticmethod
    def _raise_if_failed(unit: "_PendingUnit") -> None:
        if unit.error is not None:
            raise unit.error

    def append_judged(self, judgements: list[dict], records: list[dict]) -> None:
        """Judge metrics to records.jsonl, then their judgements.jsonl rows, which commit them: a kill
        between the two leaves judge records without a judgement, which `resume` drops and re-judges."""
        texts = ["".join(_dump(row) + "\n" for row in rows) for rows in (records, judgements)]
        with self._exclusive():
            self._append_locked("records", texts[0])
            self._append_locked("judgements", texts[1])

    def is_done(self, model: str, scenario: str, path: str) -> bool:
        return (model, scenario, path) in self.done

    def _drop_unfinished(self) -> None:
        judged = {_judge_key(r) for r in self.read("judgements")}
        for table in UNIT_TABLES:
            path = self.directory / f"{table}.jsonl"
            if not path.exists():
                continue
            rows = self.read(table)
            kept = [r for r in rows if (r.get("model"), r.get("scenario"), r.get("path")) in self.done
                    and not (table == "records" and str(r.get("metric")).startswith("judge_")
                             and _judge_key(r) not in judged)]
            if len(kept) != len(rows) or path.read_text().count("\n") != len(rows):
                tmp = path.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(_dump(r) + "\n" for r in kept))
                os.replace(tmp, path)
