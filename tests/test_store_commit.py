"""`RunStore.finish_unit` from many threads at once (the batched replay finishes a model's units back to back):
units are written in groups, one fsync per table per group, and each unit still lands whole, then its done line;
a failed write fails every unit of its group and marks none done."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.runs.store import RunStore

UNITS = 37  # an odd count, more than the pool's threads


def unit_tables(i: int) -> dict[str, list[dict]]:
    key = {"model": "m", "scenario": f"s{i}", "path": "p"}
    tables = {"records": [{**key, "turn": t, "metric": "kl_mean", "value": i + t / 10} for t in range(3)],
              "texts": [{**key, "turn": 0, "text": f"reply {i}"}]}
    if i % 3 == 0:  # some units have a table the others lack
        tables["series"] = [{**key, "turn": 0, "series": "kl", "values": [0.0, float(i)]}]
    return tables


def rows(store: RunStore, table: str) -> list[dict]:
    return [json.loads(line) for line in (store.directory / f"{table}.jsonl").read_text().splitlines()]


def finish_all(store: RunStore, first_write: threading.Event | None = None) -> list[BaseException | None]:
    def finish(i: int) -> BaseException | None:
        try:
            store.finish_unit("m", f"s{i}", "p", unit_tables(i))
        except Exception as error:  # noqa: BLE001 - returned for the test to look at
            return error
        return None

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(finish, range(UNITS)))


def test_units_finished_at_once_all_land_whole_with_fewer_fsyncs(tmp_path, monkeypatch):
    store = RunStore.create(tmp_path / "run", {"run_id": "grouped"})
    fsyncs, real_fsync = [], os.fsync
    gate = threading.Barrier(2, timeout=5)

    def slow_first_fsync(fd):  # the first write waits until another unit is queued: a group must form
        fsyncs.append(fd)
        if len(fsyncs) == 1:
            gate.wait()
        real_fsync(fd)

    real_append = RunStore.finish_unit

    def finish_unit(self, *args):
        if args[1] == "s1":  # unit 1 arrives while unit 0's first fsync waits
            gate.wait()
        return real_append(self, *args)

    monkeypatch.setattr(os, "fsync", slow_first_fsync)
    monkeypatch.setattr(RunStore, "finish_unit", finish_unit)
    assert finish_all(store) == [None] * UNITS
    expected = [unit_tables(i) for i in range(UNITS)]
    for table in ("records", "texts", "series"):
        found = rows(store, table)
        wanted = [row for tables in expected for row in tables.get(table, [])]
        assert sorted(map(json.dumps, found)) == sorted(map(json.dumps, wanted)), table
    done = rows(store, "done")
    assert sorted(r["scenario"] for r in done) == sorted(f"s{i}" for i in range(UNITS))
    assert store.done == {("m", f"s{i}", "p") for i in range(UNITS)}
    one_at_a_time = sum(len(unit_tables(i)) + 1 for i in range(UNITS))  # each table and done, once per unit
    assert len(fsyncs) < one_at_a_time  # grouped: at least one group of two or more units
    resumed = RunStore.resume(store.directory)  # nothing dropped: every unit has its done line
    assert len(resumed.read("records")) == 3 * UNITS


def test_a_failed_group_write_fails_its_units_and_marks_none_done(tmp_path, monkeypatch):
    store = RunStore.create(tmp_path / "run", {"run_id": "failing"})
    real = RunStore._append_locked

    def disk_full_on_texts(self, table, text):
        if table == "texts":
            raise OSError(28, "No space left on device")
        return real(self, table, text)

    monkeypatch.setattr(RunStore, "_append_locked", disk_full_on_texts)
    errors = finish_all(store)
    assert all(isinstance(e, OSError) and e.errno == 28 for e in errors)
    assert store.done == set() and not (store.directory / "done.jsonl").exists()
    monkeypatch.setattr(RunStore, "_append_locked", real)
    resumed = RunStore.resume(store.directory)  # the records written before the failure belong to no done unit
    assert resumed.read("records") == [] and resumed.done == set()


def test_a_row_that_cannot_be_written_writes_nothing_of_its_unit(tmp_path):
    store = RunStore.create(tmp_path / "run", {"run_id": "bad-row"})
    with pytest.raises(TypeError, match="not JSON serialisable"):
        store.finish_unit("m", "s", "p", {"records": [{"value": object()}]})
    store.finish_unit("m", "s2", "p", unit_tables(2))
    assert [r["scenario"] for r in rows(store, "done")] == ["s2"] and len(rows(store, "records")) == 3


def test_a_failed_writer_lock_fails_every_unit_of_its_group(tmp_path, monkeypatch):
    store = RunStore.create(tmp_path / "run", {"run_id": "no-lock"})

    def no_lock(self):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(RunStore, "_exclusive", no_lock)
    errors = finish_all(store)
    assert all(isinstance(e, OSError) and e.errno == 37 for e in errors) and store.done == set()
