"""Matplotlib plots for the run and compare reports, drawn from the tidy records table and saved as PNG.

Every plot survives non-finite values: an inf KL is drawn as a marked point or bar end at the top of its
axis with the word "inf", a NaN as an "x" on the axis; nothing is dropped silently and no axis scale is
computed from them. Each saved figure notes the boxes of its texts and legends that fall outside the
image (`outside`), so tests can check that labels are inside the picture, not only that a file exists.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display

import matplotlib.image
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from reports.run_figures import (KL_LIMIT, REFERENCE, RUN_FIGURES, by_turn, candidate_rows, run_figure_calls,
                                 turns_by_model)

DPI = 90
FAILURE_CHECKS = ("answer_correct", "rules_followed")
VERDICT_COLOURS = {"pass": "#5aa469", "warn": "#e0b03c", "fail": "#d9534f", None: "#9aa3ad"}
NONFINITE_COLOUR = "#c62828"


_SUPERSCRIPTS = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")


class PlainLogFormatter(matplotlib.ticker.LogFormatterSciNotation):
    """The labels matplotlib's log and symlog axes choose (`LogFormatterSciNotation`), written as plain text
    (10⁻³, 2×10⁻³, −10²) instead of mathtext, which pyparsing parses for every layout: re-rendering the CPU default
    run's report took 4.82 s instead of 5.12 (medians of three, alternating, 2-core AMD EPYC). A label it cannot
    write so stays mathtext."""

    def __call__(self, x, pos=None) -> str:
        label = super().__call__(x, pos)
        found = re.fullmatch(r"\$\\mathdefault\{(.*)\}\$", label)
        if found is None:
            return label
        body = found.group(1).replace("\\times", "×")
        exponents = re.findall(r"\^\{([^}]*)\}", body)
        if any(not re.fullmatch(r"-?[0-9]+", e) for e in exponents):
            return label
        body = re.sub(r"\^\{([^}]*)\}", lambda m: m.group(1).translate(_SUPERSCRIPTS), body)
        if re.search(r"[\\{}$^_]", body):
            return label
        return "−" + body[1:] if body.startswith("-") else body


def log_scale(axis, scale: str, **options) -> None:
    """`axis` (an Axis: ax.xaxis / ax.yaxis) on a log or symlog scale, its tick labels plain text
    (`PlainLogFormatter`), set before any layout measures them."""
    (axis.axes.set_xscale if axis is axis.axes.xaxis else axis.axes.set_yscale)(scale, **options)
    for get, put in ((axis.get_major_formatter, axis.set_major_formatter),
                     (axis.get_minor_formatter, axis.set_minor_formatter)):
        old = get()
        if type(old) is matplotlib.ticker.LogFormatterSciNotation:   # the scale's own: its settings kept
            plain = PlainLogFormatter.__new__(PlainLogFormatter)
            plain.__dict__.update(old.__dict__)
            put(plain)


def finite(values) -> np.ndarray:
    array = np.asarray(pd.to_numeric(pd.Series(values, dtype=object), errors="coerce"), dtype=float)
    return array[np.isfinite(array)]


def _linthresh(values) -> float:
    """Linear range of a symlog axis: below the smallest positive finite value, so zeros sit on the axis and
    everything measured is on the log part (1e-4 when there is nothing positive and finite)."""
    positive = finite(values)
    positive = positive[positive > 0]
    return float(10 ** math.floor(math.log10(positive.min()))) if len(positive) else 1e-4


def _label(model: str, path: str, models: int) -> str:
    return path if models == 1 else f"{model} / {path}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "x"


def outside_boxes(fig) -> list[str]:
    """Texts and legends (with text) whose drawn box leaves the figure: what a reader would see cut off."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    found = []
    tick_labels, drawn_ticks = set(), []
    for ax in fig.axes:  # an axis keeps labels of ticks beyond its limits; only those in view are drawn
        for axis, (low, high) in ((ax.xaxis, sorted(ax.get_xlim())), (ax.yaxis, sorted(ax.get_ylim()))):
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                tick_labels |= {id(tick.label1), id(tick.label2)}
                if low - 1e-9 * abs(high - low) <= tick.get_loc() <= high + 1e-9 * abs(high - low):
                    drawn_ticks += [t for t in (tick.label1, tick.label2) if t.get_visible()]
    artists = [t for t in fig.findobj(matplotlib.text.Text)
               if t.get_visible() and id(t) not in tick_labels] + drawn_ticks
    artists = [t for t in artists if t.get_text().strip()]
    artists += [lg for ax in fig.axes if (lg := ax.get_legend()) is not None] + list(fig.legends)
    for artist in artists:
        box = artist.get_window_extent(renderer)
        if box.x0 < -1 or box.y0 < -1 or box.x1 > width + 1 or box.y1 > height + 1:
            name = artist.get_text() if hasattr(artist, "get_text") else "legend"
            found.append(f"{name!r} at {box.x0:.0f},{box.y0:.0f}-{box.x1:.0f},{box.y1:.0f} in {width:.0f}x{height:.0f}")
    return found


