"""The one reader of a stored run directory (docs/CONTRACTS.md): report, compare, summary, gate, the attention
views and the nightly trend read a run through `read_run(dir)` and nothing else.

A `RunView` loads each part when first asked for it (a summary never parses texts.jsonl) and keeps it:
the manifest (paths[] in the one shape, older runs normalised), the JSONL tables, records as a tidy frame
with NaN/inf restored, the verdicts (stored, or computed now by the functions that write them for a run
made before verdicts existed), the attention rows, the sensitivity map and the zoo's detection matrix.

A file that cannot be read raises `RunReadError`, whose message names the file and the line: a missing
manifest, a line that is not a JSON object. The last line of a table may be torn by a killed run; it
belongs to an unfinished unit and is skipped, as `--resume` drops it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from harness.analysis.strata import STRATA_SERIES, context_tokens_index, path_strata
from harness.analysis.verdicts import (
    DEFAULT_YARDSTICK,
    VERDICTS,
    Limit,
    compute_path_verdicts,
    compute_verdicts,
    parse_threshold_overrides,
    verdict_matrix,
)
from harness.files import file_kind
from harness.kv_paths.spec import PathSpecError, parse_path
from harness.records import decode_values

MANIFEST = "manifest.json"
RECORD_COLUMNS = ["model", "scenario", "scenario_hash", "kind", "tags", "path", "turn", "metric", "value"]
SERIES_COLUMNS = ["model", "scenario", "path", "turn", "series", "values"]
NONFINITE_TEXT = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
# Wall times runs before session 8 stored as 0.0 when they timed nothing (kv_paths/attention.KernelAgreement: a
# batch's kernel calls, some inside CUDA graphs, are not timed; it now leaves the metric out). No measured call takes
# 0 ms, so 0 reads as unmeasured (NaN).
ZERO_IS_UNMEASURED = ("kernel_ms_per_step",)

if TYPE_CHECKING:  # imported where a frame is made: a run's start has no use for it (`job.import_ahead`)
    import pandas as pd


class RunReadError(ValueError):
    """A run directory's file that cannot be read; the message names the file (and the line)."""


class IncompleteRunError(RuntimeError):
    """A stored run that did not finish every unit (killed, interrupted, units failed): no comparison stands
    on it (`harness compare` and `harness nightly` exit 3, docs/CONTRACTS.md)."""


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file: a missing file is empty, a torn last line (a killed run) is skipped, any other
    line that is not a JSON object is an error naming `file:line`."""
    return [row for _, row in numbered_rows(path)]


def numbered_rows(path: Path) -> list[tuple[int, dict]]:
    """`read_jsonl`'s rows with their line numbers."""
    path = Path(path)
    return _numbered(path, _text(path)) if path.exists() else []


