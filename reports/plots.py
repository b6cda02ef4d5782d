"""Matplotlib plots for the run and compare reports, drawn from the tidy records table and saved as PNG."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

REFERENCE = "reference"
DPI = 90
FAILURE_CHECKS = ("answer_correct", "rules_followed")


def _linthresh(values) -> float:
    """Linear range of a symlog axis: below the smallest positive value, so zeros sit on the axis and
    everything measured is on the log part (1e-4 when there is nothing positive)."""
    positive = [v for v in values if v > 0]
    return 10 ** math.floor(math.log10(min(positive))) if positive else 1e-4


def _legend_below(ax) -> None:
    """Legend under the axes, so it never hides a line."""
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)


def _label(model: str, path: str, models: int) -> str:
    return path if models == 1 else f"{model} / {path}"


def _save(fig, out_dir: Path, name: str, title: str, caption: str) -> dict:
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=DPI)
    plt.close(fig)
    return {"file": name, "title": title, "caption": caption}


def _metric(records: pd.DataFrame, metric: str) -> pd.DataFrame:
    return records[(records.metric == metric) & (records.path != REFERENCE)].dropna(subset=["value"])


def _by_turn(records: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Mean of a metric over scenarios, per (model, path) and turn."""
    table = _metric(records, metric).groupby(["model", "path", "turn"], sort=False)["value"].mean().reset_index()
    return table.sort_values("turn", kind="stable")


def divergence_vs_turn(records: pd.DataFrame, out_dir: Path, paths: list[str], style: dict | None = None,
                       name: str = "divergence_vs_turn.png") -> dict | None:
    panels = [m for m in ("kl_mean", "top1_agree") if (records.metric == m).any()]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, metric in zip(axes[0], panels):
        draw_by_turn(ax, records, metric, paths, style or {})
    return _save(fig, out_dir, name, "Divergence against turn",
                 "Mean teacher-forced KL and top-1 agreement over scenarios, per turn and path.")


def draw_by_turn(ax, records: pd.DataFrame, metric: str, paths: list[str], style: dict, suffix: str = "",
                 linthresh: float | None = None) -> None:
    table = _by_turn(records, metric)
    models = table["model"].nunique()
    for (model, path), line in table.groupby(["model", "path"], sort=False):
        colour = f"C{paths.index(path) % 10}" if path in paths else None
        ax.plot(line["turn"], line["value"], marker="o", color=colour,
                label=_label(model, path, models) + suffix, **style)
    ax.set_xlabel("turn")
    ax.set_ylabel(metric + (" (nats, symlog)" if metric.startswith("kl") else ""))
    if metric.startswith("kl"):
        ax.set_yscale("symlog", linthresh=linthresh or _linthresh(table["value"]))
    if not table.empty:
        ax.set_xticks(sorted(table["turn"].unique()))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        _legend_below(ax)


def divergence_vs_context(records: pd.DataFrame, out_dir: Path, paths: list[str]) -> dict | None:
    context = _metric(records, "context_tokens")
    kl = _metric(records, "kl_mean")
    if context.empty or kl.empty:
        return None
    keys = ["model", "scenario", "path", "turn"]
    joined = kl[keys + ["value"]].merge(context[keys + ["value"]], on=keys, suffixes=("_kl", "_context"))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    models = joined["model"].nunique()
    for (model, path), points in joined.groupby(["model", "path"], sort=False):
        colour = f"C{paths.index(path) % 10}" if path in paths else None
        ax.scatter(points["value_context"], points["value_kl"], color=colour, s=22,
                   label=_label(model, path, models))
    ax.set_yscale("symlog", linthresh=_linthresh(joined["value_kl"]))
    ax.set_xlabel("context length at the turn (tokens)")
    ax.set_ylabel("kl_mean (nats, symlog)")
    ax.grid(alpha=0.3)
    _legend_below(ax)
    return _save(fig, out_dir, "divergence_vs_context.png", "Divergence against context length",
                 "Teacher-forced KL per turn against the context length the turn was generated at.")


def sensitivity_table(records: pd.DataFrame) -> pd.DataFrame:
    """Per (model, path): mean KL and the fraction of checked turns that failed, most sensitive first."""
    kl = _metric(records, "kl_mean").groupby(["model", "path"])["value"].mean().rename("kl_mean")
    checks = records[records.metric.isin(FAILURE_CHECKS) & (records.path != REFERENCE)].dropna(subset=["value"])
    failed = (checks.assign(failed=checks["value"] < 1).groupby(["model", "path"])["failed"].mean()
              .rename("failure_rate"))
    table = pd.concat([kl, failed], axis=1).reset_index()
    return table.sort_values(["failure_rate", "kl_mean"], ascending=True, na_position="first")