def save_figure(fig, out_dir: Path, name: str, title: str, caption: str, **extra) -> dict:
    """Draw `fig` once at the saved resolution, check its boxes on that drawing and write its pixels as the PNG
    (`savefig` would draw it a second time: half of a report's plotting time, profiled on an H200 box)."""
    fig.set_dpi(DPI)
    outside = outside_boxes(fig)  # draws the canvas
    pixels = np.asarray(fig.canvas.buffer_rgba())  # [height, width, 4] uint8, what savefig would encode
    matplotlib.image.imsave(out_dir / name, pixels, format="png", dpi=DPI)
    header = (out_dir / name).read_bytes()[16:24]  # the PNG's IHDR: width, height (big-endian)
    size = [int.from_bytes(header[:4], "big"), int.from_bytes(header[4:], "big")]
    texts = sorted({t.get_text() for t in fig.findobj(matplotlib.text.Text) if t.get_text().strip()})
    plt.close(fig)
    return {"file": name, "title": title, "caption": caption, "size": size, "outside": outside, "texts": texts,
            **extra}


def mark_nonfinite(ax, xs, ys, colour, horizontal: bool = False) -> int:
    """Draw each non-finite value at the top (inf) or the bottom (NaN, -inf) edge of the axes, labelled.
    Returns how many were drawn."""
    drawn = 0
    transform = ax.get_xaxis_transform() if not horizontal else ax.get_yaxis_transform()
    for x, y in zip(xs, ys):
        if y is None or np.isfinite(y):
            continue
        edge, marker, word = (0.97, "^", "inf") if y == math.inf else (0.03, "x", "NaN" if np.isnan(y) else "-inf")
        point = (x, edge) if not horizontal else (edge, x)
        ax.plot(*point, marker=marker, color=NONFINITE_COLOUR, markersize=9, transform=transform, clip_on=False)
        ax.annotate(word, point, xycoords=transform, textcoords="offset points", xytext=(5, -3),
                    fontsize=7, color=NONFINITE_COLOUR)
        drawn += 1
    return drawn


KL_LINEAR_BELOW = 1e-4  # nats: a KL this small is a rounding difference; it need not get log decades of its own


def _kl_axis(ax, values, limit: float | None = None) -> None:
    """KL is >= 0: symlog from 0, linear below max(1e-4, smallest positive value), up to above the largest
    finite value (and the limit line), so bar and line heights read as decades, never as noise blown up."""
    threshold = max(KL_LINEAR_BELOW, _linthresh(values))
    log_scale(ax.yaxis, "symlog", linthresh=threshold, linscale=0.5)
    shown = finite(list(values) + ([limit] if limit else []))
    top = max(float(shown.max()) if len(shown) else threshold, threshold) * 3
    ax.set_ylim(0, top)
    ax.set_ylabel(f"kl_mean (nats; linear below {threshold:g}, log above)", fontsize=8)