def _numbered(path: Path, text: str) -> list[tuple[int, dict]]:
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                continue  # torn by a kill mid-write: its unit has no done line
            raise RunReadError(f"{path}:{number}: not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise RunReadError(f"{path}:{number}: a {type(row).__name__}, not a JSON object")
        rows.append((number, row))
    return rows


# The tables whose parsed, checked rows the readers in one process share, by content: `harness run` reads its run
# back three times (its verdicts, its report, its summary), and each reading parsed and checked every row again
# (0.33-0.38 s a reading of a default CPU run's records and series, this project's 2-core EPYC, session 36; the
# digest of their 5.6 MB takes ~10 ms). A reader gets shallow copies (no reader changes a row's lists in place).
SHARED_TABLES = ("records", "series")
SHARED_FILES = 4  # files kept, the last read
_SHARED: OrderedDict[tuple, list[dict]] = OrderedDict()


def checked_rows(path: Path, name: str) -> list[dict]:
    """The rows of table `name` at `path` ([] where it is missing), checked (`check_rows`)."""
    path = Path(path)
    if name not in SHARED_TABLES or not path.exists():
        numbered = numbered_rows(path)
        check_rows(path, name, numbered)
        return [row for _, row in numbered]
    text = _text(path)
    key = (name, hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest())
    rows = _SHARED.get(key)
    if rows is None:
        numbered = _numbered(path, text)
        check_rows(path, name, numbered)
        rows = _SHARED[key] = [row for _, row in numbered]
        while len(_SHARED) > SHARED_FILES:
            _SHARED.popitem(last=False)
    _SHARED.move_to_end(key)
    return [dict(row) for row in rows]


NUMBER_OR_NULL = (int, float, type(None))
NONFINITE_WORDS = ("nan", "inf", "-inf")  # what `records.encode_value` writes beside a null
UNIT = {"model": str, "scenario": str, "path": str}
# What the reader uses of each table's rows: field -> JSON types; a row without a field of ROW_FIELDS, or with any
# field here of another type, is a RunReadError naming file:line (a hand-edited or damaged run, never a traceback)
ROW_FIELDS = {"records": {**UNIT, "turn": int, "metric": str, "value": NUMBER_OR_NULL},
              "series": {**UNIT, "turn": int, "series": str, "values": list},
              "done": UNIT,
              "verdicts": {**UNIT, "turn": (int, type(None)), "verdict": str},  # null: a unit that errored whole
              "path_verdicts": {"model": str, "path": str},
              "judgements": {**UNIT, "turn": int, "metric": str, "value": NUMBER_OR_NULL},
              "checks": {**UNIT, "turn": int},
              "errors": UNIT}
OPTIONAL_FIELDS = {"value_text": (str, type(None)), "values_text": dict, "kind": (str, type(None)),
                   "tags": (list, type(None)), "reasons": list, "status": (str, type(None))}


def check_rows(path: Path, name: str, rows: list[tuple[int, dict]]) -> None:
    """RunReadError at the first row of table `name` that lacks a field the reader uses or holds one of another
    JSON type (a bool is not a number here)."""
    required = ROW_FIELDS.get(name)
    if required is None:
        return
    for number, row in rows:
        for field, kinds in required.items():
            if field not in row:
                raise RunReadError(f"{path}:{number}: no field {field!r}")
        for field, kinds in (*required.items(), *((f, k) for f, k in OPTIONAL_FIELDS.items() if f in row)):
            value = row[field]
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _types(kinds)):
                raise RunReadError(f"{path}:{number}: field {field!r} is {_json_type(value)}, not "
                                   f"{' or '.join(_json_type_name(k) for k in _types(kinds))}")
        if row.get("value_text") not in (None, *NONFINITE_WORDS):
            raise RunReadError(f"{path}:{number}: field 'value_text' is {row['value_text']!r}, not nan, inf or -inf")
        if name == "series":
            _check_series(path, number, row)
        if name in ("verdicts", "path_verdicts"):
            _check_verdict(path, number, row)


def _check_series(path: Path, number: int, row: dict) -> None:
    values = row["values"]
    if not all(isinstance(v, NUMBER_OR_NULL) and not isinstance(v, bool) for v in values):
        raise RunReadError(f"{path}:{number}: field 'values' holds something other than numbers and nulls")
    for index, text in (row.get("values_text") or {}).items():
        if not (isinstance(index, str) and index.isdigit() and int(index) < len(values)) or \
                text not in NONFINITE_WORDS:
            raise RunReadError(f"{path}:{number}: field 'values_text' entry {index!r}: {text!r} is not nan, inf or "
                               f"-inf at an index of 'values'")


def _check_verdict(path: Path, number: int, row: dict) -> None:
    if row.get("verdict", "pass") not in VERDICTS:
        raise RunReadError(f"{path}:{number}: field 'verdict' is {row['verdict']!r}, not one of {', '.join(VERDICTS)}")
    for index, reason in enumerate(row.get("reasons") or []):
        if not isinstance(reason, dict) or reason.get("severity") not in VERDICTS:
            raise RunReadError(f"{path}:{number}: field 'reasons[{index}]' is not an object with a severity of "
                               f"{', '.join(VERDICTS)}")


def _types(kinds) -> tuple:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _json_type(value) -> str:
    return "null" if value is None else f"a {_json_type_name(type(value))}"


def _json_type_name(kind: type) -> str:
    return {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object",
            type(None): "null"}.get(kind, kind.__name__)


