"""The one-screen summary of a stored run: one row per model and path (the reference included)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.runs.read import RunView, read_run

COLUMNS = {  # metric -> (column title, aggregate over turns)
    "answer_correct": ("answer acc", "mean"),
    "rules_followed": ("rules kept", "mean"),
    "exact_match": ("turns identical", "mean"),
    "first_divergent_token": ("turns diverged", "count"),
    "kl_mean": ("KL mean", "mean"),
    "kl_p999": ("KL p99.9", "max"),  # gating percentile (the max grows with the tokens; docs/VERDICTS.md)
    "kl_max": ("KL max", "max"),  # diagnostic only
    "confident_flips": ("confident flips", "sum"),  # argmax changed where the reference was sure (> 1 nat)
    "top1_agree": ("top-1 agree", "mean"),
    "kv_clipped_frac": ("clipped", "mean"),
    "kv_nonfinite": ("KV non-finite", "max"),  # shown only when some path read a NaN/inf back from its cache
    "kernel_err_ratio": ("kernel err / torch err", "max"),  # GPU runs: our decode kernel's agreement
    "kernel_ms_per_step": ("kernel ms/step", "mean"),  # its time per decode call (plug-ins compared in one run)
    "attn_out_rel_err_max": ("attn out err max", "max"),  # runs with --attention: worst attention-output error
    "attn_kernel_vs_torch_max": ("kernel attn vs torch", "max"),  # its decode kernel vs torch on the same codes
}
UNMEASURED = "—"  # a cell no record measured, e.g. kernel ms/step when CUDA graphs replay the kernel
SHOWN_WHEN_NONZERO = {"kv_nonfinite"}  # healthy runs are all zero there: no column to read past


def records_frame(run_dir: Path) -> pd.DataFrame:
    """The run's records, one row per (model, scenario, path, turn, metric), NaN/inf restored."""
    return read_run(run_dir).records_frame


def summary_table(run_dir: Path | RunView) -> pd.DataFrame:
    """One row per (model, path), the reference first: each COLUMNS metric aggregated over turns. A metric a
    path has no measurement of is NaN (shown "unmeasured"), never 0."""
    run = run_dir if isinstance(run_dir, RunView) else read_run(run_dir)
    frame = run.records_frame
    order = ["reference"] + [p["name"] for p in run.manifest.get("paths", [])]
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


def _times(path: str, cell: dict) -> str:
    """The path's pooled kl_mean as a multiple of the yardstick's, with the yardstick's value beside it."""
    whole = cell.get("path") or {}
    numbers = whole.get("numbers") or {}
    role = whole.get("role") or ""
    if role:  # measured beside the paths: the fp32 reference's noise, the yardstick's twin, the control arm
        name = role.split(" (")[0].split(":")[0]
        return f"({name}: KL mean {numbers['kl_mean']:.2g})" if numbers.get("kl_mean") is not None else f"({name})"
    noise = numbers.get("kl_mean_over_noise")
    beside = f"; {noise:.3g}x the fp32 noise" if noise is not None else ""
    if path == whole.get("yardstick"):
        twin = numbers.get("yardstick_twin_ratio")
        return "(yardstick" + (f"; {twin:.3g}x its twin" if twin is not None else "") + beside + ")"
    ratio, stick = numbers.get("kl_mean_ratio"), numbers.get("yardstick_kl_mean")
    if ratio is None or stick is None:
        return beside.removeprefix("; ") or "-"
    from harness.analysis.verdicts import KL_RATIO_FLOOR

    shown = f"{ratio:.3g}" if isinstance(ratio, float) else str(ratio)
    if stick < KL_RATIO_FLOOR:  # the yardstick reproduced the reference: the ratio divides by the floor
        return f"{shown}x of the floor {KL_RATIO_FLOOR:g} (yardstick {stick:.2g}){beside}"
    return f"{shown}x of {stick:.2g}{beside}"


def _path_verdict(cell: dict) -> str:
    path = (cell.get("path") or {}).get("verdict", "pass")
    worst = "fail" if cell["fail"] or path == "fail" else "warn" if cell["warn"] or path == "warn" else "pass"
    return {"fail": "FAIL", "warn": "warn", "pass": "pass"}[worst]


