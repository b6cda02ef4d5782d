"""What the run report shows beside its tables: the verdict matrix (model x path), every failing turn with
its reasons, K/V-cache diagnostics, and the per-token views of a scenario page.

The verdicts are the run's `verdicts.jsonl` rows (docs/CONTRACTS.md), the one meaning of failure that the
summary, compare and the pytest plugin read too; nothing here grades a turn on its own.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping

from harness.analysis.verdicts import default_threshold

VERDICTS = ("pass", "warn", "fail")
STATE = {"pass": "good", "warn": "warn", "fail": "bad"}  # verdict -> the report's colour class
KV_METRICS = ("kv_clipped_frac", "kv_amax_over_max", "kv_nonfinite", "kv_write_err_ratio")


def worst_verdict(verdicts: Iterable[str]) -> str | None:
    found = [v for v in verdicts if v in VERDICTS]
    return max(found, key=VERDICTS.index) if found else None


def reason_text(row: Mapping) -> str:
    """Every reason of one verdict row, fail first, as one line."""
    reasons = sorted(row.get("reasons") or [], key=lambda r: r.get("severity") != "fail")
    return "; ".join(str(r.get("message") or r.get("check")) for r in reasons)


QUESTION_TITLES = {"implementation": "implementation right?", "acceptable": "precision acceptable?"}


def times_yardstick(numbers: Mapping, fmt: Callable = lambda v: f"{v:.2g}") -> str:
    """`3.1x yardstick (0.0042 nats)`: a path's pooled kl_mean against the yardstick's, or "" without one."""
    noise = numbers.get("kl_mean_over_noise")
    beside = f", {noise:.3g}x the fp32 reference noise ({fmt(numbers['noise_kl_mean'])} nats)" if noise is not None else ""
    twin = numbers.get("yardstick_twin_ratio")
    if twin is not None:  # the yardstick itself, judged by its twin
        return f"yardstick: KL {twin:.3g}x its twin ({fmt(numbers['twin_kl_mean'])} nats){beside}"
    ratio, stick = numbers.get("kl_mean_ratio"), numbers.get("yardstick_kl_mean")
    if ratio is None or stick is None:
        return beside.removeprefix(", ")
    shown = f"{ratio:.3g}" if isinstance(ratio, (int, float)) else str(ratio)
    return f"KL {shown}x yardstick ({fmt(stick)} nats){beside}"


def _measured(per_path: Mapping) -> str:
    """A path measured beside the candidates (the fp32 reference, the yardstick's twin, the control arm): its role and
    its KL, in place of a ratio to the yardstick it is not judged by; "" for a candidate."""
    role, kl = per_path.get("role"), (per_path.get("numbers") or {}).get("kl_mean")
    if not role:
        return ""
    return role + (f"; KL {kl:.2g} nats" if isinstance(kl, (int, float)) else "")


def verdict_matrix_view(verdicts: list[dict], paths: list[str], page_of: Callable[[str, str], str],
                        path_verdicts: Iterable[Mapping] = ()) -> dict:
    """Rows per model, one cell per candidate path: the worst verdict (turns and per-path checks), each question's
    verdict, the pooled KL against the yardstick, counts and the worst finding."""
    grouped: dict[tuple, list[dict]] = defaultdict(list)
    for row in verdicts:
        grouped[(row["model"], row["path"])].append(row)
    whole = {(r["model"], r["path"]): r for r in path_verdicts}
    models = sorted({model for model, _ in grouped})
    shown = [p for p in paths if any((m, p) in grouped for m in models)]
    shown += sorted({p for _, p in grouped} - set(shown))
    cells = {}
    for (model, path), rows in grouped.items():
        worst = max(rows, key=lambda r: (VERDICTS.index(r["verdict"]), len(r.get("reasons") or [])))
        counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
        per_path = whole.get((model, path)) or {}
        path_reasons = sorted((r for r in per_path.get("reasons", [])), key=lambda r: r["severity"] != "fail")
        verdict = worst_verdict([worst["verdict"], per_path.get("verdict", "pass")])
        questions = {}
        for q in QUESTION_TITLES:
            turn_q = [(r.get("questions") or {}).get(q, r["verdict"]) for r in rows]
            questions[q] = worst_verdict(turn_q + [(per_path.get("questions") or {}).get(q, "pass")])
        reason = reason_text(worst)
        if path_reasons and (path_reasons[0]["severity"] == "fail" or worst["verdict"] == "pass"):
            reason = "all turns: " + "; ".join(r["message"] for r in path_reasons)
        cells[(model, path)] = {"verdict": verdict, "state": STATE[verdict], **counts,
                                "turns": len(rows), "scenario": worst["scenario"], "turn": worst["turn"],
                                "reason": reason, "page": page_of(model, worst["scenario"]),
                                "questions": [{"title": QUESTION_TITLES[q], "verdict": v, "state": STATE[v]}
                                              for q, v in questions.items()],
                                "times": _measured(per_path) or times_yardstick(per_path.get("numbers") or {}),
                                "unanswered": per_path.get("unanswered") or []}
    return {"models": models, "paths": shown, "cells": cells,
            "failing": sum(c["verdict"] == "fail" for c in cells.values()),
            "warning": sum(c["verdict"] == "warn" for c in cells.values())}


def path_checks(path_verdicts: Iterable[Mapping]) -> list[dict]:
    """The per-path checks (pooled divergence, paired recovery, length, degeneration) of every path with a
    finding or an unanswered question, fail first."""
    out = []
    for row in path_verdicts:
        reasons = sorted(row.get("reasons") or [], key=lambda r: r["severity"] != "fail")
        if not reasons and not row.get("unanswered"):
            continue
        out.append({"model": row["model"], "path": row["path"], "verdict": row["verdict"],
                    "state": STATE[row["verdict"]], "times": times_yardstick(row.get("numbers") or {}),
                    "reasons": [{"severity": r["severity"], "state": STATE[r["severity"]],
                                 "question": r.get("question") or "both", "message": r["message"]} for r in reasons],
                    "unanswered": row.get("unanswered") or []})
    return sorted(out, key=lambda g: (-VERDICTS.index(g["verdict"]), g["model"], g["path"]))


def verdict_turns(verdicts: list[dict], page_of: Callable[[str, str], str]) -> list[dict]:
    """Every (model, path) with a turn that failed or warned, each with all such turns and their reasons."""
    grouped: dict[tuple, list[dict]] = defaultdict(list)
    for row in verdicts:
        if row["verdict"] != "pass":
            grouped[(row["model"], row["path"])].append(row)
    out = []
    for (model, path), rows in sorted(grouped.items()):
        rows = sorted(rows, key=lambda r: (-VERDICTS.index(r["verdict"]), r["scenario"], r["turn"] or 0))
        out.append({"model": model, "path": path, "verdict": rows[0]["verdict"], "state": STATE[rows[0]["verdict"]],
                    "turns": [{"scenario": r["scenario"], "turn": r["turn"], "verdict": r["verdict"],
                               "state": STATE[r["verdict"]], "reasons": reason_text(r),
                               "page": page_of(model, r["scenario"])} for r in rows]})
    return sorted(out, key=lambda g: (-VERDICTS.index(g["verdict"]), g["model"], g["path"]))


def case_verdicts(verdicts: list[dict]) -> dict[tuple, dict]:
    """(model, scenario, path) -> worst verdict over its turns, and the reasons of the turns that did not pass."""
    grouped: dict[tuple, list[dict]] = defaultdict(list)
    for row in verdicts:
        grouped[(row["model"], row["scenario"], row["path"])].append(row)
    out = {}
    for key, rows in grouped.items():
        verdict = worst_verdict(r["verdict"] for r in rows)
        reasons = [f"turn {r['turn']}: {reason_text(r)}" for r in rows if r["verdict"] != "pass"]
        out[key] = {"verdict": verdict, "state": STATE[verdict], "reasons": reasons}
    return out


def turn_verdicts(verdicts: list[dict]) -> dict[tuple, dict]:
    """(model, scenario, path, turn) -> the verdict row."""
    return {(r["model"], r["scenario"], r["path"], r["turn"]): r for r in verdicts}


# ---------------------------------------------------------------- K/V-cache diagnostics


def kv_rows(records, scales: Mapping, fmt: Callable) -> list[dict]:
    """Per (model, path): what the FP8 cast did (clipped fraction, amax over the format's max, non-finite
    values read back; worst turn) and the per-layer scales the path used, from the manifest."""
    kv = records[records.metric.isin(KV_METRICS)]
    out = []
    for (model, path), group in kv.groupby(["model", "path"], sort=True):
        worst = group.groupby("metric")["value"].max()
        cells = {}
        for metric, bad_above in (("kv_clipped_frac", 0.0), ("kv_amax_over_max", 1.0), ("kv_nonfinite", 0.0),
                                  ("kv_write_err_ratio", default_threshold("kv_write_err_ratio").warn)):
            value = worst.get(metric)
            missing = value is None or (isinstance(value, float) and math.isnan(value))
            state = "none" if missing else "bad" if value > bad_above else "good"
            cells[metric] = {"text": fmt(value), "state": state, "value": None if missing else value}
        described = ((scales.get(model) or {}).get(path) or {})
        out.append({"model": model, "path": path, "cells": cells,
                    "layers": layer_scales(described, fmt)})
    return out


def layer_scales(described: Mapping, fmt: Callable) -> list[dict]:
    """[{layer, k, v}] from a scales summary that lists them per layer (empty for older runs)."""
    if not isinstance(described, Mapping):
        return []
    layers = described.get("layers") or []
    k, v = described.get("k_scale_per_layer") or [], described.get("v_scale_per_layer") or []
    return [{"layer": layer, "k": fmt(k[i]) if i < len(k) else "—", "v": fmt(v[i]) if i < len(v) else "—"}
            for i, layer in enumerate(layers)]


# ---------------------------------------------------------------- per-token views (scenario pages)

SPARK_W, SPARK_H = 360, 46  # pixels of one inline chart


def sparkline(values: list[float | None], marker: int | None, fmt: Callable, log: bool = False) -> dict:
    """An inline SVG polyline of a per-token series: finite points joined, non-finite ones marked in red at
    the top edge (never dropped), the first divergent token as a vertical line."""
    n = len(values)
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if n == 0:
        return {"points": "", "marks": [], "marker_x": None, "low": "—", "high": "—", "nonfinite": 0}

    def scaled(v: float) -> float:
        return math.log10(max(v, 1e-6)) if log else v

    low = min(map(scaled, finite), default=0.0)
    high = max(map(scaled, finite), default=1.0)
    span = (high - low) or 1.0
    step = SPARK_W / max(n - 1, 1)
    points, marks = [], []
    for i, v in enumerate(values):
        x = round(i * step, 1)
        if v is None or not math.isfinite(v):
            marks.append({"x": x, "tip": f"token {i}: {fmt(v)}"})
            continue
        y = round(SPARK_H - 4 - (scaled(v) - low) / span * (SPARK_H - 8), 1)
        points.append(f"{x},{y}")
    return {"points": " ".join(points), "marks": marks, "nonfinite": len(marks),
            "marker_x": None if marker is None or marker >= n else round(marker * step, 1),
            "low": fmt(min(finite)) if finite else "—", "high": fmt(max(finite)) if finite else "—"}
