"""Property-based fuzzing (hypothesis) of the surfaces added since tests/test_fuzz_inputs.py (issue 45, item 3/4):
the JSONL task import (`--tasks`, `harness scenarios from-jsonl`), the scenario and model selection (`--select`,
`--models`), the yardstick spec (`--yardstick`) and the run reader (`harness report` / `compare` / `nightly` on a
stored run whose files were damaged or written by hand). Each ends in a result or its named input error, never
another exception.

The draw is the gate's fixed one (`fuzz`, derandomized, as in test_fuzz_inputs.py). That a fixed draw is enough is
itself tested: `test_a_planted_crash_is_caught` plants, for each parser fuzzed here and in test_fuzz_inputs.py, a
crash on one class of hostile input (a keyed option with no value, a field of the wrong JSON type, a glob, several
paths in one spec, a negative limit, a repeated end of stream) and runs the fuzz test against it; the fixed draw must
reach every plant, on every run.

Budget: 200 task files, 300 selections, 400 yardstick specs, 150 damaged runs, plus the plants, each stopping at
its first failing example.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
import test_fuzz_inputs as earlier
from test_fuzz_inputs import fuzz, scalars, values

from harness.kv_paths.spec import PathSpecError, parse_path
from harness.runs.read import IncompleteRunError, RunReadError, read_run
from harness.scenarios import tasks as task_import
from harness.scenarios.load import Scenario, ScenarioError, Turn
from harness.scenarios.select import select_models, select_scenarios

REAL_RUN = Path(__file__).parent / "data" / "runs" / "real"

# ---------------------------------------------------------------- the JSONL task import

task_keys = st.sampled_from(["question", "answer", "needle", "id", "system", "max_new_tokens", "tags", "chars",
                             "depth", "seed", "unknown", ""])
task_item = st.dictionaries(task_keys, values, max_size=7) | st.fixed_dictionaries(
    {"question": st.text(max_size=20) | scalars, "answer": st.sampled_from(["#### 42", "7", "", "x #### 1,000"])
     | scalars}, optional={"id": st.text(max_size=5) | scalars, "needle": st.text(max_size=10) | scalars,
                           "chars": st.integers(-5, 300) | scalars, "tags": values})
task_line = st.one_of(task_item.map(lambda item: json.dumps(item, allow_nan=True)), values.map(json.dumps),
                      st.text(max_size=30), st.sampled_from(["", "//", "{", "[]", "null", "\u2028"]))
task_files = st.lists(task_line, max_size=5).map("\n".join)


def _load_tasks(file: Path) -> None:
    try:
        scenarios = task_import.load_task_file(file)
    except ScenarioError as error:
        assert error.problems and all(str(file) in problem for problem in error.problems), error.problems
        return
    assert all(isinstance(s, Scenario) and s.id and s.turns for s in scenarios)


@pytest.fixture(scope="module")
def scratch():
    with tempfile.TemporaryDirectory(prefix="fuzz-surfaces-") as directory:
        yield Path(directory)


@fuzz(200)
@given(text=task_files)
@example(text='{"question": "q", "answer": "#### 4"}\n{"question": "q", "answer": "#### 4"}')  # the same id twice
@example(text='{"question": "q", "answer": "4", "id": 7}')
@example(text='{"needle": "n", "question": "q", "answer": "a", "chars": NaN}')
def test_any_task_file_loads_or_is_named(scratch, text):
    file = scratch / "tasks.jsonl"
    file.write_text(text, encoding="utf-8")
    _load_tasks(file)


# ---------------------------------------------------------------- --select and --models

SCENARIOS = [Scenario(id=f"s-{i}", kind=kind, turns=(Turn("hi"),), tags=tags)
             for i, (kind, tags) in enumerate([("chat", ("canary",)), ("recall", ("recall", "canary")),
                                               ("arithmetic", ()), ("long_context", ("needle",))])]
MODELS = [Path("/m/gqa"), Path("/m/mla"), Path("/m/hybrid")]
terms = st.lists(st.one_of(st.sampled_from(["tag:canary", "kind:chat", "id:s-*", "s-1", "*", "tag:", ":", "id:[",
                                            "kind:*", "x:y", "[!", "gqa", "mla", " ", ""]), st.text(max_size=10)),
                 max_size=3).map(lambda words: [",".join(words[:2]), *words[2:]] if words else [])


@fuzz(300)
@given(specs=terms)
@example(specs=["id:["])  # an unclosed glob class
@example(specs=[","])
def test_any_selection_picks_or_is_named(specs):
    try:
        picked = select_scenarios(SCENARIOS, specs)
    except ValueError as error:
        assert "--select" in str(error)
    else:
        assert picked and all(s in SCENARIOS for s in picked)
    try:
        models = select_models(MODELS, specs)
    except ValueError as error:
        assert "--models" in str(error)
    else:
        assert models and set(models) <= set(MODELS)


# ---------------------------------------------------------------- --yardstick

yardstick_words = st.sampled_from(["fp8_e4m3", "fp8_e5m2", "nvfp4", "bf16", "calibrated", "per_head", "emulated",
                                   "chunked_prefill", "none", "fault=scale_dropped", "keep_bf16=1", "vllm", "sglang",
                                   "", "x", "k=fp8_e4m3/v=nvfp4", "/", "="]) | st.text(max_size=8)
yardsticks = st.lists(yardstick_words, max_size=4).map(":".join)


@fuzz(400)
@given(spec=yardsticks)
@example(spec="fp8_e4m3:calibrated:emulated")
@example(spec=":")
def test_any_yardstick_spec_parses_or_is_named(spec):
    from harness.runs.gate import with_controls

    try:
        stick = parse_path(spec)
    except PathSpecError as error:
        assert str(error)
        return
    paths = with_controls((), spec)
    assert stick.canonical in {p.canonical for p in paths}


# ---------------------------------------------------------------- the run reader

# the fields each file's rows hold (None: the whole line replaced)
ROW_FIELDS_BY_FILE = {
    "records.jsonl": ["model", "scenario", "path", "turn", "metric", "value", "value_text", "kind", "tags", None],
    "series.jsonl": ["path", "turn", "series", "values", "values_text", None],
    "done.jsonl": ["model", "scenario", "path", None],
    "verdicts.jsonl": ["path", "turn", "verdict", "reasons", None],
    "judgements.jsonl": ["path", "turn", "metric", "value", "status", None]}
MANIFEST_KEYS = ["run_id", "status", "paths", "models", "scenarios", "verdicts", "noise_floor", "verdict_thresholds",
                 "yardstick", "device", "warnings", None]
json_values = values.map(lambda v: json.dumps(v, allow_nan=True))


@st.composite
def damaged_runs(draw):
    """(file, line number or None, field or None, new text): one file of the real stored run changed."""
    file = draw(st.sampled_from(["manifest.json", *ROW_FIELDS_BY_FILE]))
    text = draw(json_values | st.text(max_size=10))
    if file == "manifest.json":
        return file, None, draw(st.sampled_from(MANIFEST_KEYS)), text
    return file, draw(st.integers(1, 12)), draw(st.sampled_from(ROW_FIELDS_BY_FILE[file])), text


def _damage(run: Path, file: str, line: int | None, field: str | None, text: str) -> None:
    target = run / file
    if line is None:
        if field is None:
            target.write_text(text, encoding="utf-8")
            return
        manifest = json.loads(target.read_text(encoding="utf-8"))
        manifest[field] = json.loads(text) if _is_json(text) else text
        target.write_text(json.dumps(manifest, allow_nan=True), encoding="utf-8")
        return
    rows = target.read_text(encoding="utf-8").splitlines()
    if not rows:
        return
    number = (line - 1) % len(rows)
    if field is None:
        rows[number] = text
    else:
        row = json.loads(rows[number])
        row[field] = json.loads(text) if _is_json(text) else text
        rows[number] = json.dumps(row, allow_nan=True)
    target.write_text("\n".join(rows) + "\n", encoding="utf-8")


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _read_everything(run: Path) -> None:
    """What report, compare and nightly read of a run: a result, or RunReadError / IncompleteRunError."""
    try:
        view = read_run(run)
        view.incomplete()
        frame = view.records_frame
        view.series_frame  # noqa: B018 - read for its errors
        rows = view.computed_verdicts()
        view.computed_path_verdicts()
        view.matrix  # noqa: B018
        view.position_strata  # noqa: B018
    except (RunReadError, IncompleteRunError) as error:
        assert str(run) in str(error) or "run" in str(error), error
        return
    assert set(frame.columns) >= {"model", "path", "turn", "metric", "value"}
    assert all(isinstance(row, dict) for row in rows)


@fuzz(150)
@given(damage=damaged_runs())
@example(damage=("records.jsonl", 1, "value", '[1]'))
@example(damage=("records.jsonl", 2, "value", '"1e999"'))
@example(damage=("series.jsonl", 1, "values", '{"a": 1}'))
@example(damage=("manifest.json", None, "verdict_thresholds", "[1]"))
def test_any_damaged_run_reads_or_is_named(scratch, damage):
    run = scratch / "run"
    if not run.exists():
        shutil.copytree(REAL_RUN, run)
    try:
        _damage(run, *damage)
        _read_everything(run)
    finally:
        shutil.copyfile(REAL_RUN / damage[0], run / damage[0])


# ---------------------------------------------------------------- the draw is enough: planted crashes

class Planted(Exception):
    """A crash planted in a parser: not an input error, so the fuzz test must fail on it."""


class Plant:
    """Raises `Planted` the first time its class of input reaches the parser (and only then: shrinking the failing
    example would re-run an expensive parser hundreds of times, and proves nothing here)."""

    def __init__(self):
        self.hits = []

    def __call__(self, found: object) -> None:
        if not self.hits:
            self.hits.append(found)
            raise Planted(found)


def _plant_tasks(monkeypatch, plant):
    original = task_import.to_raw

    def planted(item, *args, **kwargs):
        if isinstance(item.get("tags"), dict):  # tags given as an object
            plant(item)
        return original(item, *args, **kwargs)

    monkeypatch.setattr(task_import, "to_raw", planted)


def _plant_selection(monkeypatch, plant):
    import harness.scenarios.select as select

    original = select.term_matches

    def planted(term, scenario):
        if term.startswith("id:") and term.endswith("*"):  # a glob on the id field
            plant(term)
        return original(term, scenario)

    monkeypatch.setattr(select, "term_matches", planted)


def _plant_yardstick(monkeypatch, plant):
    original = parse_path

    def planted(spec):
        if "=" in spec and spec.rstrip().endswith("="):  # a keyed option with no value
            plant(spec)
        return original(spec)

    monkeypatch.setitem(globals(), "parse_path", planted)


def _plant_reader(monkeypatch, plant):
    import harness.runs.read as read

    original = read.numbered_rows

    def planted(path):
        rows = original(path)
        if any("turn" in row and not isinstance(row["turn"], int) for _, row in rows):  # a turn that is no integer
            plant(path)
        return rows

    monkeypatch.setattr(read, "numbered_rows", planted)


def _plant_in_earlier_suite(name: str, condition):
    """A plant for a parser test_fuzz_inputs.py fuzzes: `name` (as that module calls it) fails on `condition`."""
    def plant_in(monkeypatch, plant):
        original = getattr(earlier, name)

        def planted(first, *args, **kwargs):
            if condition(first):
                plant(first)
            return original(first, *args, **kwargs)

        monkeypatch.setattr(earlier, name, planted)
    plant_in.__name__ = f"_plant_{name}"
    return plant_in


EARLIER_PLANTS = [
    # three paths in one spec; a threshold whose limit is negative; a scenario file with an expected answer;
    # a stream that says [DONE] twice
    (_plant_in_earlier_suite("parse_paths", lambda spec: spec.count(",") >= 2), earlier.test_any_path_spec_parses_or_is_named, False),
    (_plant_in_earlier_suite("parse_threshold_overrides", lambda specs: any(":-" in s for s in specs)),
     earlier.test_any_run_threshold_parses_or_is_named, False),
    (_plant_in_earlier_suite("load_scenarios", lambda files: "expect" in Path(files[0]).read_text(errors="replace")),
     earlier.test_any_scenario_document_loads_or_is_named, True),
    (_plant_in_earlier_suite("assemble_event_stream", lambda stream: stream.count("[DONE]") >= 2),
     earlier.test_any_event_stream_assembles_or_is_named, False)]

PLANTS = [*EARLIER_PLANTS, (_plant_tasks, test_any_task_file_loads_or_is_named, True),
          (_plant_selection, test_any_selection_picks_or_is_named, False),
          (_plant_yardstick, test_any_yardstick_spec_parses_or_is_named, False),
          (_plant_reader, test_any_damaged_run_reads_or_is_named, True)]


@pytest.mark.parametrize("plant_in, fuzz_test, needs_scratch", PLANTS, ids=[p[0].__name__[7:] for p in PLANTS])
def test_a_planted_crash_is_caught(monkeypatch, scratch, plant_in, fuzz_test, needs_scratch):
    plant = Plant()
    plant_in(monkeypatch, plant)
    with pytest.raises(Exception) as failed:  # Planted, or hypothesis' flaky-failure group holding it
        fuzz_test(scratch) if needs_scratch else fuzz_test()
    assert plant.hits, "the fixed draw never reached the planted class of input"
    assert failed.group_contains(Planted) if isinstance(failed.value, BaseExceptionGroup) else \
        failed.type is Planted, failed.value
