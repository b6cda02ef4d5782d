"""The run report's figures as calls, one figure a call (a name in RUN_FIGURES and its arguments), and the tables
they are drawn from, without matplotlib: `render_run_report` hands the calls to figure workers
(harness/runs/figure_worker.py), and imports the plots (reports/plots.py) only to draw a figure no worker drew."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

REFERENCE = "reference"
KL_LIMIT = (0.05, "report default")  # kl_mean above which the report's levels call a cell bad
# the figures a figure worker may be asked to draw, by name (functions of reports/plots.py)
RUN_FIGURES = ("divergence_vs_turn_of", "divergence_vs_context", "sensitivity_ranking", "attention_error",
               "kl_by_generation_position")


def candidate_rows(records: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Candidate rows of one metric; non-finite values kept (NaN only where nothing was stored)."""
    return records[(records.metric == metric) & (records.path != REFERENCE)]


def by_turn(records: pd.DataFrame, metric: str, keys=("model", "path", "turn")) -> pd.DataFrame:
    """Mean over scenarios per key; a group holding an inf is inf (the mean of it), a group of NaN only is NaN."""
    table = candidate_rows(records, metric).groupby(list(keys), sort=False)["value"].agg(
        lambda v: v.mean() if v.notna().any() else math.nan).reset_index()
    return table.sort_values("turn", kind="stable")


def turns_by_model(records: pd.DataFrame):
    """(model, its kl_mean per kind, path and turn) in model order: `plots.divergence_vs_turn_of`'s input."""
    return by_turn(records, "kl_mean", ("model", "kind", "path", "turn")).groupby("model", sort=True)


def run_figure_calls(records: pd.DataFrame, out_dir: Path, paths: list[str], verdicts: list[dict] | None = None,
                     limit=KL_LIMIT) -> list[tuple[str, tuple]]:
    """The run's figures as (name in RUN_FIGURES, arguments), one figure a call, in the report's order: what
    `plots.run_plots` draws one after another, and figure workers side by side."""
    calls = [("divergence_vs_turn_of", (model, by_model, out_dir, paths, limit))
             for model, by_model in turns_by_model(records)]
    return calls + [("divergence_vs_context", (records, out_dir, paths)),
                    ("sensitivity_ranking", (records, out_dir, verdicts)), ("attention_error", (records, out_dir))]