def verdict_table(matrix: dict, order: list[str]) -> pd.DataFrame:
    """Models x paths: the path's verdict, each question's verdict, the pooled KL against the yardstick,
    pass/warn/fail turn counts and the worst finding (a per-path check first, else the worst turn)."""
    rows = []
    for model, paths in sorted(matrix.items()):
        for path in sorted(paths, key=lambda p: (order.index(p) if p in order else len(order), p)):
            cell = paths[path]
            verdict = _path_verdict(cell)
            questions = cell.get("questions") or {}
            worst = cell.get("worst_turn") or {}
            whole = [r for r in (cell.get("path") or {}).get("reasons", []) if r["severity"] != "pass"]
            whole.sort(key=lambda r: r["severity"] != "fail")
            if whole and (whole[0]["severity"] == "fail" or not cell["fail"]):
                where = f"all turns: {whole[0]['message']}"
            else:
                where = (f"{worst['scenario']} turn {worst['turn']}: {worst.get('reason', '')}"
                         if verdict != "pass" and worst else "")
            rows.append({"model": model, "path": path, "verdict": verdict,
                         "implementation": questions.get("implementation", "-"),
                         "acceptable": questions.get("acceptable", "-"), "KL vs yardstick": _times(path, cell),
                         "pass": cell["pass"], "warn": cell["warn"], "fail": cell["fail"], "worst": where})
    return pd.DataFrame(rows).set_index(["model", "path"]) if rows else pd.DataFrame()


def format_verdicts(verdicts: pd.DataFrame, yardstick: str | None = None) -> str:
    """The verdict matrix as left-aligned text: one line per model and path."""
    table = verdicts.reset_index()
    named = ("model", "path", "verdict", "implementation", "acceptable", "KL vs yardstick")
    widths = {c: max(len(c), *(len(str(v)) for v in table[c])) for c in named}
    head = "  ".join(f"{c:<{widths[c]}}" for c in named) + f"  {'pass':>4} {'warn':>4} {'fail':>4}  worst"
    lines = ["verdicts per path: implementation right? / precision acceptable? (turn counts; docs/VERDICTS.md)"
             + (f"; yardstick {yardstick}" if yardstick else ""), head]
    for r in table.to_dict("records"):
        lines.append("  ".join(f"{str(r[c]):<{widths[c]}}" for c in named)
                     + f"  {r['pass']:>4} {r['warn']:>4} {r['fail']:>4}  {r['worst']}".rstrip())
    return "\n".join(lines)


def unanswered_lines(matrix: dict) -> list[str]:
    """One line per reason a question went unanswered in this run, with the (model, path) pairs it applies to."""
    grouped: dict[str, list[str]] = {}
    for model, paths in sorted(matrix.items()):
        for path, cell in sorted(paths.items()):
            for why in (cell.get("path") or {}).get("unanswered", []):
                grouped.setdefault(why, []).append(f"{model} {path}")
    return [f"not answered: {why} [{', '.join(pairs)}]" for why, pairs in grouped.items()]


def format_summary(run_dir: Path) -> str:
    """The verdict matrix first (what may ship), then the numbers behind it."""
    run = read_run(run_dir)
    manifest = run.manifest
    order = [p["name"] for p in manifest.get("paths", [])]
    matrix = run.matrix
    verdicts = verdict_table(matrix, order)
    summary = summary_table(run)
    parts = []
    if not verdicts.empty:
        unanswered = unanswered_lines(matrix)
        parts.append(format_verdicts(verdicts, manifest.get("yardstick"))
                     + ("\n" + "\n".join(unanswered[:12]) if unanswered else "")
                     + (f"\n(and {len(unanswered) - 12} more: path_verdicts.jsonl)" if len(unanswered) > 12 else ""))
    if summary.empty:
        parts.append("(no records)")
    else:
        unmeasured = summary.isna().any().any()
        parts.append(summary.to_string(float_format=lambda v: f"{v:.3g}", na_rep=UNMEASURED)
                     + (f"\n{UNMEASURED} = not measured for that model and path (never shown as 0)" if unmeasured else ""))
    return "\n\n".join(parts)
