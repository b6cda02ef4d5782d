"""A task replayed away from the run directory (a Ray actor, possibly on another host), its results streamed back
to the one process that writes the run.

The driver hands a worker a `Snapshot` of what the task reads (the manifest, the done lines, the model's stored
texts); the worker replays into a private scratch copy built from it (`StreamingStore`), which passes every
finished unit (its rows, the moment its group commit is written), every error row and, at the end, the
manifest's notes back to the driver. The driver writes a unit only if it is not done yet, so a task run twice (a
retry after a worker died) stores each unit once; `merge_notes` carries the worker's manifest notes (models,
families, scales, routes, batching, warnings) into the run's.
"""

from __future__ import annotations

import json
import queue
import shutil
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from harness.executor.model_replay import model_label, replay_model
from harness.runs.store import RunStore


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a task reads of the run: the manifest, the done lines, the model's texts (the reference's history)."""

    manifest: dict
    done: tuple[dict, ...]
    texts: tuple[dict, ...]

    @classmethod
    def of(cls, store: RunStore, model: Path) -> "Snapshot":
        label = model_label(model)
        texts = tuple(r for r in store.read("texts") if r.get("model") == label)
        return cls(store.read_manifest(), tuple(store.read("done")), texts)

    def write(self, directory: Path) -> None:
        directory.mkdir(parents=True)
        (directory / "manifest.json").write_text(json.dumps(self.manifest))
        for table, rows in (("done", self.done), ("texts", self.texts)):
            (directory / f"{table}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


class StreamingStore(RunStore):
    """A scratch run store that also queues each finished unit and error row for the driver."""

    def __init__(self, directory: Path, outbox: queue.Queue):
        super().__init__(directory)
        self.outbox = outbox
        self.done = {(r["model"], r["scenario"], r["path"]) for r in self.read("done")}

    def finish_unit(self, model: str, scenario: str, path: str, tables: dict[str, list[dict]]) -> None:
        super().finish_unit(model, scenario, path, tables)
        self.outbox.put(("unit", (model, scenario, path), tables))

    def append(self, table: str, rows) -> None:
        rows = list(rows)
        super().append(table, rows)
        if table == "errors":
            self.outbox.put(("errors", rows))


def replay_task(config, task, scenarios, calibration_chats, snapshot: Snapshot, device: str, cache: dict):
    """Yield ("unit", key, tables), ("errors", rows), ("warn", text) as the task's replay makes them (in a thread),
    then ("notes", base manifest, final manifest). A replay error is raised after what finished was yielded."""
    scratch = Path(tempfile.mkdtemp(prefix="harness-task-"))
    outbox: queue.Queue = queue.Queue()
    failed: list[BaseException] = []
    try:
        snapshot.write(scratch / "run")
        store = StreamingStore(scratch / "run", outbox)
        local = replace(config, out=scratch / "run", device=device)
        by_id = {s.id: s for s in scenarios}
        chunk = [by_id[i] for i in task.scenario_ids]

        def work() -> None:
            try:
                replay_model(local, task.model, chunk, calibration_chats, store, None,
                             lambda text: outbox.put(("warn", text)), cache)
            except BaseException as error:  # noqa: BLE001 - raised in the generator, after the units it finished
                failed.append(error)
            finally:
                outbox.put(None)

        thread = threading.Thread(target=work, name="replay-task", daemon=True)
        thread.start()
        while (item := outbox.get()) is not None:
            yield item
        thread.join()
        if failed:
            raise failed[0]
        yield ("notes", snapshot.manifest, store.read_manifest())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _by(items: list, key: str) -> dict:
    return {item.get(key): item for item in items if isinstance(item, dict)}


def merge_notes(manifest: dict, base: dict, updated: dict) -> None:
    """Carry what a worker's replay noted (its manifest `updated`, made from `base`) into the run's `manifest`, in
    place: model entries by label, per-model tables (families, scales, batching), each path's routes, new warnings.
    Run-level fields (status, times, executor) stay the driver's."""
    models = _by(manifest.get("models", []), "label")
    for label, entry in _by(updated.get("models", []), "label").items():
        if entry != _by(base.get("models", []), "label").get(label):
            models[label] = entry
    manifest["models"] = list(models.values())
    for table in ("families", "scales", "batching"):
        changed = {k: v for k, v in (updated.get(table) or {}).items() if (base.get(table) or {}).get(k) != v}
        if changed:
            manifest.setdefault(table, {}).update(changed)
    routes = {name: entry.get("routes") or {} for name, entry in _by(updated.get("paths", []), "name").items()}
    for entry in manifest.get("paths", []):
        entry.setdefault("routes", {}).update(routes.get(entry.get("name"), {}))
    manifest["warnings"] = manifest.get("warnings", []) + [w for w in updated.get("warnings", [])
                                                           if w not in manifest.get("warnings", [])]
