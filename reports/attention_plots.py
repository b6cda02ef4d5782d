"""Attention-score error views (matplotlib, PNG), drawn from a run's `attention.jsonl` and
`attention_channels.jsonl` and a sensitivity map: where a path's attention broke (layer, head, context
position) and why (the channels a scale clips). One screen: error by layer, a layer x head heat map,
error against query position and against key position, per-channel amax of the worst layer, and the sensitivity ranking.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from harness.analysis.attention_error import key_bucket_labels  # noqa: E402
from reports.plots import log_scale, save_figure  # noqa: E402

METRIC = "attn_out_rel_err"


def _finite(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    values = pd.to_numeric(frame[column], errors="coerce")
    return frame[values.map(lambda v: v is not None and math.isfinite(v))]


def _save(fig, out_dir: Path, name: str, title: str, caption: str) -> dict:
    """Saved as every report figure is (reports/plots.py): with its pixel size and any box outside the image."""
    fig.tight_layout()
    return save_figure(fig, out_dir, name, title, caption)


def error_by_layer(rows: pd.DataFrame, out_dir: Path) -> dict | None:
    data = _finite(rows, METRIC)
    if data.empty:
        return None
    table = data.groupby(["layer", "path"])[METRIC].mean().unstack("path")
    fig, ax = plt.subplots(figsize=(7.0, 3.6))
    for path in table.columns:
        ax.plot(table.index, table[path], marker="o", label=path)
    ax.set_xticks(list(table.index))  # attention layers only (a hybrid's are not contiguous)
    ax.set_xlabel("layer")
    ax.set_ylabel(f"mean {METRIC}")
    log_scale(ax.yaxis, "symlog", linthresh=1e-4)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    return _save(fig, out_dir, "attention_by_layer.png", "Attention error by layer",
                 "Mean relative error of the attention output per attention layer, every sampled head and row.")


def series(rows: pd.DataFrame) -> pd.DataFrame:
    """A decode kernel's rows (`attention` = `kernel:NAME`) become their own series, `PATH [kernel:NAME]`,
    beside the path's torch rows (runs before kernel capture have no `attention` column: all torch)."""
    if rows.empty or "attention" not in rows:
        return rows
    kernel = rows["attention"].fillna("torch") != "torch"
    rows = rows.copy()
    rows.loc[kernel, "path"] = rows.loc[kernel, "path"] + " [" + rows.loc[kernel, "attention"] + "]"
    return rows


def worst_path(rows: pd.DataFrame) -> str | None:
    """The path whose torch rows have the largest mean error (a kernel series has no channel view)."""
    if "attention" in rows:
        rows = rows[rows["attention"].fillna("torch") == "torch"]
    data = _finite(rows, METRIC)
    return None if data.empty else str(data.groupby("path")[METRIC].mean().idxmax())


def layer_head_heatmap(rows: pd.DataFrame, out_dir: Path, path: str) -> dict | None:
    data = _finite(rows[rows.path == path], METRIC)
    if data.empty:
        return None
    grid = data.groupby(["layer", "head"])[METRIC].mean().unstack("head")
    fig, ax = plt.subplots(figsize=(6.4, 0.35 * len(grid) + 1.8))
    image = ax.imshow(grid.values, aspect="auto", cmap="magma_r")
    ax.set_yticks(range(len(grid.index)), [str(i) for i in grid.index])
    ax.set_xticks(range(len(grid.columns)), [str(h) for h in grid.columns])
    ax.set_ylabel("layer")
    ax.set_xlabel("query head (sampled)")
    fig.colorbar(image, ax=ax, label=f"mean {METRIC}")
    layer, head = divmod(int(grid.values.argmax()), grid.shape[1])
    ax.set_title(f"{path}: worst layer {grid.index[layer]}, head {grid.columns[head]}", fontsize=9)
    return _save(fig, out_dir, "attention_heatmap.png", f"Layer x head attention error: {path}",
                 "Mean relative attention-output error per (layer, sampled head) of the path with the largest error.")