def read_json(path: Path) -> dict | None:
    """A JSON object file (manifest.json, sensitivity.json, detection.json); None when it is not there."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        value = json.loads(_text(path))
    except json.JSONDecodeError as exc:
        raise RunReadError(f"{path}:{exc.lineno}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(value, dict):
        raise RunReadError(f"{path}: a {type(value).__name__}, not a JSON object")
    return value


def _text(path: Path) -> str:
    if (kind := file_kind(path)) != "regular file":  # a FIFO would block the read for a writer that never comes
        raise RunReadError(f"{path}: not a regular file (a {kind})")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise RunReadError(f"{path}:{line}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise RunReadError(f"{path}: cannot be read ({exc.strerror})") from None


# what every run's manifest has from its creation (RunStore.create): one of them makes a JSON object a manifest
IDENTIFYING = {"run_id", "status", "paths", "command", "versions", "started_at"}
MANIFEST_FIELDS = {"run_id": str, "status": str, "paths": list, "models": list, "scenarios": list,
                   "warnings": list, "verdicts": dict, "scales": dict, "noise_floor": dict, "verdict_thresholds": list,
                   "yardstick": str}


ENTRY_KEYS = {"paths": "name", "models": "label", "scenarios": "id"}  # what names each entry of these lists


def check_manifest_shape(file: Path, manifest: dict) -> None:
    """A RunReadError naming `file` and the field when the manifest is not a run's: none of its identifying fields,
    or a field the reader uses of the wrong JSON type (null is taken as absent)."""
    if not IDENTIFYING & set(manifest):
        raise RunReadError(f"{file}: none of {', '.join(sorted(IDENTIFYING))}: not a stored run's manifest")
    for name, kind in MANIFEST_FIELDS.items():
        value = manifest.get(name)
        if value is not None and not isinstance(value, kind):
            raise RunReadError(f"{file}: field {name!r} is a {type(value).__name__}, not a {kind.__name__}")
    if isinstance(manifest.get("verdicts"), dict):
        _check_matrix(file, manifest["verdicts"])
    for field, kind in (("paths", dict), ("models", dict), ("scenarios", dict), ("verdict_thresholds", str)):
        for number, entry in enumerate(manifest.get(field) or []):
            if not isinstance(entry, kind):
                raise RunReadError(f"{file}: field '{field}[{number}]' is {_json_type(entry)}, not "
                                   f"{_json_type_name(kind)}")
            key = ENTRY_KEYS.get(field)
            if key is not None and not isinstance(entry.get(key), str):
                raise RunReadError(f"{file}: field '{field}[{number}].{key}' is {_json_type(entry.get(key))}, not "
                                   f"a string")


def _check_matrix(file: Path, verdicts: dict) -> None:
    """manifest.verdicts is {model: {path: {verdict fields}}}."""
    for model, cells in verdicts.items():
        if not isinstance(cells, dict) or not all(isinstance(cell, dict) for cell in cells.values()):
            raise RunReadError(f"{file}: field 'verdicts.{model}' is not an object of one object per path")


def path_entry(entry: dict) -> dict:
    """One `manifest.paths[]` entry in the one shape: name, canonical, kind (`kv_path` | `endpoint`), a one-line
    description, and for a server what it was found to do under `endpoint`. Runs stored before that shape kept
    the server's detection as a dict under `description` and had no `kind`."""
    entry = dict(entry)
    described = entry.get("description")
    if isinstance(described, dict):
        served = described.get("model") or "the served model"
        entry["endpoint"] = entry.get("endpoint") or described
        entry["description"] = (f"endpoint {described.get('url')} serving {served} "
                                f"(KV cache as the server keeps it)")
        entry.setdefault("kind", "endpoint")
    entry.setdefault("kind", "kv_path")
    entry.setdefault("canonical", canonical_spec(entry.get("name", "")))
    entry["description"] = "" if entry.get("description") is None else str(entry["description"])
    return entry


def canonical_spec(name: str) -> str:
    """A path label's canonical spec (`fp8:calibrated` -> `fp8_e4m3:per_tensor:calibrated:sat`); an endpoint
    label or the reference is its own."""
    try:
        return parse_path(name).canonical
    except (PathSpecError, ValueError):
        return name


def finite_text(value):
    """NaN/inf inside verdict rows as the strings "nan" / "inf" / "-inf": JSON has no such numbers, and the
    reason's message already says what happened."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: finite_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_text(v) for v in value]
    return value


def yardstick_label(manifest: dict, spec: str | None = None) -> str:
    """The run's label for the yardstick path: the manifest's `yardstick`, else the default; matched to the
    run's paths by canonical spec (`fp8:calibrated` is `fp8_e4m3:calibrated`)."""
    wanted = spec or manifest.get("yardstick") or DEFAULT_YARDSTICK
    canonical = canonical_spec(wanted)
    return next((p["name"] for p in manifest.get("paths", []) if p.get("canonical") == canonical), wanted)


def threshold_overrides(manifest: dict) -> dict[str, Limit]:
    return parse_threshold_overrides(manifest.get("verdict_thresholds") or [])


def noise_models(manifest: dict) -> list[str]:
    """Random-weight models: their divergence is the noise the verdicts measure, not a finding."""
    return [m["label"] for m in manifest.get("models", []) if m.get("random_weights")]