def _threshold_line(ax, limit: tuple[float, str] | None, axis: str = "y") -> None:
    if limit is None:
        return
    value, source = limit
    line = ax.axhline if axis == "y" else ax.axvline
    line(value, color="#d9534f", linestyle=":", linewidth=1.2, label=f"fail above {value:g} ({source})")


# ---------------------------------------------------------------- run plots


def divergence_vs_turn(records: pd.DataFrame, out_dir: Path, paths: list[str], limit=KL_LIMIT) -> list[dict]:
    """One figure per model, one panel per scenario kind: mean kl_mean over that kind's scenarios per turn and
    path, the kl_mean limit drawn. Kinds are kept apart: turn 2 of a recall chat is not turn 2 of a chat."""
    return [divergence_vs_turn_of(model, by_model, out_dir, paths, limit)
            for model, by_model in turns_by_model(records)]


def divergence_vs_turn_of(model: str, by_model: pd.DataFrame, out_dir: Path, paths: list[str], limit=KL_LIMIT) -> dict:
    """`divergence_vs_turn`'s figure of one model, from its rows of `run_figures.turns_by_model`."""
    kinds = sorted(by_model["kind"].unique())
    fig, axes = plt.subplots(1, len(kinds), figsize=(3.2 * len(kinds) + 1.4, 3.6), squeeze=False, sharey=True)
    for ax, kind in zip(axes[0], kinds):
        part = by_model[by_model["kind"] == kind]
        for path, line in part.groupby("path", sort=False):
            colour = f"C{paths.index(path) % 10}" if path in paths else None
            shown = line["value"].where(np.isfinite(line["value"]))
            ax.plot(line["turn"], shown, marker="o", color=colour, label=path)
            mark_nonfinite(ax, line["turn"], line["value"], colour)
        _threshold_line(ax, limit)
        ax.set_title(f"{kind} ({part['turn'].nunique()} turn(s))", fontsize=9)
        ax.set_xlabel("turn")
        ax.set_xticks(sorted(part["turn"].unique()))
        ax.grid(alpha=0.3)
    _kl_axis(axes[0][0], by_model["value"], limit=limit[0] if limit else None)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=7.5, frameon=False)
    fig.suptitle(f"{model}: divergence against turn, per scenario kind", fontsize=10)
    fig.tight_layout(rect=(0, 0.06 + 0.045 * math.ceil(len(labels) / 3), 1, 0.95))
    return save_figure(fig, out_dir, f"divergence_vs_turn-{_slug(model)}.png", f"{model}: divergence against turn",
                       "Mean teacher-forced KL per turn over the scenarios of each kind; the dotted line is the "
                       "kl_mean limit. Red triangles: inf.", model=model)


def divergence_vs_context(records: pd.DataFrame, out_dir: Path, paths: list[str]) -> dict | None:
    context = candidate_rows(records, "context_tokens")
    kl = candidate_rows(records, "kl_mean")
    if context.empty or kl.empty:
        return None
    keys = ["model", "scenario", "path", "turn"]
    joined = kl[keys + ["value"]].merge(context[keys + ["value"]], on=keys, suffixes=("_kl", "_context"))
    models = sorted(joined["model"].unique())
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models) + 1, 3.8), squeeze=False, sharey=True)
    for ax, model in zip(axes[0], models):
        for path, points in joined[joined["model"] == model].groupby("path", sort=False):
            colour = f"C{paths.index(path) % 10}" if path in paths else None
            ax.scatter(points["value_context"], points["value_kl"].where(np.isfinite(points["value_kl"])),
                       color=colour, s=20, label=path)
            mark_nonfinite(ax, points["value_context"], points["value_kl"], colour)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("context tokens at the turn")
        ax.margins(x=0.08)
        ax.grid(alpha=0.3)
    _kl_axis(axes[0][0], joined["value_kl"])
    handles: dict = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(3, len(handles)), fontsize=7.5,
               frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.045 * math.ceil(len(handles) / 3), 0.98, 1))
    return save_figure(fig, out_dir, "divergence_vs_context.png", "Divergence against context length",
                 "Teacher-forced KL per turn against the context length the turn was generated at, per model.")


