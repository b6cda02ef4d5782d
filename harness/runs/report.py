"""Render a stored run (`docs/CONTRACTS.md`) as one self-contained HTML directory, and export its records.

Reads only the run directory, never live objects, so any run can be re-rendered without a GPU. The
output directory holds `index.html`, one page per scenario and the PNG plots; CSS and JS are inline,
nothing is fetched from the network, and every model- or user-written string goes through jinja2's
autoescaping (a Content-Security-Policy that admits only the report's own script backs that up).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.resources
import math
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import pandas as pd

from harness.records import METRIC_DIRECTIONS
from harness.runs.read import RunView, read_run
from harness.runs.report_views import (
    STATE,
    case_verdicts,
    kv_rows,
    reason_text,
    sparkline,
    turn_verdicts,
    path_checks,
    verdict_matrix_view,
    verdict_turns,
)

TEMPLATES = Path(str(importlib.resources.files("reports") / "templates"))  # shipped as package data
REFERENCE = "reference"
SUMMARY_METRICS = ["kl_mean", "kl_max", "top1_agree", "answer_correct", "rules_followed"]
# Summary aggregates over a scenario's turns; anything not listed is the mean.
AGGREGATE = {"kl_max": "max", "ref_rank_max": "max", "ref_logprob_delta_min": "min"}

# Colour levels (ok, fail) per metric for the summary cells when the run stores no thresholds of its own.
# "lower" metrics: value <= ok is good, value > fail is bad; "higher": value >= ok good, value < fail bad.
DEFAULT_LEVELS: dict[str, tuple[float, float]] = {
    "kl_mean": (0.01, 0.05),       # nats per token
    "kl_max": (0.1, 0.5),
    "top1_agree": (0.99, 0.9),
    "exact_match": (1.0, 0.5),
    "common_prefix_frac": (1.0, 0.5),
    "answer_correct": (1.0, 1.0),  # any wrong answer is a failure
    "rules_followed": (1.0, 1.0),
    "ref_logprob_delta_mean": (-0.01, -0.1),
    "ref_rank_mean": (0.01, 0.1),
}
PREFIX_LEVELS = {"judge_pairwise": (0.5, 0.25),  # candidate vs reference: 1 win, 0.5 tie, 0 loss
                 "judge_": (4.0, 3.0),  # judge scores on a 1-5 scale
                 "attn_": (0.05, 0.2)}  # relative attention-output error


def metric_direction(metric: str) -> str | None:
    """'higher' or 'lower' is better; judge_* scores are higher-better, attn_* errors lower-better."""
    if metric in METRIC_DIRECTIONS:
        return METRIC_DIRECTIONS[metric] if METRIC_DIRECTIONS[metric] in ("higher", "lower") else None
    if metric.startswith("judge_"):
        return "higher"
    if metric.startswith("attn_"):
        return "lower"
    return None


def is_worse(metric: str, delta: float) -> bool:
    direction = metric_direction(metric)
    return (direction == "lower" and delta > 0) or (direction == "higher" and delta < 0)


# ---------------------------------------------------------------- loading a stored run


@dataclass(frozen=True)
class StoredRun:
    run_dir: Path
    manifest: dict
    records: pd.DataFrame  # model scenario scenario_hash kind tags path turn metric value
    series: pd.DataFrame  # model scenario path turn series values
    texts: dict[tuple, dict]  # (model, scenario, path, turn) -> texts.jsonl row
    judges: list[dict]  # judgements.jsonl: key + metric, value, status, reason, judge_model
    errors: list[dict]
    checks: list[dict]  # scenario threshold checks: key + metric, value, limit, passed, message
    verdicts: list[dict] = ()  # verdicts.jsonl rows (key + verdict, reasons), or computed for an older run
    view: RunView | None = None  # the reader these parts came from: path verdicts, matrix, attention rows

    @property
    def run_id(self) -> str:
        return str(self.manifest.get("run_id") or self.run_dir.name)

    def text(self, model: str, scenario: str, path: str, turn: int) -> dict | None:
        return self.texts.get((model, scenario, path, int(turn)))

    # Lookups by (model, scenario, path, turn), built once: a report asks for every case.
    @cached_property
    def _values(self) -> dict[tuple, dict[str, float]]:
        out: dict[tuple, dict[str, float]] = {}
        for model, scenario, path, turn, metric, value in self.records[
                ["model", "scenario", "path", "turn", "metric", "value"]].itertuples(index=False):
            out.setdefault((model, scenario, path, int(turn)), {})[metric] = value
        return out

    @cached_property
    def _series(self) -> dict[tuple, list]:
        return {(m, s, p, int(t), name): v for m, s, p, t, name, v in
                self.series[["model", "scenario", "path", "turn", "series", "values"]].itertuples(index=False)}

    @cached_property
    def _limits(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for check in self.checks:
            if check.get("limit") is not None:
                out.setdefault(check.get("scenario"), {})[check["metric"]] = float(check["limit"])
        return out

    @cached_property
    def _turns(self) -> dict[tuple, set[int]]:
        out: dict[tuple, set[int]] = {}
        for model, scenario, _, turn in list(self._values) + list(self.texts):
            out.setdefault((model, scenario), set()).add(int(turn))
        return out

    @cached_property
    def vocabulary(self) -> dict[tuple[str, int], str]:
        """(model, token id) -> its text, from every stored reply (the run stores no tokenizer)."""
        out = {}
        for (model, *_), row in self.texts.items():
            for token_id, token in zip(row.get("token_ids") or [], row.get("tokens") or []):
                out[(model, int(token_id))] = token
        return out

    @cached_property
    def turn_verdicts(self) -> dict[tuple, dict]:
        """(model, scenario, path, turn) -> verdict row."""
        return turn_verdicts(list(self.verdicts))

    def turns(self, model: str, scenario: str) -> list[int]:
        return sorted(self._turns.get((model, scenario), ()))

    def values(self, model: str, scenario: str, path: str, turn: int) -> dict[str, float]:
        return self._values.get((model, scenario, path, int(turn)), {})

    def kl_series(self, model: str, scenario: str, path: str, turn: int) -> list[float]:
        return self.series_values(model, scenario, path, turn, "kl")

    def series_values(self, model: str, scenario: str, path: str, turn: int, name: str) -> list[float]:
        """A per-token series; null entries (the store's NaN/inf without a text) read as NaN."""
        return [decode_number(v) for v in self._series.get((model, scenario, path, int(turn), name)) or []]

    @cached_property
    def _failed(self) -> dict[tuple, list[dict]]:
        out: dict[tuple, list[dict]] = {}
        for check in self.checks:
            if check.get("passed") is False:
                out.setdefault((check.get("model"), check.get("scenario"), check.get("path")), []).append(check)
        return out

    @cached_property
    def _judges(self) -> dict[tuple, list[dict]]:
        out: dict[tuple, list[dict]] = {}
        for row in self.judges:
            out.setdefault((row.get("model"), row.get("scenario"), row.get("path"), row.get("turn")), []).append(row)
        return out

    def failed_checks(self, model: str | None = None, scenario: str | None = None,
                      path: str | None = None) -> list[dict]:
        """Failed scenario-threshold checks; all of them, or one (model, scenario, path)'s."""
        if model is None:
            return [c for rows in self._failed.values() for c in rows]
        return self._failed.get((model, scenario, path), [])

    def judge_rows(self, model: str, scenario: str, path: str, turn: int) -> list[dict]:
        return self._judges.get((model, scenario, path, turn), [])

    def scenario_limits(self, scenario: str) -> dict[str, float]:
        """The scenario's own thresholds, as the runner's checks applied them."""
        return self._limits.get(scenario, {})


def load_run(run_dir: Path | str, renamed: dict[str, str] | None = None) -> StoredRun:
    """The stored run as the report and compare index it, read by the one reader (`harness.runs.read`);
    `renamed` reads path labels under other labels (compare pairs paths by canonical spec)."""
    view = read_run(run_dir, renamed)
    texts = {(r["model"], r["scenario"], r["path"], int(r["turn"])): r for r in view.texts}
    return StoredRun(view.directory, view.manifest, view.records_frame, view.series_frame, texts, view.judgements,
                     view.errors, view.checks, view.verdicts, view)


# ---------------------------------------------------------------- values, levels, colours


def decode_number(value) -> float:
    """A stored number: float, null (NaN), or the store's text form of a non-finite value."""
    if value is None:
        return math.nan
    if isinstance(value, str):
        return {"inf": math.inf, "-inf": -math.inf}.get(value, math.nan)
    if isinstance(value, dict):  # {"value": null, "value_text": "inf"}
        return decode_number(value.get("value_text") if value.get("value") is None else value.get("value"))
    return float(value)


def is_missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def format_value(value) -> str:
    if is_missing(value):
        return "—"
    value = float(value)
    if not math.isfinite(value):
        return str(value)  # inf, -inf: a real result (a KL of inf), never hidden
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    if abs(value) < 1e-3:
        return f"{value:.1e}"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def levels_for(metric: str, limits: dict[str, float]) -> tuple[tuple[float, float], str] | None:
    """(ok, fail) colour levels and where they came from: the scenario's own threshold first, then defaults."""
    if metric in limits and not is_missing(limits[metric]):
        return (limits[metric], limits[metric]), "the scenario's threshold"
    if metric in DEFAULT_LEVELS:
        return DEFAULT_LEVELS[metric], "report default"
    prefix = next((p for p in PREFIX_LEVELS if metric.startswith(p)), None)
    return (PREFIX_LEVELS[prefix], "report default") if prefix else None


def grade(metric: str, value, limits: dict[str, float] | None = None) -> tuple[str, str]:
    """('good' | 'warn' | 'bad' | 'none', tooltip) for one cell; `limits` are the scenario's thresholds."""
    direction, found = metric_direction(metric), levels_for(metric, limits or {})
    if is_missing(value) or direction is None or found is None:
        return "none", f"{metric}: {format_value(value)}"
    (ok, fail), source = found
    v = float(value)
    if direction == "lower":
        state = "good" if v <= ok else "bad" if v > fail else "warn"
        rule = f"lower is better; good <= {format_value(ok)}, bad > {format_value(fail)}"
    else:
        state = "good" if v >= ok else "bad" if v < fail else "warn"
        rule = f"higher is better; good >= {format_value(ok)}, bad < {format_value(fail)}"
    return state, f"{metric} {format_value(v)}: {state} ({rule}; {source})"


def kl_colour(value: float) -> str:
    """Cell colour for the per-token KL strip: grey at 0, pale yellow at 1e-4 nats, deep red from 1 nat."""
    if is_missing(value):
        return "#ddd"
    if value <= 0:
        return "#e8efe8"
    t = min(1.0, max(0.0, (math.log10(value) + 4) / 4))  # 1e-4 -> 0, 1 -> 1
    return f"hsl({int(50 - 50 * t)}, 90%, {int(88 - 48 * t)}%)"


def slug(text: str) -> str:
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.")[:48] or "x"
    return f"{readable}-{hashlib.sha1(text.encode()).hexdigest()[:6]}"


def first_difference(a: list, b: list) -> int | None:
    """Index of the first token where two sequences differ (a prefix differs at its end); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def token_view(row: dict | None, divergent_at: int | None) -> list[dict]:
    """Tokens of one reply, each marked 'same', 'first-div' or 'after' relative to the divergence."""
    if row is None:
        return []
    tokens = row.get("tokens") or [row.get("text", "")]
    ids = row.get("token_ids") or [None] * len(tokens)
    marks = ["same" if divergent_at is None or i < divergent_at else "first-div" if i == divergent_at else "after"
             for i in range(len(tokens))]
    # a token that decodes to nothing still gets a visible mark, or its highlight would vanish
    return [{"text": t if t else f"\u27e8{ids[i] if i < len(ids) else '?'}\u27e9", "mark": m, "index": i,
             "empty": not t} for i, (t, m) in enumerate(zip(tokens, marks))]


def token_key(row: dict | None) -> list:
    if row is None:
        return []
    return list(row.get("token_ids") or row.get("tokens") or [row.get("text", "")])


# ---------------------------------------------------------------- summary table


def summary_metric_names(records: pd.DataFrame) -> list[str]:
    names = set(records["metric"])
    extra = sorted(m for m in names if m.startswith("judge_")) + sorted(m for m in names if m.startswith("attn_"))
    return [m for m in SUMMARY_METRICS if m in names] + extra


def summary_rows(run: StoredRun) -> list[dict]:
    """One row per (model, scenario, path): the key numbers, graded, and a worst-state for sorting."""
    metrics, records = summary_metric_names(run.records), run.records
    stats = (records.dropna(subset=["value"]).groupby(["model", "scenario", "path", "metric"])["value"]
             .agg(["mean", "max", "min"]).to_dict("index"))
    divergences = first_divergences(records)
    canonical = {p.get("name"): p.get("canonical", "") for p in run.manifest.get("paths", [])}
    rows = []
    cases = records.drop_duplicates(["model", "scenario", "path"])[
        ["model", "scenario", "path", "kind", "scenario_hash"]]
    for model, scenario, path, kind, scenario_hash in cases.itertuples(index=False):
        cells = {}
        for metric in metrics:
            found = stats.get((model, scenario, path, metric))
            value = None if found is None else found[AGGREGATE.get(metric, "mean")]
            state, tip = grade(metric, value, run.scenario_limits(scenario))
            cells[metric] = {"value": value, "text": format_value(value), "state": state, "tip": tip}
        divergence = first_divergence(divergences.get((model, scenario, path), False), path,
                                      canonical.get(path, path))
        failed = run.failed_checks(model, scenario, path)
        states = [c["state"] for c in cells.values()] + [divergence["state"]] + ["bad"] * bool(failed)
        worst = "bad" if "bad" in states else "warn" if "warn" in states else "good"
        rows.append({"model": model, "scenario": scenario, "path": path, "kind": kind, "scenario_hash": scenario_hash,
                     "cells": cells, "divergence": divergence, "worst": worst,
                     "worst_rank": {"good": 0, "warn": 1, "bad": 2}[worst],
                     "failed_checks": [{"metric": c.get("metric"), "message": c.get("message") or
                                        f"{c.get('metric')} failed"} for c in failed],
                     "page": scenario_page_name(model, scenario)})
    add_verdicts(rows, case_verdicts(list(run.verdicts)))
    return sorted(rows, key=lambda r: (r["model"], r["scenario"], r["path"] != REFERENCE, r["path"]))


def add_verdicts(rows: list[dict], verdicts: dict[tuple, dict]) -> None:
    """The row's state is its verdict (worst over its turns) when the run has verdicts: one meaning of failure.
    Without verdicts (a run the verdict function cannot read) the metric grades stand, labelled as such."""
    for row in rows:
        found = verdicts.get((row["model"], row["scenario"], row["path"]))
        row["verdict_reasons"] = found["reasons"] if found else []
        if found:
            row["verdict"], row["worst"] = found["verdict"], found["state"]
        else:
            row["verdict"] = "reference" if row["path"] == REFERENCE else f"{row['worst']} (metrics)"
            row["worst"] = "none" if row["path"] == REFERENCE else row["worst"]
        row["worst_rank"] = {"none": -1, "good": 0, "warn": 1, "bad": 2}[row["worst"]]


def first_divergences(records: pd.DataFrame) -> dict[tuple, tuple[int, int] | None]:
    """(model, scenario, path) -> (turn, token) of the first divergence, None where measured and never diverged."""
    measured = records[records.metric == "first_divergent_token"]
    out: dict[tuple, tuple[int, int] | None] = {key: None for key in
                                                measured[["model", "scenario", "path"]].itertuples(index=False)}
    hits = measured.dropna(subset=["value"]).sort_values("turn").drop_duplicates(["model", "scenario", "path"])
    for model, scenario, path, turn, token in hits[["model", "scenario", "path", "turn", "value"]].itertuples(
            index=False):
        out[(model, scenario, path)] = (int(turn), int(token))
    return out


def first_divergence(hit: tuple[int, int] | None | bool, path: str, canonical: str) -> dict:
    """The summary cell for the first turn whose free-running reply left the reference, and the token."""
    if path == REFERENCE:
        return {"turn": None, "token": None, "text": "", "state": "none", "sort": "", "tip": "the reference"}
    if hit is None:
        return {"turn": None, "token": None, "text": "none", "state": "good", "sort": 1e9,
                "tip": "never diverged from the reference"}
    if hit is False:
        return {"turn": None, "token": None, "text": "—", "state": "none", "sort": 1e9, "tip": "not measured"}
    turn, token = hit
    bf16 = canonical.startswith("bf16")  # a BF16 cache must be bit-identical to the reference (class 3)
    # an FP8 path may diverge and still pass: the cell informs (the verdict judges), only bf16 must not
    return {"turn": turn, "token": token, "text": f"turn {turn}, token {token}", "state": "bad" if bf16 else "none",
            "sort": turn * 100_000 + token,
            "tip": ("a bf16 path must never diverge from the reference" if bf16 else
                    f"free-running reply first differs at turn {turn}, token {token}")}


def scenario_page_name(model: str, scenario: str) -> str:
    return f"scenario-{slug(model + '--' + scenario)}.html"


def headline(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Failing cells: (those where the reference passes, i.e. the cache's doing; those failing only what
    the reference fails too, i.e. the model's). The first list is what an engineer must see first."""
    reference_bad = {(r["model"], r["scenario"]): bad_metrics(r) for r in rows if r["path"] == REFERENCE}
    own, shared = [], []
    for row in rows:
        bad = bad_metrics(row)
        reasons = [f"{m} {row['cells'][m]['text']}" for m in row["cells"] if m in bad]
        reasons += [f"check failed: {c['message']}" for c in row["failed_checks"] if c["metric"] not in row["cells"]]
        if row["divergence"]["state"] == "bad":
            reasons.insert(0, f"diverged at {row['divergence']['text']}")
        if not reasons:
            continue
        like_reference = row["path"] == REFERENCE or (
            row["divergence"]["state"] != "bad" and bad <= reference_bad.get((row["model"], row["scenario"]), set()))
        (shared if like_reference else own).append({"row": row, "reasons": ", ".join(reasons)})
    return own, shared


def bad_metrics(row: dict) -> set[str]:
    return ({m for m, c in row["cells"].items() if c["state"] == "bad"}
            | {c["metric"] for c in row["failed_checks"]})


# ---------------------------------------------------------------- scenario pages


def scenario_turns(run: StoredRun, model: str, scenario: str, paths: list[str]) -> list[dict]:
    """For each turn: the user message, the reference reply, and one side-by-side block per path."""
    paths = [p for p in paths if p != REFERENCE]
    out = []
    for turn in run.turns(model, scenario):
        reference = run.text(model, scenario, REFERENCE, turn)
        fixed = bool((reference or {}).get("fixed"))  # a scenario's fixed reply: history, not generated
        blocks = [] if fixed else [path_block(run, model, scenario, path, turn, reference) for path in paths]
        out.append({"turn": turn, "user": (reference or {}).get("user", ""), "fixed": fixed,
                    "reference": reference, "reference_checks": turn_checks(run, model, scenario, REFERENCE, turn),
                    "reference_judges": judges_for(run, model, scenario, REFERENCE, turn),
                    "blocks": [b for b in blocks if b is not None]})
    return out


def path_block(run: StoredRun, model: str, scenario: str, path: str, turn: int, reference: dict | None) -> dict | None:
    row = run.text(model, scenario, path, turn)
    if row is None and reference is None:
        return None
    at = first_difference(token_key(reference), token_key(row)) if row is not None else None
    kl = run.kl_series(model, scenario, path, turn)
    reference_tokens = token_view(reference, at)
    for i, token in enumerate(reference_tokens):  # KL under the very token it was measured on
        value = kl[i] if i < len(kl) else None
        token["kl"] = None if value is None else {"colour": kl_colour(value), "text": format_value(value)}
    charts = [{"name": name, "unit": unit, **sparkline(run.series_values(model, scenario, path, turn, series), at,
                                                        format_value, log)}
              for series, name, unit, log in TOKEN_CHARTS]
    finite = [v for v in kl if not math.isnan(v)]
    verdict = run.turn_verdicts.get((model, scenario, path, turn))
    return {"path": path, "row": row, "diverged_at": at, "identical": row is not None and at is None,
            "candidates": candidate_view(run, model, (row or {}).get("candidates_at_divergence"), reference, row),
            "reference_tokens": reference_tokens, "path_tokens": token_view(row, at),
            "has_kl": bool(kl), "charts": [c for c in charts if c["points"] or c["marks"]],
            "kl_max": format_value(max(finite) if finite else None),
            "verdict": None if verdict is None else {"verdict": verdict["verdict"],
                                                     "state": STATE[verdict["verdict"]],
                                                     "reasons": reason_text(verdict)},
            "checks": turn_checks(run, model, scenario, path, turn),
            "failed_checks": [c.get("message") for c in run.failed_checks(model, scenario, path)
                              if c.get("turn") == turn],
            "judges": judges_for(run, model, scenario, path, turn)}


def candidate_view(run: StoredRun, model: str, stored: dict | None, reference: dict | None,
                   row: dict | None) -> dict | None:
    """The top next-token candidates of reference and path at the first divergent token, as probabilities,
    the reference's own token and the path's marked."""
    if not stored:
        return None
    at = stored["position"]
    chosen = {"reference": (token_key(reference) or [None] * (at + 1))[at:at + 1],
              "path": (token_key(row) or [None] * (at + 1))[at:at + 1]}

    def side(name: str) -> list[dict]:
        out = []
        for token_id, logprob in stored[name]:
            text = run.vocabulary.get((model, int(token_id)), f"\u27e8{token_id}\u27e9")
            out.append({"text": text, "id": token_id, "p": "—" if logprob is None else f"{math.exp(logprob):.3f}",
                        "is_reference": [token_id] == chosen["reference"], "is_path": [token_id] == chosen["path"]})
        return out

    return {"position": at, "reference": side("reference"), "path": side("path")}


TOKEN_CHARTS = [("kl", "KL(reference || path)", "nats, log", True),
                ("ref_logprob_delta", "change in the reference token's log-prob", "nats", False),
                ("ref_rank", "rank of the reference token under the path", "0 = top", False)]


def turn_checks(run: StoredRun, model: str, scenario: str, path: str, turn: int) -> list[dict]:
    values = run.values(model, scenario, path, turn)
    shown = ["first_divergent_token", "kl_mean", "kl_max", "top1_agree", "answer_correct", "rules_followed"]
    out = []
    for metric in shown + sorted(m for m in values if m.startswith(("judge_", "attn_"))):
        if metric in values:
            state, tip = grade(metric, values[metric], run.scenario_limits(scenario))
            out.append({"metric": metric, "text": format_value(values[metric]), "state": state, "tip": tip})
    return out


def judges_for(run: StoredRun, model: str, scenario: str, path: str, turn: int) -> list[dict]:
    """Judge verdicts on one reply, with their reasons (rows as `Verdict.as_row()` plus the key)."""
    return [{"judge": j.get("metric", "judge"), "score": format_value(j.get("value")),
             "status": j.get("status", "ok"), "reason": j.get("reason", ""), "judge_model": j.get("judge_model")}
            for j in run.judge_rows(model, scenario, path, turn)]


def path_order(run: StoredRun) -> list[str]:
    """The reference, then paths in the manifest's order, then any others the records name."""
    present = set(run.records["path"]) | {k[2] for k in run.texts}
    declared = [p.get("name") for p in run.manifest.get("paths", [])]
    ordered = dict.fromkeys(declared + sorted(present))
    return [REFERENCE] + [p for p in ordered if p != REFERENCE and p in present]


# ---------------------------------------------------------------- rendering


def environment():
    """jinja2 environment with autoescaping on for every template, whatever its extension."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["fmt"] = format_value
    env.filters["tokens_html"] = tokens_html
    return env


def tokens_html(view: list[dict]):
    """A reply's tokens (`token_view`) as marked spans: what the `tokens` macro of _macros.html renders, built here
    (a template loop per token made the report's largest cost: 882 replies, ~2 s of a default run's report)."""
    from markupsafe import Markup, escape

    spans = []
    for t in view:
        kl = t.get("kl")
        classes = f"tok {t['mark']}{' empty' if t['empty'] else ''}{' kl' if kl else ''}"
        style = f' style="border-bottom-color: {escape(kl["colour"])}"' if kl else ""
        title = f"token {t['index']}{' (decodes to nothing)' if t['empty'] else ''}" + (f", KL {kl['text']}" if kl else "")
        spans.append(f'<span class="{escape(classes)}"{style} title="{escape(title)}">{escape(t["text"])}</span>')
    return Markup("".join(spans))


@lru_cache(maxsize=1)
def page_assets() -> dict:
    """Inline CSS and JS, and a CSP that admits only this exact script (hash) and local images."""
    from markupsafe import Markup

    script = (TEMPLATES / "_table.js").read_text(encoding="utf-8")
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    csp = (f"default-src 'none'; img-src 'self' data: file:; style-src 'unsafe-inline'; "
           f"script-src 'sha256-{digest}'; form-action 'none'; base-uri 'none'")
    return {"style": Markup((TEMPLATES / "_style.css").read_text(encoding="utf-8")), "script": Markup(script),
            "csp": csp}


def write_page(env, out_dir: Path, name: str, template: str, **context) -> Path:
    path = out_dir / name
    path.write_text(env.get_template(template).render(assets=page_assets(), **context), encoding="utf-8")
    return path


def scale_summary(summary) -> str:
    if isinstance(summary, dict):
        return " ".join(f"{k} {format_value(v) if isinstance(v, (int, float)) else v}" for k, v in summary.items())
    return "—" if summary is None else str(summary)


def readable(value) -> str:
    """A manifest value as text a reader scans: `key: value` pairs, lists joined, numbers formatted; no JSON."""
    if value is None:
        return "—"
    if isinstance(value, (bool, str)):
        return str(value)
    if isinstance(value, (int, float)):
        return format_value(value)
    if isinstance(value, dict):
        return "; ".join(f"{k}: {readable(v)}" for k, v in value.items()) or "—"
    if isinstance(value, (list, tuple)):
        if len(value) > 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in value) \
                and list(value) == list(range(value[0], value[0] + len(value))):
            return f"{value[0]}–{value[-1]} ({len(value)})"  # layer lists: 0–5 (6)
        return ", ".join(readable(v) for v in value) or "—"
    return str(value)


def manifest_view(manifest: dict) -> dict:
    """The manifest as tables: scales with their provenance, noise floor, models, scenarios, the rest."""
    scales = []
    for model, by_path in (manifest.get("scales") or {}).items():
        for path, described in (by_path or {}).items():
            described = described if isinstance(described, dict) else {"value": described}
            rest = {k: v for k, v in described.items() if k not in ("source", "provenance", "k_scale", "v_scale",
                                                                    "k_scale_per_layer", "v_scale_per_layer")}
            scales.append({"model": model, "path": path, "source": described.get("source", "—"),
                           "provenance": described.get("provenance", ""),
                           "k_scale": scale_summary(described.get("k_scale")),
                           "v_scale": scale_summary(described.get("v_scale")),
                           "detail": readable(rest)})
    noise = [{"model": m, "metric": k, "value": format_value(v), "zero": not v}
             for m, metrics in (manifest.get("noise_floor") or {}).items() for k, v in (metrics or {}).items()]
    shown = {"paths", "scales", "noise_floor", "models", "scenario_files", "versions", "scenarios", "warnings",
             "verdicts", "families", "control_floor"}  # verdicts: the headline matrix; the rest: their own tables
    fields = [(k, readable(v)) for k, v in manifest.items() if k not in shown]
    return {"scales": scales, "noise": noise, "noise_zero": all(n["zero"] for n in noise), "fields": fields,
            "paths": manifest.get("paths", []), "models": manifest.get("models", []),
            "families": families_view(manifest.get("families") or {}),
            "control": control_view(manifest.get("control_floor") or {}),
            "scenario_files": manifest.get("scenario_files", []), "scenarios": manifest.get("scenarios", []),
            "warnings": manifest.get("warnings") or [], "versions": manifest.get("versions") or {}}


def control_view(floors: dict) -> list[dict]:
    """Per model, the control arm's floor (harness.analysis.verdicts.control_floors) as table cells."""
    def cell(value, how="{:.3g}") -> str:
        return "—" if value is None else how.format(value)

    rows = []
    for model, floor in sorted(floors.items()):
        length = floor.get("length") or {}
        rows.append({"model": model, "path": floor.get("path", ""), "kl_mean": cell(floor.get("kl_mean")),
                     "exact_match": cell(floor.get("exact_match"), "{:.1%}"),
                     "top1_agree": cell(floor.get("top1_agree"), "{:.2%}"),
                     "confident_flips": cell(floor.get("confident_flips")),
                     "length_ratio": cell(length.get("ratio"), "{:.3f}"), "length_p": cell(length.get("p_value"), "{:.2g}"),
                     "zero": not floor.get("kl_mean") and floor.get("exact_match") in (None, 1.0)})
    return rows


def families_view(families: dict) -> list[dict]:
    """Per model: its family, attention kinds, the layers stored in FP8, those kept in BF16 and why, and what the
    family turns off (decode kernels, graph decode), as `manifest.families` holds them (replay/families.py)."""
    rows = []
    for label, facts in families.items():
        kept = facts.get("kept_bf16") or {}
        off = [f"{what}: {facts[key]}" for what, key in (("decode kernels", "decode_kernels"),
                                                         ("graph decode", "graph_decode")) if facts.get(key)]
        rows.append({"model": label, "family": facts.get("family"), "attention": ", ".join(facts.get("attention") or []),
                     "fp8_layers": ", ".join(map(str, facts.get("fp8_layers") or [])) or "none",
                     "kept_bf16": "; ".join(f"layer {layer}: {why}" for layer, why in kept.items()) or "none",
                     "off": "; ".join(off)})
    return rows


def strata_view(run: StoredRun) -> list[dict]:
    """Divergence by the reference's entropy and by context position, per model and path (the series
    decoded at load time, so NaN/inf are already numbers)."""
    from harness.analysis.metrics import stratified_divergence

    if run.series.empty:
        return []
    context = run.records[run.records.metric == "context_tokens"]
    starts = {(m, s, p, int(t)): v for m, s, p, t, v in
              context[["model", "scenario", "path", "turn", "value"]].itertuples(index=False)}
    rows = stratified_divergence(run.series.to_dict("records"), starts)
    return [r | {"kl_text": format_value(r["kl_mean"])} for r in rows if r["path"] != REFERENCE]


def length_strata_view(run: StoredRun) -> dict:
    """KL and flips by reply position and the length trend test per model and path (analysis/strata.py, through
    the run reader): {"generation": rows for the plot and table, "trends": rows of the test, "by_path": (model,
    path) -> length_trend}."""
    computed = run.view.position_strata if run.view is not None else {}
    generation = [{"model": model, "path": path, **row, "kl_text": format_value(row["kl_mean"]),
                   "flip_text": format_value(row["flip_rate"])}
                  for (model, path), found in sorted(computed.items())
                  for row in found["strata"]["generation_position"] if row["tokens"]]
    trends = [{"model": model, "path": path, **found["length_trend"],
               "growth_text": format_value(found["length_trend"].get("median_growth")),
               "p_text": format_value(found["length_trend"].get("p_value"))}
              for (model, path), found in sorted(computed.items())]
    return {"generation": generation, "trends": trends,
            "by_path": {key: found["length_trend"] for key, found in computed.items()}}


def kl_mean_limit(verdicts) -> tuple[float, str] | None:
    """The kl_mean limit the verdicts applied (a default or a --threshold), to draw on the plots."""
    for row in verdicts:
        for reason in row.get("reasons") or []:
            if reason.get("metric") == "kl_mean" and isinstance(reason.get("limit"), (int, float)):
                return float(reason["limit"]), str(reason.get("source") or "verdicts")
    return None


def render_run_report(run_dir: Path | str, out_dir: Path | str | None = None, figure_worker=None) -> Path:
    """Render `run_dir` (a stored run) into `out_dir` (default `run_dir/report`); return index.html's path.
    figure_worker: `figure_worker.FigureWorkers` (or one `FigureWorker`) that draws the run's figures while the pages
    are written here."""
    from reports import run_figures  # the calls only: matplotlib is imported where a figure is drawn

    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    env, rows = environment(), summary_rows(run)
    metrics, paths = summary_metric_names(run.records), path_order(run)
    calls = run_figures.run_figure_calls(run.records, out, paths, list(run.verdicts),
                                         kl_mean_limit(run.verdicts) or run_figures.KL_LIMIT)
    by_length = length_strata_view(run)
    length_call = ("kl_by_generation_position", (by_length["generation"], out, paths, by_length["by_path"]))
    pending = [_hand(figure_worker, call) for call in [*calls, length_call]]  # drawn while the pages are written
    attention_figures = _attention_figures(run, out)
    by_scenario: dict[tuple, list[dict]] = {}
    for row in rows:
        by_scenario.setdefault((row["model"], row["scenario"]), []).append(row)
    for (model, scenario), scenario_rows in by_scenario.items():
        write_page(env, out, scenario_page_name(model, scenario), "scenario.html", run=run, model=model,
                   scenario=scenario, rows=scenario_rows, metrics=metrics,
                   turns=scenario_turns(run, model, scenario, paths),
                   errors=[e for e in run.errors if (e.get("model"), e.get("scenario")) == (model, scenario)])
    own, shared = headline(rows)
    whole = run.view.path_verdicts if run.verdicts else []
    strata = strata_view(run)
    *figures, length_figure = _figures(pending, [*calls, length_call])
    figures = [f for f in figures if f is not None] + attention_figures
    length_figures = [length_figure] if length_figure is not None else []
    return write_page(env, out, "index.html", "run_index.html", run=run, rows=rows, failures=own, shared=shared,
                      metrics=metrics, figures=figures, manifest=manifest_view(run.manifest),
                      matrix=verdict_matrix_view(list(run.verdicts), paths[1:], scenario_page_name, whole),
                      path_checks=path_checks(whole), yardstick=run.manifest.get("yardstick"),
                      strata=strata, by_length=by_length, length_figures=length_figures,
                      verdict_groups=verdict_turns(list(run.verdicts), scenario_page_name),
                      kv=kv_rows(run.records, run.manifest.get("scales") or {}, format_value),
                      detection=run.view.detection)  # written by `harness zoo`


def _attention_figures(run: StoredRun, out: Path) -> list[dict]:
    """The attention.jsonl / sensitivity.json views, where the run has them (else matplotlib is not imported)."""
    if run.view.attention_frame.empty and run.view.sensitivity is None:
        return []
    from reports import attention_plots

    return attention_plots.run_figures(run.view.attention_frame, run.view.attention_channels_frame,
                                       run.view.sensitivity, out)


def _hand(figure_worker, call: tuple[str, tuple]):
    """One figure call handed to the worker(s) (None: drawn here later)."""
    return figure_worker.draw(*call) if figure_worker is not None else None


def _figures(pending: list, calls: list[tuple[str, tuple]]) -> list[dict | None]:
    """Each call's figure: what its worker drew, in the calls' order (a worker answers in its requests' order), or
    drawn here where no worker drew it."""
    from harness.runs.figure_worker import drawn

    return [drawn(handed, lambda call=call: _draw_here(call)) for handed, call in zip(pending, calls)]


def _draw_here(call: tuple[str, tuple]) -> dict | None:
    from reports import plots  # matplotlib: imported only where a figure is drawn in this process

    return plots.draw_figure(*call)


# ---------------------------------------------------------------- export


def pyarrow_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("pyarrow") is not None


def export_run(run_dir: Path | str, fmt: str, out: Path | str | None = None) -> Path:
    """Write the run's tidy records table (one row per model, scenario, path, turn, metric) as CSV or Parquet.

    `out` is a file, or a directory to hold `records.<fmt>`; by default `run_dir/records.<fmt>`.
    """
    if fmt not in ("csv", "parquet"):
        raise ValueError(f"export format {fmt!r}: expected 'csv' or 'parquet'")
    run = load_run(run_dir)
    target = Path(out) if out is not None else run.run_dir / f"records.{fmt}"
    if target.is_dir():
        target = target / f"records.{fmt}"
    target.parent.mkdir(parents=True, exist_ok=True)
    table = run.records.copy()
    table.insert(0, "run_id", run.run_id)
    if fmt == "csv":
        table["tags"] = table["tags"].map(lambda tags: ";".join(tags) if isinstance(tags, list) else tags)
        table.to_csv(target, index=False)
        return target
    if not pyarrow_available():
        raise RuntimeError("parquet export needs pyarrow, which is not installed: `pip install pyarrow` "
                           "(or export with --format csv)")
    table.to_parquet(target, index=False)
    return target