def error_vs_position(rows: pd.DataFrame, out_dir: Path, path: str) -> dict | None:
    data = _finite(rows[rows.path == path], METRIC)
    if data.empty:
        return None
    table = data.groupby(["query_pos", "layer"])[METRIC].mean().unstack("layer")
    fig, ax = plt.subplots(figsize=(7.0, 3.6))
    for layer in table.columns:
        ax.plot(table.index, table[layer], marker=".", label=f"layer {layer}")
    ax.set_xlabel("query position (context length - 1)")
    ax.set_ylabel(f"mean {METRIC}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, frameon=False)
    return _save(fig, out_dir, "attention_vs_position.png", f"Attention error against context position: {path}",
                 "Mean over sampled heads per query position, one line per layer: a rising line is error that grows with context.")


def error_vs_key_position(rows: pd.DataFrame, out_dir: Path, path: str) -> dict | None:
    """Mean L1 probability mass moved per key-position bucket, one line per layer (`attn_dp_by_key_pos`)."""
    if "attn_dp_by_key_pos" not in rows:
        return None
    data = rows[(rows.path == path) & rows["attn_dp_by_key_pos"].map(lambda v: isinstance(v, list) and bool(v))]
    if data.empty:
        return None
    width = max(len(v) for v in data["attn_dp_by_key_pos"])
    padded = pd.DataFrame([v + [0.0] * (width - len(v)) for v in data["attn_dp_by_key_pos"]], index=data.index)
    table = padded.groupby(data["layer"]).mean().T  # [bucket, layer]
    fig, ax = plt.subplots(figsize=(7.0, 3.6))
    for layer in table.columns:
        ax.plot(range(width), table[layer], marker=".", label=f"layer {layer}")
    ax.set_xticks(range(width), key_bucket_labels(width), rotation=45, fontsize=7)
    ax.set_xlabel("key position (log2 buckets)")
    ax.set_ylabel("mean sum |dp| in bucket")
    log_scale(ax.yaxis, "symlog", linthresh=1e-6)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=4, frameon=False)
    return _save(fig, out_dir, "attention_by_key_position.png", f"Where the attention mass moved: {path}",
                 "Probability mass moved between the reference's and the path's attention rows, by key position "
                 "(bucket 0 is the first token, where attention sinks sit); mean over sampled heads and rows.")


def channel_amax(channels: pd.DataFrame, rows: pd.DataFrame, out_dir: Path, path: str) -> dict | None:
    if channels.empty or rows.empty:
        return None
    data = _finite(rows[rows.path == path], METRIC)
    mine = channels[channels.path == path]
    if data.empty or mine.empty:
        return None
    layer = int(data.groupby("layer")[METRIC].mean().idxmax())
    picked = mine[mine.layer == layer]
    if picked.empty:
        return None
    fig, axes = plt.subplots(1, len(picked.tensor.unique()), figsize=(7.4, 3.2), squeeze=False)
    for ax, (tensor, group) in zip(axes[0], picked.groupby("tensor", sort=False)):
        row = group.iloc[-1]  # the last turn: the longest context
        ax.bar(range(len(row["amax"])), row["amax"], width=1.0, color="#4c72b0")
        limit = row.get("fp8_limit")
        if isinstance(limit, list):
            ax.plot(range(len(limit)), limit, color="#c44e52", lw=1, label="scale x fp8 max")
            ax.legend(fontsize=7)
        log_scale(ax.yaxis, "log")
        ax.set_title(f"layer {layer} {tensor}: outlier ratio {row['outlier_ratio']:.1f}", fontsize=9)
        ax.set_xlabel("channel (head x dim)")
    axes[0][0].set_ylabel("amax over tokens")
    return _save(fig, out_dir, "attention_channels.png", f"Per-channel amax, worst layer of {path}",
                 "What the reference cached in the layer with the largest error; channels above the red line are clipped by the path's scale.")


def sensitivity_ranking(sensitivity: dict, out_dir: Path) -> dict | None:
    ranking = sensitivity.get("ranking") or []
    if not ranking:
        return None
    labels = ["+".join(map(str, r["fp8_layers"])) for r in ranking][::-1]
    values = [r["kl_mean"] for r in ranking][::-1]
    kept = set(sensitivity.get("bf16_layers", []))
    colors = ["#c44e52" if set(r["fp8_layers"]) & kept else "#4c72b0" for r in ranking][::-1]
    fig, ax = plt.subplots(figsize=(6.4, 0.3 * len(labels) + 1.6))
    ax.barh(labels, values, color=colors)
    ax.axvline(sensitivity["budget"]["limit"], color="black", lw=1, ls="--", label="budget")
    ax.set_xlabel("teacher-forced kl_mean with FP8 on this layer only")
    ax.set_ylabel("layer")
    ax.legend(fontsize=7)
    return _save(fig, out_dir, "sensitivity_layers.png", "Layer sensitivity",
                 "Most sensitive layer at the top; red: kept in BF16 by the recommended map.")


def run_figures(rows: pd.DataFrame, channels: pd.DataFrame, sensitivity: dict | None, out_dir: Path) -> list[dict]:
    """Every attention view a run supports, written into out_dir: `rows` and `channels` are its attention.jsonl
    and attention_channels.jsonl rows, `sensitivity` its sensitivity.json (the run reader, harness/runs/read.py,
    reads them); nothing when the run captured no attention and wrote no map."""
    out_dir = Path(out_dir)
    figures = []
    if not rows.empty:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = worst_path(rows)
        figures += [error_by_layer(series(rows), out_dir)]
        if path is not None:
            figures += [layer_head_heatmap(rows, out_dir, path), error_vs_position(rows, out_dir, path),
                        error_vs_key_position(rows, out_dir, path), channel_amax(channels, rows, out_dir, path)]
    if sensitivity is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        figures.append(sensitivity_ranking(sensitivity, out_dir))
    return [f for f in figures if f is not None]