def _trend_label(path: str, trend: dict | None) -> str:
    trend = trend or {}
    if trend.get("why") == "the yardstick itself":
        return f"{path} (yardstick)"
    if trend.get("p_value") is None:
        return path
    if not trend.get("turns"):
        return f"{path} (length trend: no diverging turn)"
    return f"{path} (length trend p = {trend['p_value']:.2g}, {trend['turns']} turns)"


def kl_by_generation_position(strata: list[dict], out_dir: Path, paths: list[str],
                              trends: dict[tuple, dict] | None = None) -> dict | None:
    """One panel per model: pooled teacher-forced KL per reply-position bucket and path (log y), from rows
    {model, path, bucket, tokens, kl_mean} (analysis/strata.py); buckets holding no token are not drawn. Each
    legend entry carries the path's length trend p-value when `trends` ((model, path) -> length_trend) has one."""
    table = pd.DataFrame([r for r in strata if r.get("tokens")])
    if table.empty:
        return None
    buckets = list(dict.fromkeys(r["bucket"] for r in strata))  # the strata's order: shortest first
    models = sorted(table["model"].unique())
    lines = table.groupby("model")["path"].nunique().max()
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models) + 1, 3.4 + 0.16 * lines), squeeze=False,
                             sharey=True)
    for ax, model in zip(axes[0], models):
        for path, line in table[table["model"] == model].groupby("path", sort=False):
            colour = f"C{paths.index(path) % 10}" if path in paths else None
            xs, kl = [buckets.index(b) for b in line["bucket"]], line["kl_mean"].astype(float)
            ax.plot(xs, kl.where(np.isfinite(kl)), marker="o", color=colour,
                    label=_trend_label(path, (trends or {}).get((model, path))))
            mark_nonfinite(ax, xs, kl, colour)
        ax.set_xticks(range(len(buckets)), buckets, fontsize=7.5)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("reply token index")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=6.5, frameon=False)  # p per model
    _kl_axis(axes[0][0], table["kl_mean"])
    fig.tight_layout()
    return save_figure(fig, out_dir, "kl_by_generation_position.png", "KL by position in the reply",
                       "Teacher-forced KL pooled over every token in each bucket of the reply's token index, per "
                       "model and path; a line that climbs more than the yardstick's is a loss growing with length. "
                       "Legend: the length trend test's p-value (warns below 0.01).")


def verdict_table(verdicts: list[dict]) -> pd.DataFrame:
    """Per (model, path): the worst verdict and the fraction of turns that failed."""
    if not verdicts:
        return pd.DataFrame(columns=["model", "path", "verdict", "failure_rate"])
    table = pd.DataFrame([{"model": r["model"], "path": r["path"], "verdict": r["verdict"]} for r in verdicts])
    rank = table["verdict"].map({"pass": 0, "warn": 1, "fail": 2})
    worst = table.assign(rank=rank).groupby(["model", "path"])["rank"].max().map({0: "pass", 1: "warn", 2: "fail"})
    rate = (table["verdict"] == "fail").groupby([table["model"], table["path"]]).mean()
    return pd.concat([worst.rename("verdict"), rate.rename("failure_rate")], axis=1).reset_index()


