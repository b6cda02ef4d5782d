"""The one-screen summary of a stored run: one row per model and path (the reference included)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

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
    "kernel_err_ratio": ("kernel err / torch err", "max"),  # GPU runs: our decode kernel's agreement
    "kernel_ms_per_step": ("kernel ms/step", "mean"),  # its time per decode call (plug-ins compared in one run)
}


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
        if picked.empty:
            continue
        grouped = picked.groupby(["model", "path"])["value"]
        table[title] = grouped.count() if how == "count" else grouped.agg(how)
    summary = pd.DataFrame(table)
    if summary.empty:
        return summary
    summary = summary.reset_index()
    summary["path"] = pd.Categorical(summary["path"], categories=order, ordered=True)
    return summary.sort_values(["model", "path"]).set_index(["model", "path"])


def format_summary(run_dir: Path) -> str:
    summary = summary_table(run_dir)
    if summary.empty:
        return "(no records)"
    return summary.to_string(float_format=lambda v: f"{v:.3g}", na_rep="-")