def sensitivity_ranking(records: pd.DataFrame, out_dir: Path) -> dict | None:
    table = sensitivity_table(records)
    if table.empty:
        return None
    models = table["model"].nunique()
    labels = [_label(m, p, models) for m, p in zip(table["model"], table["path"])]
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 0.45 * len(table) + 1.6), sharey=True)
    axes[0].barh(labels, table["kl_mean"].fillna(0), color="C3")
    axes[0].set_xscale("symlog", linthresh=_linthresh(table["kl_mean"].dropna()))
    axes[0].set_xlabel("mean kl_mean (nats, symlog)")
    axes[1].barh(labels, table["failure_rate"].fillna(0), color="C1")
    axes[1].set_xlim(0, 1)
    axes[1].set_xlabel("fraction of checked turns failed")
    for ax in axes:
        ax.grid(alpha=0.3, axis="x")
    return _save(fig, out_dir, "sensitivity_ranking.png", "Sensitivity ranking of paths",
                 "Paths ordered by failed checks, then by mean KL; the most sensitive at the top.")


def attention_error(records: pd.DataFrame, out_dir: Path) -> dict | None:
    attn = records[records.metric.str.startswith("attn_") & (records.path != REFERENCE)].dropna(subset=["value"])
    if attn.empty:
        return None
    table = attn.groupby(["path", "metric"])["value"].max().unstack("metric")
    fig, ax = plt.subplots(figsize=(6.4, 0.45 * len(table) + 1.6))
    table.plot.barh(ax=ax)
    ax.set_xlabel("max over scenarios and turns")
    ax.grid(alpha=0.3, axis="x")
    return _save(fig, out_dir, "attention_error.png", "Attention error",
                 "Largest attention error per path for each attn_ metric the run measured.")


def run_plots(records: pd.DataFrame, out_dir: Path, paths: list[str]) -> list[dict]:
    drawn = [divergence_vs_turn(records, out_dir, paths), divergence_vs_context(records, out_dir, paths),
             sensitivity_ranking(records, out_dir), attention_error(records, out_dir)]
    return [d for d in drawn if d is not None]


def compare_plots(a: pd.DataFrame, b: pd.DataFrame, out_dir: Path, paths: list[str],
                  labels: tuple[str, str]) -> list[dict]:
    """Run A dashed, run B solid, same colour per path: kl_mean and top1_agree by turn, and the ranking."""
    panels = [m for m in ("kl_mean", "top1_agree") if (a.metric == m).any() or (b.metric == m).any()]
    out = []
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels), 4.8), squeeze=False)
        for ax, metric in zip(axes[0], panels):
            both = _linthresh(pd.concat([_by_turn(a, metric)["value"], _by_turn(b, metric)["value"]]))
            draw_by_turn(ax, a, metric, paths, {"linestyle": "--", "alpha": 0.7}, f" (A {labels[0]})", both)
            draw_by_turn(ax, b, metric, paths, {"linestyle": "-"}, f" (B {labels[1]})", both)
        out.append(_save(fig, out_dir, "compare_by_turn.png", "Divergence against turn, A dashed, B solid",
                         "Mean over scenarios per turn; same colour = same path."))
    table = sensitivity_table(a).merge(sensitivity_table(b), on=["model", "path"], how="outer", suffixes=("_a", "_b"))
    if not table.empty:
        fig, ax = plt.subplots(figsize=(6.8, 0.5 * len(table) + 1.6))
        y = range(len(table))
        ax.barh([i + 0.2 for i in y], table["kl_mean_a"].fillna(0), height=0.4, label=f"A {labels[0]}", alpha=0.6)
        ax.barh([i - 0.2 for i in y], table["kl_mean_b"].fillna(0), height=0.4, label=f"B {labels[1]}")
        ax.set_yticks(list(y), table["path"])
        ax.set_xscale("symlog", linthresh=_linthresh(pd.concat([table["kl_mean_a"], table["kl_mean_b"]]).dropna()))
        ax.set_xlabel("mean kl_mean (nats, symlog)")
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3, axis="x")
        out.append(_save(fig, out_dir, "compare_sensitivity.png", "Mean KL per path, A and B", ""))
    return out