def sensitivity_table(records: pd.DataFrame, verdicts: list[dict] | None = None) -> pd.DataFrame:
    """Per (model, path): mean KL, the verdict and the fraction of turns that failed, most sensitive first.
    Without verdicts the failure rate is that of the task checks (answer_correct, rules_followed)."""
    kl = candidate_rows(records, "kl_mean").groupby(["model", "path"])["value"].agg(
        lambda v: v.mean() if v.notna().any() else math.nan).rename("kl_mean")
    judged = verdict_table(verdicts or [])
    if len(judged):
        table = pd.concat([kl, judged.set_index(["model", "path"])], axis=1).reset_index()
    else:
        checks = records[records.metric.isin(FAILURE_CHECKS) & (records.path != REFERENCE)].dropna(subset=["value"])
        failed = (checks.assign(failed=checks["value"] < 1).groupby(["model", "path"])["failed"].mean()
                  .rename("failure_rate"))
        table = pd.concat([kl, failed], axis=1).reset_index()
        table["verdict"] = None
    order = table["kl_mean"].replace(math.inf, 1e300).fillna(-1)
    return table.assign(_order=order).sort_values(["failure_rate", "_order"], ascending=True,
                                                  na_position="first").drop(columns="_order")


def _bars(ax, y, values, colours, height=0.7, **style) -> None:
    """Horizontal bars of positive values on a log axis, each labelled with its value; zeros, inf and NaN
    are written out where a bar cannot show them."""
    values = np.asarray(values, dtype=float)
    shown = finite(values)
    positive = shown[shown > 0]
    floor = 10 ** math.floor(math.log10(positive.min())) / 3 if len(positive) else 1e-6
    top = positive.max() * 30 if len(positive) else 1.0
    lengths = [v if np.isfinite(v) and v > 0 else (top if v == math.inf else floor) for v in values]
    ax.barh(y, [length - floor for length in lengths], left=floor, height=height, color=colours, **style)
    log_scale(ax.xaxis, "log")
    ax.set_xlim(floor, top)
    for yi, v, length in zip(y, values, lengths):
        text = ("inf" if v == math.inf else "NaN (not measured)" if np.isnan(v) else "0" if v == 0
                else f"{v:.2g}")
        colour = NONFINITE_COLOUR if not np.isfinite(v) else "#1c2530"
        ax.annotate(text, (min(length, top), yi), xytext=(-3 if v == math.inf else 3, 0), textcoords="offset points",
                    ha="right" if v == math.inf else "left", va="center", fontsize=7, color=colour)


def sensitivity_ranking(records: pd.DataFrame, out_dir: Path, verdicts: list[dict] | None = None) -> dict | None:
    table = sensitivity_table(records, verdicts)
    if table.empty:
        return None
    models = table["model"].nunique()
    labels = [_label(m, p, models) for m, p in zip(table["model"], table["path"])]
    colours = [VERDICT_COLOURS.get(v if isinstance(v, str) else None, VERDICT_COLOURS[None]) for v in table["verdict"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.36 * len(table) + 1.9), sharey=True,
                             gridspec_kw={"width_ratios": [3, 2]})
    y = list(range(len(table)))
    _bars(axes[0], y, table["kl_mean"], colours)
    axes[0].set_yticks(y, labels, fontsize=8)
    axes[0].set_xlabel("mean kl_mean over turns (nats, log scale; value at each bar)")
    rates = table["failure_rate"]
    axes[1].barh(y, rates.fillna(0), color=colours, height=0.7)  # no bar where nothing was checked...
    for yi in [yi for yi, rate in zip(y, rates) if pd.isna(rate)]:  # ...and the row says so, never a 0
        axes[1].annotate("not checked", (0, yi), xytext=(3, 0), textcoords="offset points", va="center",
                         fontsize=7, color=NONFINITE_COLOUR)
    axes[1].set_xlim(0, 1)
    axes[1].set_xlabel("fraction of turns failed" + (" (verdicts)" if table["verdict"].notna().any() else
                                                     " (task checks)"))
    for ax in axes:
        ax.grid(alpha=0.3, axis="x")
    handles = [Line2D([], [], color=c, linewidth=8, label=v) for v, c in VERDICT_COLOURS.items() if v]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False, title="verdict of the path",
               title_fontsize=8)
    fig.tight_layout(rect=(0, 0.1 + 0.6 / (len(table) + 3), 1, 1))
    return save_figure(fig, out_dir, "sensitivity_ranking.png", "Sensitivity ranking of paths",
                 "Paths ordered by failed turns, then by mean KL, the most sensitive at the top; colour = the path's verdict.")