class RunView:
    """A stored run, read lazily: each property reads its file(s) once. `renamed` maps path labels to the labels
    to read them as (compare pairs B's `fp8:` with A's `fp8_e4m3:`); every table, the manifest and the verdicts
    come back under the new labels."""

    def __init__(self, directory: Path | str, renamed: dict[str, str] | None = None) -> None:
        self.directory = Path(directory)
        self.renamed = dict(renamed or {})
        self._tables: dict[str, list[dict]] = {}

    def __repr__(self) -> str:
        return f"RunView({str(self.directory)!r})"

    # -- files ----------------------------------------------------------------------------------------------
    @cached_property
    def manifest(self) -> dict:
        if not self.directory.is_dir():
            raise RunReadError(f"{self.directory} is not a stored run: no such directory")
        manifest = read_json(self.directory / MANIFEST)
        if manifest is None:
            raise RunReadError(f"{self.directory} is not a stored run: no {MANIFEST}")
        check_manifest_shape(self.directory / MANIFEST, manifest)
        for name in MANIFEST_FIELDS:  # a null field is an absent one (check_manifest_shape), for every reader after
            if name in manifest and manifest[name] is None:
                del manifest[name]
        manifest.setdefault("status", None)
        manifest["paths"] = [self._entry(path_entry(p)) for p in manifest.get("paths") or []]
        if self.renamed and isinstance(manifest.get("verdicts"), dict):
            manifest["verdicts"] = {model: {self.label(p): cell for p, cell in (cells or {}).items()}
                                    for model, cells in manifest["verdicts"].items()}
        if manifest.get("yardstick"):
            manifest["yardstick"] = self.label(manifest["yardstick"])
        return manifest

    def _entry(self, entry: dict) -> dict:
        return entry | {"name": self.label(entry.get("name"))} if entry.get("name") in self.renamed else entry

    def label(self, path: str) -> str:
        return self.renamed.get(path, path)

    def has(self, name: str) -> bool:
        """Whether the run wrote `<name>.jsonl` at all."""
        return (self.directory / f"{name}.jsonl").exists()

    def table(self, name: str) -> list[dict]:
        """The rows of `<name>.jsonl` ([] when the run has none), path labels renamed."""
        if name not in self._tables:
            rows = checked_rows(self.directory / f"{name}.jsonl", name)
            if self.renamed:
                rows = [r | {"path": self.label(r["path"])} if r.get("path") in self.renamed else r for r in rows]
            self._tables[name] = rows
        return self._tables[name]

    @property
    def run_id(self) -> str:
        return str(self.manifest.get("run_id") or self.directory.name)

    @property
    def records(self) -> list[dict]:
        return self.table("records")

    @property
    def series(self) -> list[dict]:
        return self.table("series")

    @property
    def texts(self) -> list[dict]:
        return self.table("texts")

    @property
    def checks(self) -> list[dict]:
        return self.table("checks")

    @property
    def errors(self) -> list[dict]:
        return self.table("errors")

    @property
    def done(self) -> list[dict]:
        return self.table("done")

    @property
    def judgements(self) -> list[dict]:
        """judgements.jsonl (docs/CONTRACTS.md); judges.jsonl is the name runs of the first sessions wrote."""
        return self.table("judgements") or self.table("judges")

    @property
    def attention(self) -> list[dict]:
        """Sampled attention rows (`harness attention`, `--attention`)."""
        return self.table("attention")

    @property
    def attention_channels(self) -> list[dict]:
        return self.table("attention_channels")

    def units_done(self) -> int:
        """Distinct (model, scenario, path) units with a done line."""
        return len({(r.get("model"), r.get("scenario"), r.get("path")) for r in self.done})

    def units_expected(self) -> int:
        """The manifest's `units_expected`, else each model x scenario x (the reference and each path) as far as
        the manifest lists them (a run killed before its models loaded lists none)."""
        manifest = self.manifest
        if isinstance(manifest.get("units_expected"), int):
            return manifest["units_expected"]
        models, scenarios, paths = (len(manifest.get(key) or []) for key in ("models", "scenarios", "paths"))
        return models * scenarios * (1 + paths)

    def incomplete(self) -> str | None:
        """Why this run is not complete (its status and units done of expected), or None when it is."""
        status = self.manifest.get("status")
        if status == "complete":
            return None
        done, expected = self.units_done(), self.units_expected()
        return (f"run {self.directory} is incomplete (status {status or 'missing'}): {done} of {expected} units "
                f"done; finish it with `harness run --resume --out {self.directory}`")

    @cached_property
    def sensitivity(self) -> dict | None:
        """`harness sensitivity`'s per-layer map, when this run wrote one."""
        return read_json(self.directory / "sensitivity.json")

    @cached_property
    def detection(self) -> dict | None:
        """`harness zoo`'s detection matrix, when this run is a zoo run."""
        return read_json(self.directory / "detection.json")

    # -- frames ---------------------------------------------------------------------------------------------
    @cached_property
    def records_frame(self) -> pd.DataFrame:
        """One row per (model, scenario, path, turn, metric); `value` a float with inf / -inf / NaN restored from
        the store's null + `value_text`, and NaN where nothing was measured (`ZERO_IS_UNMEASURED`)."""
        import pandas as pd

        frame = pd.DataFrame(self.records)
        for column in RECORD_COLUMNS:
            if column not in frame:
                frame[column] = None
        frame["value"] = pd.to_numeric(frame["value"], errors="coerce").astype(float)
        if "value_text" in frame:
            special = frame["value_text"].map(NONFINITE_TEXT)
            frame["value"] = frame["value"].where(frame["value_text"].isna(), special)
        untimed = frame["metric"].isin(ZERO_IS_UNMEASURED) & (frame["value"] == 0)
        frame.loc[untimed, "value"] = math.nan
        frame["turn"] = frame["turn"].astype(int)
        frame["kind"] = frame["kind"].fillna("")
        return frame

    @cached_property
    def series_frame(self) -> pd.DataFrame:
        """Per-token series, one row per (model, scenario, path, turn, series); values with NaN/inf restored."""
        import pandas as pd

        return pd.DataFrame([{**row, "values": decode_values(row)} for row in self.series], columns=SERIES_COLUMNS)

    @cached_property
    def attention_frame(self) -> pd.DataFrame:
        """Sampled attention rows as a frame (empty when the run captured no attention)."""
        import pandas as pd

        return pd.DataFrame(self.attention)

    @cached_property
    def attention_channels_frame(self) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame(self.attention_channels)

    # -- verdicts -------------------------------------------------------------------------------------------
    def computed_verdicts(self, overrides: dict[str, Limit] | None = None) -> list[dict]:
        """Per-turn verdict rows computed now from the stored rows (what `gate.write_verdicts` stores)."""
        manifest = self.manifest
        sources = {s["id"]: s.get("source", "scenario file") for s in manifest.get("scenarios", [])}
        return compute_verdicts(self.records, self.checks, self.judgements, self.errors,
                                threshold_overrides(manifest) if overrides is None else overrides, sources,
                                noise_models(manifest), yardstick_label(manifest))

    def computed_path_verdicts(self, overrides: dict[str, Limit] | None = None) -> list[dict]:
        manifest = self.manifest
        kl_series = [row for row in self.series if row.get("series") in STRATA_SERIES]  # kl, and flip for the strata
        return compute_path_verdicts(self.records, self.judgements, kl_series,
                                     threshold_overrides(manifest) if overrides is None else overrides,
                                     noise_models(manifest), yardstick_label(manifest))

    @cached_property
    def position_strata(self) -> dict[tuple, dict]:
        """(model, path) -> {"strata": KL and flips by generation and context position, "length_trend": the trend
        test against the yardstick} (analysis/strata.py, what path_verdicts' numbers hold), computed from the series
        and records, so a run written before the strata existed has them too."""
        return path_strata(self.series, context_tokens_index(self.records), yardstick_label(self.manifest))

    @cached_property
    def verdicts(self) -> list[dict]:
        """verdicts.jsonl, or for a run made before verdicts existed, computed now."""
        if self.has("verdicts"):
            return self.table("verdicts")
        return finite_text(self.computed_verdicts())

    @cached_property
    def path_verdicts(self) -> list[dict]:
        if self.has("path_verdicts"):
            return self.table("path_verdicts")
        return finite_text(self.computed_path_verdicts())

    @cached_property
    def matrix(self) -> dict:
        """Models x paths: the manifest's `verdicts` when it holds both questions, else computed from the rows."""
        stored = self.manifest.get("verdicts")
        if isinstance(stored, dict) and all("questions" in cell for cells in stored.values()
                                            for cell in cells.values()):
            return stored
        return finite_text(verdict_matrix(self.verdicts, self.path_verdicts))


def require_complete(view: RunView) -> RunView:
    """`view`, or `IncompleteRunError` naming the run and its units done of expected."""
    if problem := view.incomplete():
        raise IncompleteRunError(problem)
    return view


def read_run(directory: Path | str, renamed: dict[str, str] | None = None) -> RunView:
    """The run at `directory`, read lazily; the manifest is read now, so a directory that is not a run fails here."""
    view = RunView(directory, renamed)
    view.manifest  # noqa: B018 - fail on a missing or broken manifest before anything else is computed
    return view
