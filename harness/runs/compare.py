"""Compare two stored runs: pair their records, flag regressions beyond noise, render the evidence.

Records pair by (model, scenario_hash, path, turn, metric), so a renamed scenario file still pairs, and paths
pair by canonical spec: B's `fp8:calibrated` is A's `fp8_e4m3:calibrated` (B's label is read as A's, and the
summary line says so).
A metric regresses for a (model, path) when the paired bootstrap confidence interval of its mean
per-scenario delta lies wholly on the metric's bad side of a tolerance, or when a threshold is crossed.
The tolerance is the largest of the noise floor (either manifest's `noise_floor` for that model and
metric), `rel_tol` times A's mean (default 1%) and the measured spread between healthy paths
(`harness.analysis.verdicts.HEALTHY_SPREAD`): a change healthy paths already differ by is not a regression. The interval's level is Bonferroni-corrected over all the (model, path,
metric) tests, so many paths and metrics do not raise a false alarm on noise alone. With few scenarios
the interval is wide: a regression in one scenario out of three is flagged by what it breaks (a failed
check, a crossed threshold), not by the interval. A case (one turn) fails when its verdict in that run
fails (`harness.analysis.verdicts`: the one meaning of failure the run, summary and report use) or a
threshold given here is crossed; failures new in B are regressions. Compare never passes what it cannot
see: a case only in B (a path new in B or renamed, a new scenario) is judged by B's own verdicts, a
path of A that B did not run is a regression (listed as missing), and a run that did not finish every unit is
refused (`IncompleteRunError`: exit 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd

from harness.analysis.verdicts import HEALTHY_SPREAD
from harness.records import METRIC_DIRECTIONS
from harness.runs.read import RunView, read_run, require_complete
from harness.runs.report import (
    StoredRun,
    environment,
    first_difference,
    format_value,
    is_worse,
    load_run,
    metric_direction,
    path_order,
    slug,
    token_key,
    token_view,
    write_page,
)

CASE = ["model", "scenario_hash", "path", "turn"]
MAX_SHOWN_CASES = 40  # regressed cases shown side by side; the tables list them all


@dataclass(frozen=True, slots=True)
class Threshold:
    """`kl_max:0.05` limits the value itself; `kl_max:+0.02` limits how much B may worsen against A.

    For a delta the sign only marks it as one: the allowance always points the metric's bad way.
    """

    metric: str
    value: float
    relative: bool

    def __post_init__(self) -> None:
        if metric_direction(self.metric) is None:
            raise ValueError(f"threshold {self.spec!r}: unknown metric {self.metric!r}; valid metrics: "
                             f"{', '.join(threshold_metrics())}, or any judge_* / attn_* metric")
        if not math.isfinite(self.value):
            raise ValueError(f"threshold {self.spec!r}: value must be a finite number")

    @property
    def spec(self) -> str:
        return f"{self.metric}:{'+' if self.relative else ''}{format_value(self.value)}"

    def crossed(self, a: float, b: float) -> str | None:
        """Why (A, B) crosses this threshold, or None. Absolute thresholds judge B alone."""
        if math.isnan(b) or (self.relative and math.isnan(a)):
            return None
        lower = metric_direction(self.metric) == "lower"
        if self.relative:
            delta, allowed = b - a, abs(self.value)
            if (delta > allowed) if lower else (delta < -allowed):
                return f"{self.metric} {'+' if delta >= 0 else ''}{format_value(delta)} vs A (allowed {self.spec})"
            return None
        if (b > self.value) if lower else (b < self.value):
            return f"{self.metric} {format_value(b)} {'>' if lower else '<'} {format_value(self.value)}"
        return None


def threshold_metrics() -> list[str]:
    """The metric names a threshold may name (those with a better direction), for error messages."""
    return sorted(m for m, d in METRIC_DIRECTIONS.items() if d in ("higher", "lower"))


def parse_threshold(spec: str) -> Threshold:
    """`metric:value` as given on the command line: `kl_max:+0.02` (delta) or `kl_max:0.05` (absolute)."""
    metric, sep, raw = spec.strip().partition(":")
    if not sep or not metric or not raw.strip():
        raise ValueError(f"threshold {spec!r}: expected METRIC:VALUE, e.g. kl_max:+0.02 or kl_max:0.05")
    raw = raw.strip()
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"threshold {spec!r}: {raw!r} is not a number") from None
    return Threshold(metric.strip(), value, relative=raw[0] in "+-")


def parse_thresholds(thresholds: Iterable[str] | dict | None) -> list[Threshold]:
    """From CLI strings (`["kl_max:+0.02"]`) or a dict (`{"kl_max": "+0.02", "kl_mean": 0.05}`)."""
    if not thresholds:
        return []
    if isinstance(thresholds, dict):
        return [parse_threshold(f"{metric}:{value}") for metric, value in thresholds.items()]
    return [parse_threshold(spec) for spec in thresholds]


# ---------------------------------------------------------------- pairing


def records_by_hash(run: StoredRun) -> pd.DataFrame:
    table = run.records.drop_duplicates(CASE + ["metric"], keep="last")
    return table[CASE + ["scenario", "metric", "value"]]


def pair_records(a: StoredRun, b: StoredRun) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Paired records (value_a, value_b, scenario names from both runs) and the unpaired cases, by side."""
    merged = records_by_hash(a).merge(records_by_hash(b), on=CASE + ["metric"], how="outer",
                                      suffixes=("_a", "_b"), indicator=True)
    both = merged[merged["_merge"] == "both"].drop(columns="_merge").reset_index(drop=True)
    both["delta"] = both["value_b"] - both["value_a"]
    loose = merged[merged["_merge"] != "both"]
    loose = loose.assign(side=loose["_merge"].map({"left_only": "only in A", "right_only": "only in B"}),
                         scenario=loose["scenario_a"].fillna(loose["scenario_b"]))
    unpaired = loose.groupby(CASE + ["scenario", "side"], as_index=False).agg(metrics=("metric", "count"))
    return both, unpaired