# The worst-row attention errors of each turn (harness/analysis/attention_error.py); the layer/head indices and
# sample sizes beside them are not errors. The per-layer and per-head views are reports/attention_plots.py's.
ATTENTION_ERROR_METRICS = ("attn_out_rel_err_max", "attn_kl_max", "attn_max_abs_dp_max", "attn_logit_err_max")


def attention_error(records: pd.DataFrame, out_dir: Path) -> dict | None:
    attn = records[records.metric.isin(ATTENTION_ERROR_METRICS) & (records.path != REFERENCE)]
    if attn.empty:
        return None
    models = attn["model"].nunique()
    attn = attn.assign(label=[_label(m, p, models) for m, p in zip(attn["model"], attn["path"])])
    table = attn.groupby(["label", "metric"])["value"].max().unstack("metric")
    fig, ax = plt.subplots(figsize=(7.2, 0.45 * len(table) * max(1, len(table.columns) / 2) + 1.8))
    shown = table.where(np.isfinite(table))
    shown.plot.barh(ax=ax)
    for row, label in enumerate(table.index):
        mark_nonfinite(ax, [row] * len(table.columns), table.loc[label].to_numpy(float), None, horizontal=True)
    ax.set_xlabel("max over scenarios and turns")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return save_figure(fig, out_dir, "attention_error.png", "Attention error",
                 "Largest attention error per path for each attn_ metric the run measured.")


def draw_figure(name: str, args: tuple) -> dict | None:
    """One call of `run_figure_calls` (or `kl_by_generation_position`): its figure's entry, None where it has none."""
    if name not in RUN_FIGURES:
        raise ValueError(f"{name!r} is not a run figure ({', '.join(RUN_FIGURES)})")
    return globals()[name](*args)


def run_plots(records: pd.DataFrame, out_dir: Path, paths: list[str], verdicts: list[dict] | None = None,
              limit=KL_LIMIT) -> list[dict]:
    drawn = [draw_figure(name, args) for name, args in run_figure_calls(records, out_dir, paths, verdicts, limit)]
    return [d for d in drawn if d is not None]


# ---------------------------------------------------------------- compare plots


def compare_plots(a: pd.DataFrame, b: pd.DataFrame, out_dir: Path, paths: list[str],
                  labels: tuple[str, str]) -> list[dict]:
    """kl_mean by turn (A dashed, B solid, colour = path; one panel per model) and mean KL per model/path."""
    out = []
    turns = compare_by_turn(a, b, out_dir, paths, labels)
    if turns:
        out.append(turns)
    ranking = compare_sensitivity(a, b, out_dir, labels)
    if ranking:
        out.append(ranking)
    return out


