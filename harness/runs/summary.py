"""The one-screen summary of a stored run: one row per model and path (the reference included)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.runs.gate import run_matrix
from harness.runs.store import RunStore

COLUMNS = {  # metric -> (column title, aggregate over turns)
    "answer_correct": ("answer acc", "mean"),
    "rules_followed": ("rules kept", "mean"),
    "exact_match": ("turns identical", "mean"),
    "first_divergent_token": ("turns diverged", "count"),
    "kl_mean": ("KL mean", "mean"),
    "kl_max": ("KL max", "max"),
    "top1_agree": ("top-1 agree", "mean"),
    "kv_clipped_frac": ("clipped", "mean"),
    "kv_nonfinite": ("KV non-finite", "max"),  # shown only when some path read a NaN/inf back from its cache
    "kernel_err_ratio": ("kernel err / torch err", "max"),  # GPU runs: our decode kernel's agreement
    "kernel_ms_per_step": ("kernel ms/step", "mean"),  # its time per decode call (plug-ins compared in one run)
    "attn_out_rel_err_max": ("attn out err max", "max"),  # runs with --attention: worst attention-output error
    "attn_kernel_vs_torch_max": ("kernel attn vs torch", "max"),  # its decode kernel vs torch on the same codes
}
SHOWN_WHEN_NONZERO = {"kv_nonfinite"}  # healthy runs are all zero there: no column to read past


def records_frame(run_dir: Path) -> pd.DataFrame:
    rows = RunStore(Path(run_dir)).read("records")
    frame = pd.DataFrame(rows)
    if frame.empty:
        return pd.DataFrame(columns=["model", "scenario", "path", "turn", "metric", "value"])
    frame["value"] = pd.to_numeric(frame["value"], errors="coerce")
    if "value_text" in frame:  # inf/-inf/nan were stored as text beside a null value
        text = frame["value_text"].map({"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")})
        frame["value"] = frame["value"].where(frame["value_text"].isna(), text)
    return frame


def summary_table(run_dir: Path) -> pd.DataFrame:
    frame = records_frame(run_dir)
    manifest = RunStore(Path(run_dir)).read_manifest()
    order = ["reference"] + [p["name"] for p in manifest.get("paths", [])]
    table = {}
    for metric, (title, how) in COLUMNS.items():
        picked = frame[frame["metric"] == metric]
        if picked.empty or (metric in SHOWN_WHEN_NONZERO and not (picked["value"].fillna(1) != 0).any()):
            continue
        grouped = picked.groupby(["model", "path"])["value"]
        table[title] = grouped.count() if how == "count" else grouped.agg(how)
    summary = pd.DataFrame(table)
    if summary.empty:
        return summary
    summary = summary.reset_index()
    summary["path"] = pd.Categorical(summary["path"], categories=order, ordered=True)
    return summary.sort_values(["model", "path"]).set_index(["model", "path"])


def verdict_table(matrix: dict, order: list[str]) -> pd.DataFrame:
    """Models x paths: pass/warn/fail turn counts, the path's verdict and its worst turn."""
    rows = []
    for model, paths in sorted(matrix.items()):
        for path in sorted(paths, key=lambda p: (order.index(p) if p in order else len(order), p)):
            cell = paths[path]
            verdict = "FAIL" if cell["fail"] else "warn" if cell["warn"] else "pass"
            worst = cell.get("worst_turn") or {}
            where = (f"{worst['scenario']} turn {worst['turn']}: {worst.get('reason', '')}"
                     if verdict != "pass" and worst else "")
            rows.append({"model": model, "path": path, "verdict": verdict, "pass": cell["pass"],
                         "warn": cell["warn"], "fail": cell["fail"], "worst turn": where})
    return pd.DataFrame(rows).set_index(["model", "path"]) if rows else pd.DataFrame()


def format_verdicts(verdicts: pd.DataFrame) -> str:
    """The verdict matrix as left-aligned text: one line per model and path."""
    table = verdicts.reset_index()
    widths = {c: max(len(c), *(len(str(v)) for v in table[c])) for c in ("model", "path", "verdict")}
    head = (f"{'model':<{widths['model']}}  {'path':<{widths['path']}}  {'verdict':<{widths['verdict']}}  "
            f"{'pass':>4} {'warn':>4} {'fail':>4}  worst turn")
    lines = ["verdicts per path, in turns (checks and thresholds: harness/analysis/verdicts.py)", head]
    for r in table.itertuples(index=False):
        lines.append(f"{r.model:<{widths['model']}}  {r.path:<{widths['path']}}  {r.verdict:<{widths['verdict']}}  "
                     f"{r[3]:>4} {r[4]:>4} {r[5]:>4}  {r[6]}".rstrip())
    return "\n".join(lines)


def format_summary(run_dir: Path) -> str:
    """The verdict matrix first (what may ship), then the numbers behind it."""
    manifest = RunStore(Path(run_dir)).read_manifest()
    order = [p["name"] for p in manifest.get("paths", [])]
    verdicts = verdict_table(run_matrix(run_dir), order)
    summary = summary_table(run_dir)
    parts = []
    if not verdicts.empty:
        parts.append(format_verdicts(verdicts))
    parts.append("(no records)" if summary.empty else summary.to_string(float_format=lambda v: f"{v:.3g}", na_rep="-"))
    return "\n\n".join(parts)