# ---------------------------------------------------------------- metric flags


def bootstrap_interval(deltas: np.ndarray, n_boot: int, level: float, rng: np.random.Generator) -> tuple[float, float]:
    """Percentile interval of the mean of `deltas`, resampling scenarios with replacement."""
    if not np.isfinite(deltas).all():  # an inf KL on either side: the interval is the (infinite) mean itself
        return float(deltas.mean()), float(deltas.mean())
    picks = rng.integers(0, len(deltas), size=(n_boot, len(deltas)))
    means = deltas[picks].mean(axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def noise_floor(a: StoredRun, b: StoredRun, model: str, metric: str) -> float:
    floors = [((run.manifest.get("noise_floor") or {}).get(model) or {}).get(metric) for run in (a, b)]
    return max([abs(float(f)) for f in floors if f is not None] or [0.0])


def metric_table(pairs: pd.DataFrame, a: StoredRun, b: StoredRun, thresholds: list[Threshold], n_boot: int,
                 seed: int, alpha: float, rel_tol: float) -> pd.DataFrame:
    """One row per (model, path, metric): A, B, delta, bootstrap CI, noise floor, flags."""
    directed = pairs[pairs["metric"].map(metric_direction).notna()].dropna(subset=["value_a", "value_b"])
    per_scenario = directed.groupby(["model", "path", "metric", "scenario_hash"], sort=False)[
        ["value_a", "value_b", "delta"]].mean().reset_index()
    groups = list(per_scenario.groupby(["model", "path", "metric"], sort=False))
    tests = sum(len(g) >= 2 for _, g in groups)
    level = 1 - alpha / max(tests, 1)
    rng, rows = np.random.default_rng(seed), []
    for (model, path, metric), group in groups:
        deltas = group["delta"].to_numpy(float)
        low, high = bootstrap_interval(deltas, n_boot, level, rng) if len(deltas) >= 2 else (math.nan, math.nan)
        tolerance = max(noise_floor(a, b, model, metric), rel_tol * abs(group["value_a"].mean()),
                        HEALTHY_SPREAD.get(metric, 0.0))
        lower = metric_direction(metric) == "lower"
        beyond_bad = (low > tolerance) if lower else (high < -tolerance)
        beyond_good = (high < -tolerance) if lower else (low > tolerance)
        crossed = [t.spec for t in thresholds if t.metric == metric and t.relative and any(
            t.crossed(x, y) for x, y in directed.loc[(directed.model == model) & (directed.path == path)
                                                       & (directed.metric == metric), ["value_a", "value_b"]]
            .itertuples(index=False))]
        rows.append({"model": model, "path": path, "metric": metric, "direction": metric_direction(metric),
                     "n_scenarios": len(deltas), "a": group["value_a"].mean(), "b": group["value_b"].mean(),
                     "delta": deltas.mean(), "ci_low": low, "ci_high": high, "tolerance": tolerance,
                     "ci_regressed": bool(beyond_bad), "improved": bool(beyond_good),
                     "threshold_crossed": ", ".join(crossed), "regressed": bool(beyond_bad or crossed)})
    columns = ["model", "path", "metric", "direction", "n_scenarios", "a", "b", "delta", "ci_low", "ci_high",
               "tolerance", "ci_regressed", "improved", "threshold_crossed", "regressed"]
    return pd.DataFrame(rows, columns=columns)


# ---------------------------------------------------------------- case failures


def case_failures(values: dict[str, float], thresholds: list[Threshold], other: dict[str, float] | None) -> list[str]:
    """Why one turn crosses a threshold given here: absolute ones, or (B only) delta ones vs A."""
    reasons = []
    for t in thresholds:
        if t.metric not in values or (t.relative and other is None):
            continue
        why = t.crossed(other.get(t.metric, math.nan) if t.relative else math.nan, values[t.metric])
        if why:
            reasons.append(why)
    return reasons


def verdict_failures(run: StoredRun) -> dict[tuple, list[str]]:
    """The run's failing verdict reasons per case, keyed like CASE (scenario names mapped to their hash). A task
    the reference passed and the path lost counts here although the run's verdict only warns on it (the per-path
    paired test decides there): compare pairs the same item across two runs, and an answer lost in B that A kept
    is a change of output on that item, not sampling noise."""
    hashes = {(m, s): h for m, s, h in run.records[["model", "scenario", "scenario_hash"]].itertuples(index=False)}
    out: dict[tuple, list[str]] = {}
    for row in run.view.verdicts:
        failing = [r["message"] for r in row["reasons"] if r["severity"] == "fail" or r["check"] == "task"]
        if not failing:
            continue
        key = (row["model"], hashes.get((row["model"], row["scenario"])), row["path"], row["turn"])
        out[key] = failing
    return out


def case_table(pairs: pd.DataFrame, thresholds: list[Threshold], a_run: StoredRun, b_run: StoredRun,
               unpaired: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per case: failure reasons in A and B, and new / fixed / unchanged failure / pass. Cases only in
    B are judged by B's own verdicts (a failing one is a new failure); cases only in A are left to `missing`."""
    rows, fails_a, fails_b = [], verdict_failures(a_run), verdict_failures(b_run)
    for key, group in pairs.groupby(CASE, sort=False):
        a = dict(zip(group["metric"], group["value_a"]))
        b = dict(zip(group["metric"], group["value_b"]))
        fail_a = fails_a.get(key, []) + case_failures(a, [t for t in thresholds if not t.relative], None)
        fail_b = fails_b.get(key, []) + case_failures(b, thresholds, a)
        status = ("new failure" if fail_b and not fail_a else "fixed" if fail_a and not fail_b
                  else "unchanged failure" if fail_a else "pass")
        rows.append(dict(zip(CASE, key)) | {"scenario": group["scenario_b"].iloc[0],
                                            "fail_a": "; ".join(fail_a), "fail_b": "; ".join(fail_b),
                                            "status": status})
    only_b = unpaired[unpaired["side"] == "only in B"] if unpaired is not None and len(unpaired) else []
    for case in (only_b.to_dict("records") if len(only_b) else []):
        key = tuple(case[c] for c in CASE)
        fail_b = fails_b.get(key, [])
        rows.append(dict(zip(CASE, key)) | {"scenario": case["scenario"], "fail_a": "", "fail_b": "; ".join(fail_b),
                                            "status": "new failure" if fail_b else "pass"})
    return pd.DataFrame(rows, columns=CASE + ["scenario", "fail_a", "fail_b", "status"])


QUESTION_NAMES = {"implementation": "implementation right?", "acceptable": "precision acceptable?"}


def _times(cell: dict | None) -> str:
    numbers = ((cell or {}).get("path") or {}).get("numbers") or {}
    ratio, stick = numbers.get("kl_mean_ratio"), numbers.get("yardstick_kl_mean")
    if ratio is None or stick is None:
        return "—"
    return (f"{ratio:.3g}" if isinstance(ratio, (int, float)) else str(ratio)) + f"x ({format_value(stick)})"


def question_table(a: StoredRun, b: StoredRun) -> list[dict]:
    """Per (model, path) of either run: each verdict question's answer in A and in B (turns and per-path checks
    together, harness.analysis.verdicts), the pooled KL against each run's yardstick, and the questions B newly
    fails. A question B fails that A passed or only warned is a regression, whatever the metric intervals say."""
    ma, mb = a.view.matrix, b.view.matrix
    keys = sorted({(m, p) for matrix in (ma, mb) for m, paths in matrix.items() for p in paths})
    rows = []
    for model, path in keys:
        ca, cb = (ma.get(model) or {}).get(path), (mb.get(model) or {}).get(path)
        qa, qb = (ca or {}).get("questions") or {}, (cb or {}).get("questions") or {}
        new = [QUESTION_NAMES[q] for q in QUESTION_NAMES if qb.get(q) == "fail" and qa.get(q) != "fail" and cb]
        rows.append({"model": model, "path": path, "new_failures": new,
                     "questions": [{"title": title, "a": qa.get(q, "—"), "b": qb.get(q, "—"),
                                    "state": "bad" if title in new else "good" if qb.get(q) == "pass" else
                                    "warn" if qb.get(q) in ("warn", "fail") else "none"}
                                   for q, title in QUESTION_NAMES.items()],
                     "times_a": _times(ca), "times_b": _times(cb),
                     "yardstick_a": a.manifest.get("yardstick"), "yardstick_b": b.manifest.get("yardstick")})
    return rows


def same_path_labels(a: RunView, b: RunView) -> dict[str, str]:
    """B's path labels that name one of A's paths by another spelling (same canonical spec): B label -> A label."""
    by_canonical: dict[str, str] = {}
    for path in a.manifest["paths"]:
        by_canonical.setdefault(path["canonical"], path["name"])
    pairs = {p["name"]: by_canonical.get(p["canonical"]) for p in b.manifest["paths"]}
    return {b_label: a_label for b_label, a_label in pairs.items() if a_label and a_label != b_label}


def path_changes(a: StoredRun, b: StoredRun) -> tuple[list[str], list[str]]:
    """(paths new in B, paths of A that B did not run), candidates only (the reference is always there)."""
    def names(run: StoredRun) -> list[str]:
        return [p for p in dict.fromkeys(run.records["path"]) if p != "reference"]
    in_a, in_b = names(a), names(b)
    return [p for p in in_b if p not in in_a], [p for p in in_a if p not in in_b]


def worst_cases(pairs: pd.DataFrame, metrics: pd.DataFrame) -> pd.DataFrame:
    """For each metric flagged by its interval, the paired turn that worsened most."""
    picked = []
    for flagged in metrics[metrics["ci_regressed"]].itertuples():
        hit = pairs[(pairs.model == flagged.model) & (pairs.path == flagged.path)
                    & (pairs.metric == flagged.metric)].dropna(subset=["delta"])
        hit = hit[[is_worse(flagged.metric, d) for d in hit["delta"]]]
        if not hit.empty:
            signed = hit["delta"] if flagged.direction == "lower" else -hit["delta"]
            picked.append(hit.loc[signed.idxmax(), CASE + ["scenario_b"]])
    return pd.DataFrame(picked)


# ---------------------------------------------------------------- result


@dataclass
class CompareResult:
    run_a: StoredRun
    run_b: StoredRun
    pairs: pd.DataFrame  # paired records: CASE, metric, value_a, value_b, delta
    metrics: pd.DataFrame  # one row per (model, path, metric); see metric_table
    cases: pd.DataFrame  # one row per paired case; see case_table
    unpaired: pd.DataFrame  # CASE, scenario, side, metrics
    thresholds: list[Threshold] = field(default_factory=list)
    settings: dict = field(default_factory=dict)  # n_boot, seed, alpha, rel_tol: shown on the page
    report_path: Path | None = None
    new_paths: list[str] = field(default_factory=list)  # in B only: judged by B's own verdicts
    missing_paths: list[str] = field(default_factory=list)  # in A only: B cannot show they still pass
    questions: list[dict] = field(default_factory=list)  # per (model, path): the two questions in A and B
    renamed: dict[str, str] = field(default_factory=dict)  # B's label -> A's, same canonical spec

    @property
    def new_question_failures(self) -> list[dict]:
        return [q for q in self.questions if q["new_failures"]]

    @property
    def regressed_metrics(self) -> pd.DataFrame:
        return self.metrics[self.metrics["regressed"]]

    def with_status(self, status: str) -> pd.DataFrame:
        return self.cases[self.cases["status"] == status]

    @property
    def regressed(self) -> bool:
        return bool(len(self.regressed_metrics) or len(self.with_status("new failure")) or self.missing_paths
                    or self.new_question_failures)

    @property
    def summary_line(self) -> str:
        """One line for CI logs: verdict, what regressed (first few), then the counts."""
        new = self.with_status("new failure")
        parts = []
        if len(new):
            named = "; ".join(f"{r.scenario} {r.path} turn {r.turn}: {r.fail_b.split('; ')[0]}"
                              for r in new.head(2).itertuples())
            parts.append(f"{len(new)} new failure(s) ({named}{'; ...' if len(new) > 2 else ''})")
        worse = self.regressed_metrics
        if len(worse):
            named = ", ".join(f"{r.path} {r.metric} {'+' if r.delta >= 0 else ''}{format_value(r.delta)}"
                              for r in worse.head(3).itertuples())
            parts.append(f"{len(worse)} metric(s) worse beyond noise or threshold ({named}"
                         f"{', ...' if len(worse) > 3 else ''})")
        if self.missing_paths:
            parts.append(f"path(s) of A not run in B: {', '.join(self.missing_paths)}")
        failing = self.new_question_failures
        if failing:
            named = "; ".join(f"{q['model']} {q['path']}: {', '.join(q['new_failures'])}" for q in failing[:3])
            parts.append(f"{len(failing)} path(s) newly fail a verdict question ({named}"
                         f"{'; ...' if len(failing) > 3 else ''})")
        head = "REGRESSION: " + "; ".join(parts) if parts else "OK: no regression beyond noise"
        if self.new_paths:
            head += f"; new in B (judged by its own verdicts): {', '.join(self.new_paths)}"
        if self.renamed:
            head += "; paired by canonical spec: " + ", ".join(f"B {b} = A {a}" for b, a in self.renamed.items())
        return (f"{head}; {len(new)} new, {len(self.with_status('fixed'))} fixed, "
                f"{len(self.with_status('unchanged failure'))} unchanged failure(s); {len(self.pairs)} paired records, "
                f"{len(self.unpaired)} unpaired case(s) [A {self.run_a.run_id} -> B {self.run_b.run_id}]")

    def regressed_cases(self) -> list[dict]:
        """New failures, then the worst turn of each metric its interval flagged: A and B outputs side by side."""
        chosen = self.with_status("new failure")[CASE + ["scenario", "fail_b"]]
        worst = worst_cases(self.pairs, self.metrics).rename(columns={"scenario_b": "scenario"})
        table = pd.concat([chosen, worst], ignore_index=True).drop_duplicates(CASE)
        names = (scenario_names(self.run_a), scenario_names(self.run_b))
        return [side_by_side(self.run_a, self.run_b, row, names)
                for row in table.head(MAX_SHOWN_CASES).to_dict("records")]

    def render(self, out_dir: Path | str) -> Path:
        """Write compare.html and its plots into out_dir; return the page's path."""
        from reports import plots

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = list(dict.fromkeys(path_order(self.run_a) + path_order(self.run_b)))
        figures = plots.compare_plots(self.run_a.records, self.run_b.records, out, paths,
                                      (self.run_a.run_id, self.run_b.run_id))
        self.report_path = write_page(environment(), out, "compare.html", "compare.html", result=self,
                                      metric_rows=metric_rows(self.metrics, self.pairs), cases=self.regressed_cases(),
                                      figures=figures)
        return self.report_path


def scenario_names(run: StoredRun) -> dict[str, str]:
    return dict(zip(run.records["scenario_hash"], run.records["scenario"]))


def side_by_side(a: StoredRun, b: StoredRun, case: dict, names: tuple[dict, dict]) -> dict:
    """One regressed turn: A's and B's outputs for the same path, the first differing token marked in both."""
    text_a = a.text(case["model"], names[0].get(case["scenario_hash"], ""), case["path"], case["turn"])
    text_b = b.text(case["model"], names[1].get(case["scenario_hash"], ""), case["path"], case["turn"])
    at = first_difference(token_key(text_a), token_key(text_b))
    reason = case.get("fail_b")
    return {**case, "why": reason if isinstance(reason, str) and reason else "worst turn of a flagged metric",
            "anchor": slug(f"{case['model']}|{case['scenario_hash']}|{case['path']}|{case['turn']}"),
            "user": (text_b or text_a or {}).get("user", ""), "diverged_at": at,
            "tokens_a": token_view(text_a, at), "tokens_b": token_view(text_b, at),
            "missing": [side for side, t in (("A", text_a), ("B", text_b)) if t is None]}


def metric_rows(metrics: pd.DataFrame, pairs: pd.DataFrame | None = None) -> list[dict]:
    """The metric table as shown: regressed, improved, inconclusive first; each row labelled by what the
    interval can say at this sample size, with the per-scenario evidence of rows that are not settled."""
    rows = []
    for r in metrics.to_dict("records"):
        flag, needed = metric_flag(r)
        state = "bad" if r["regressed"] else "good" if r["improved"] else "warn" if flag.startswith("inconclusive") \
            else "none"
        ci = "—" if math.isnan(r["ci_low"]) else f"[{format_value(r['ci_low'])}, {format_value(r['ci_high'])}]"
        evidence = scenario_evidence(pairs, r) if pairs is not None and state != "none" else []
        rows.append(r | {"state": state, "flag": flag, "ci": ci, "needed": needed, "evidence": evidence,
                         "changed": state != "none"})
    order = {"bad": 0, "warn": 1, "good": 2, "none": 3}
    return sorted(rows, key=lambda r: (order[r["state"]], r["model"], r["path"], r["metric"]))


def metric_flag(row: dict) -> tuple[str, str]:
    """(label, what would decide it). 'within noise' only when the whole interval sits inside the tolerance;
    an interval that reaches past it is 'inconclusive (n=...)', with the number of scenarios at which an
    interval of the same spread would settle the question (it narrows as 1/sqrt(n))."""
    if row["regressed"]:
        return "regressed", ""
    if row["improved"]:
        return "improved", ""
    if row["delta"] == 0 and (math.isnan(row["ci_low"]) or row["ci_low"] == row["ci_high"] == 0):
        return "unchanged", ""
    n, tol = int(row["n_scenarios"]), row["tolerance"]
    if math.isnan(row["ci_low"]):
        return f"inconclusive (n={n})", "at least 2 paired scenarios give an interval"
    if -tol <= row["ci_low"] and row["ci_high"] <= tol:
        return "within noise", ""
    half = (row["ci_high"] - row["ci_low"]) / 2
    gap = abs(abs(row["delta"]) - tol)
    if not math.isfinite(half) or gap == 0:
        return f"inconclusive (n={n})", "more scenarios"
    needed = math.ceil(n * (half / gap) ** 2)
    return f"inconclusive (n={n})", f"about {needed} scenarios at this spread"


def scenario_evidence(pairs: pd.DataFrame, row: dict) -> list[dict]:
    """Per scenario (mean over its turns): A, B and the delta of one (model, path, metric), worst first."""
    hit = pairs[(pairs.model == row["model"]) & (pairs.path == row["path"]) & (pairs.metric == row["metric"])]
    if hit.empty:
        return []
    per = hit.groupby("scenario_b", sort=False)[["value_a", "value_b", "delta"]].mean().reset_index()
    worse = per["delta"] if row["direction"] == "lower" else -per["delta"]
    per = per.assign(worse=worse.fillna(0)).sort_values("worse", ascending=False)
    return [{"scenario": e.scenario_b, "a": format_value(e.value_a), "b": format_value(e.value_b),
             "delta": format_value(e.delta), "worse": bool(e.worse > 0)} for e in per.itertuples()]


def compare_runs(run_a: Path | str, run_b: Path | str, out_dir: Path | str | None = None,
                 thresholds: dict | Iterable[str] | None = None, n_boot: int = 2000, seed: int = 0,
                 alpha: float = 0.05, rel_tol: float = 0.01) -> CompareResult:
    """Compare stored run B against A; render compare.html into out_dir when one is given.

    thresholds: `["kl_max:+0.02", "kl_mean:0.05"]` or `{"kl_max": "+0.02"}` (see `Threshold`).
    alpha: family-wise error rate of the interval flags; rel_tol: smallest relative change that counts.
    An incomplete run (killed, interrupted, units failed) is refused: `IncompleteRunError`.
    """
    view_a, view_b = (require_complete(read_run(run)) for run in (run_a, run_b))
    a = load_run(run_a)
    renamed = same_path_labels(view_a, view_b)
    b = load_run(run_b, renamed)
    parsed = parse_thresholds(thresholds)
    pairs, unpaired = pair_records(a, b)
    new_paths, missing_paths = path_changes(a, b)
    result = CompareResult(a, b, pairs, metric_table(pairs, a, b, parsed, n_boot, seed, alpha, rel_tol),
                           case_table(pairs, parsed, a, b, unpaired), unpaired, parsed,
                           {"n_boot": n_boot, "seed": seed, "alpha": alpha, "rel_tol": rel_tol},
                           new_paths=new_paths, missing_paths=missing_paths, questions=question_table(a, b),
                           renamed=renamed)
    if out_dir is not None:
        result.render(out_dir)
    return result


def default_compare_dir(run_a: Path | str, run_b: Path | str) -> Path:
    """Where `harness compare A B` writes without --out: ./compare-<A>-vs-<B> (runs stay append-only)."""
    return Path(f"compare-{Path(run_a).resolve().name}-vs-{Path(run_b).resolve().name}")