def compare_by_turn(a: pd.DataFrame, b: pd.DataFrame, out_dir: Path, paths: list[str],
                    labels: tuple[str, str]) -> dict | None:
    ta, tb = by_turn(a, "kl_mean"), by_turn(b, "kl_mean")
    models = sorted(set(ta["model"]) | set(tb["model"]))
    if not models:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(4.4 * len(models) + 1.2, 3.9), squeeze=False, sharey=True)
    seen: dict[str, str] = {}
    for ax, model in zip(axes[0], models):
        for table, style in ((ta, {"linestyle": "--", "alpha": 0.75}), (tb, {"linestyle": "-"})):
            for path, line in table[table["model"] == model].groupby("path", sort=False):
                colour = seen.setdefault(path, f"C{paths.index(path) % 10}" if path in paths else f"C{len(seen) % 10}")
                ax.plot(line["turn"], line["value"].where(np.isfinite(line["value"])), marker="o", color=colour,
                        **style)
                mark_nonfinite(ax, line["turn"], line["value"], colour)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("turn")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    _kl_axis(axes[0][0], pd.concat([ta["value"], tb["value"]]))
    handles = [Line2D([], [], color=c, linewidth=2, label=p) for p, c in seen.items()]
    handles += [Line2D([], [], color="#555", linestyle="--", label=f"A {labels[0]}"),
                Line2D([], [], color="#555", linestyle="-", label=f"B {labels[1]}")]
    fig.legend(handles=handles, loc="lower center", ncol=min(3, len(handles)), fontsize=7.5, frameon=False)
    fig.tight_layout(rect=(0, 0.05 + 0.05 * math.ceil(len(handles) / 3), 1, 1))
    return save_figure(fig, out_dir, "compare_by_turn.png", "kl_mean against turn, A dashed, B solid",
                 "Mean over scenarios per turn; one panel per model, colour = path.")


def compare_sensitivity(a: pd.DataFrame, b: pd.DataFrame, out_dir: Path, labels: tuple[str, str]) -> dict | None:
    table = sensitivity_table(a).merge(sensitivity_table(b), on=["model", "path"], how="outer", suffixes=("_a", "_b"))
    if table.empty:
        return None
    table = table.sort_values(["model", "path"])
    names = [f"{m} / {p}" for m, p in zip(table["model"], table["path"])]  # always with the model
    fig, ax = plt.subplots(figsize=(8.4, 0.55 * len(table) + 1.9))
    y = np.arange(len(table), dtype=float)
    values = pd.concat([table["kl_mean_a"], table["kl_mean_b"]]).to_numpy(float)
    _bars(ax, np.concatenate([y + 0.2, y - 0.2]), values, ["#9db7d5"] * len(table) + ["#1e6fd9"] * len(table),
          height=0.38)
    ax.set_yticks(y, names, fontsize=8)
    ax.set_xlabel("mean kl_mean (nats, log scale; value at each bar)")
    ax.grid(alpha=0.3, axis="x")
    handles = [Line2D([], [], color="#9db7d5", linewidth=8, label=f"A {labels[0]}"),
               Line2D([], [], color="#1e6fd9", linewidth=8, label=f"B {labels[1]}")]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12 * 3 / (len(table) + 3), 1, 1))
    return save_figure(fig, out_dir, "compare_sensitivity.png", "Mean KL per model and path, A and B", "")


def trend_figure(table: pd.DataFrame, model: str, target: Path, panels: list[tuple[str, str]]) -> Path:
    """One model's paths over nights (the nightly trend page): one panel per (column, title), nights on x."""
    figure, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 * len(panels)), sharex=True, squeeze=False)
    axes = axes[:, 0]
    mine = table[table["model"] == model]
    nights_order = list(dict.fromkeys(table["night"]))
    for axis, (column, title) in zip(axes, panels):
        for path, rows in mine.groupby("path", sort=False):
            series = rows.set_index("night")[column].reindex(nights_order)
            axis.plot(range(len(nights_order)), series.to_numpy(float), marker="o", label=path)
        axis.set_ylabel(title, fontsize=8)
        if column in ("kl_max", "kl_mean"):
            log_scale(axis.yaxis, "symlog", linthresh=1e-6)
    axes[-1].set_xticks(range(len(nights_order)), nights_order, rotation=30, ha="right", fontsize=7)
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    axes[0].set_title(f"{model}: verdicts and key metrics per night")
    figure.tight_layout()
    figure.savefig(target, dpi=DPI)
    plt.close(figure)
    return target
