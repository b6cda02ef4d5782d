"""Default verdicts: every (model, scenario, path, turn) of a candidate path gets pass, warn or fail.

Pure functions on a run's plain rows (records, checks, judgements, errors as stored in the run
directory), so a run made before verdicts existed gets the same verdicts computed on the fly.

Checks (each turn of each candidate path; severity in brackets):
- task [fail]: a task check (`answer_correct`, `rules_followed`) the reference passed and the path failed.
- divergence [warn / fail]: teacher-forced `kl_max` / `kl_mean` beyond `DEFAULT_THRESHOLDS`.
- nonfinite [fail]: a metric stored as NaN/inf, or NaN/inf read back from the KV cache (`kv_nonfinite`).
- degenerate [fail / warn]: the rule judge found a repetition loop the reference's reply does not have
  [fail], or non-text output or an EOS before half the reference's length [warn].
- threshold [fail]: a scenario file's threshold (stored in checks.jsonl) or a `--threshold` override.
- unmeasured [warn]: the turn has no teacher-forced divergence (e.g. an endpoint without logprobs) or
  its unit errored: nothing about it can pass unseen.

Precedence for one metric: a `--threshold` override, then the scenario file's threshold, then the default.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from harness.records import METRIC_DIRECTIONS

REFERENCE = "reference"
VERDICTS = ("pass", "warn", "fail")
TASK_METRICS = ("answer_correct", "rules_followed")
DIVERGENCE_METRICS = ("kl_max", "kl_mean")


@dataclass(frozen=True, slots=True)
class DefaultThreshold:
    """One default limit on a lower-is-better metric, and the measurement it came from."""

    metric: str
    warn: float | None  # beyond the largest healthy value measured (plus a margin): worth a look
    fail: float  # far beyond it: the path may not ship
    measured: str

    def __post_init__(self) -> None:
        if METRIC_DIRECTIONS.get(self.metric) != "lower":
            raise ValueError(f"DefaultThreshold {self.metric!r}: only lower-is-better metrics have defaults")
        if self.warn is not None and not 0 <= self.warn < self.fail:
            raise ValueError(f"DefaultThreshold {self.metric!r}: need 0 <= warn < fail, got {self.warn}, {self.fail}")


# THE table of default thresholds. Measured on a default `harness run` at commit 53e7c3c (default canary
# scenarios x gqa/mla/hybrid canaries, CPU, reference-history): the healthy FP8 paths fp8_e4m3,
# fp8_e4m3:per_head:calibrated and fp8_e5m2 over 189 turns (21 turns x 3 paths x 3 canaries); every one
# of those turns gave the reference's answer, kept its rules and matched its reply token for token.
DEFAULT_THRESHOLDS: tuple[DefaultThreshold, ...] = (
    DefaultThreshold(
        "kl_max", warn=0.3, fail=1.0,
        measured="healthy FP8 paths on the canaries: median 4.4e-6, p99 0.036, max 0.238 nats (mla fp8_e5m2, "
                 "canary-arith-2); warn = max + 25%, fail = 4x max rounded to 1 nat (the reference token's "
                 "probability can fall by a factor e)"),
    DefaultThreshold(
        "kl_mean", warn=0.25, fail=0.5,
        measured="healthy FP8 paths on the canaries: median 2.0e-7, p99 0.019, max 0.190 nats (mla fp8_e5m2, "
                 "canary-arith-2); warn = max + 30%, fail = 2.6x max rounded to 0.5 nats"),
    DefaultThreshold(
        "attn_impl_err_ratio", warn=1.4, fail=1.8,
        measured="the implementation check (harness/kv_paths/impl_check.py), CPU, one sequence at a time, "
                 "benchmarks/impl_check.py: gqa --tokens 16 on canary-arith-1, recall-1, chat-1, needle-1 (7 "
                 "turns), mla --tokens 12 on recall-1, chat-1 (5 turns). Healthy per-turn max: gqa 1.09-1.13 (bf16, fp8_e4m3, per-head calibrated, e5m2, "
                 "fp8_q:fp8_p calibrated 1.131), mla 1.00-1.08; random-weight llama on free text 1.04-1.07. Fault "
                 "injectors, per-turn min gqa / mla: scores_bf16 3.27 / 3.07, scale_off 3.88 / 4.11, exp_poly "
                 "2.93 / 3.14, pv_bf16 1.71 (4-key tiles, since made 1-key) / 4.90, p_e5m2 35.0 / 32.7, "
                 "k_scale_swap 108 (gqa; MLA keeps one latent scale: nothing to swap). warn = healthy max + 24%; "
                 "fail = 1.6x healthy max. Not yet measured: CUDA with our decode kernels (tests/test_impl_check.py "
                 "--gpu)"),
)
# Compare's tolerance floor per metric (harness/runs/compare.py): how far apart equally healthy paths sit.
# Measured on that same run: for each canary, the mean of each metric over its 21 turns on each of
# the three healthy FP8 paths; the spread is max - min across those paths, and the value here the largest
# spread over the three canaries (mla for every KL and log-prob metric). A change smaller than this is
# within what healthy paths already differ by; a change that matters crosses a verdict threshold instead.
# Metrics not listed measured a spread of 0 (task checks, exact match, ranks, reply lengths).
HEALTHY_SPREAD: dict[str, float] = {
    "kl_max": 0.0143, "kl_mean": 0.0108,
    "ref_logprob_delta_mean": 0.0046, "ref_logprob_delta_min": 0.0024,
    "kv_clipped_frac": 0.000127, "kv_amax_over_max": 1.36,
}
DEGENERATION_MEASURED = ("rule judge (harness/judges/rules.py DegenerationLimits): 0 repetition loops, 0 non-text "
                         "findings and 0 early EOS on the 189 healthy canary turns")


@dataclass(frozen=True, slots=True)
class Limit:
    """A limit in force for one metric: from the defaults, a scenario file or the command line."""

    metric: str
    fail: float
    source: str  # "default", a scenario file path, or "--threshold"
    warn: float | None = None

    def __post_init__(self) -> None:
        if METRIC_DIRECTIONS.get(self.metric) in (None, "none"):
            raise ValueError(f"threshold on {self.metric!r}: expected a metric with a direction in "
                             f"harness.records.METRIC_DIRECTIONS")
        if not math.isfinite(self.fail):
            raise ValueError(f"threshold {self.metric}:{self.fail}: the limit must be a finite number")

    def severity(self, value: float) -> str | None:
        lower = METRIC_DIRECTIONS[self.metric] == "lower"
        beyond = (lambda limit: value > limit) if lower else (lambda limit: value < limit)
        if beyond(self.fail):
            return "fail"
        return "warn" if self.warn is not None and beyond(self.warn) else None


def default_limits() -> dict[str, Limit]:
    return {t.metric: Limit(t.metric, t.fail, "default", t.warn) for t in DEFAULT_THRESHOLDS}


def parse_threshold_overrides(specs: Iterable[str] | None) -> dict[str, Limit]:
    """`["kl_max:0.5", "top1_agree:0.99"]` (the `--threshold` option): each replaces the default or scenario
    limit of that metric (a failing limit, no warn level), or adds a check on a metric with no default."""
    limits = {}
    for spec in specs or ():
        metric, sep, raw = spec.strip().partition(":")
        try:
            limit = float(raw)
        except ValueError:
            limit = math.nan
        if not sep or not metric or not math.isfinite(limit):
            raise ValueError(f"--threshold {spec!r}: expected METRIC:LIMIT with a finite number, e.g. kl_max:0.5")
        limits[metric] = Limit(metric, limit, "--threshold")
    return limits


def _reason(check: str, metric: str | None, value, limit, source: str, severity: str, message: str) -> dict:
    return {"check": check, "metric": metric, "value": value, "limit": limit, "source": source,
            "severity": severity, "message": message}


def _fmt(value) -> str:
    return "null" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def _number(row: Mapping) -> float | None:
    """A stored record's value as a float: NaN/inf come back from `value_text`, null stays None."""
    text = row.get("value_text")
    if text is not None:
        return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[text]
    value = row.get("value")
    return None if value is None else float(value)


# ---------------------------------------------------------------- the checks


def task_reasons(values: Mapping[str, float | None], reference: Mapping[str, float | None]) -> list[dict]:
    reasons = []
    for metric in TASK_METRICS:
        if values.get(metric) == 0 and reference.get(metric) == 1:
            what = "answer" if metric == "answer_correct" else "rules"
            reasons.append(_reason("task", metric, 0.0, 1.0, "reference", "fail",
                                   f"{metric} 0: the reference got the {what} right, this path did not"))
    return reasons


def limit_reasons(values: Mapping[str, float | None], limits: Mapping[str, Limit]) -> list[dict]:
    reasons = []
    for metric, limit in limits.items():
        value = values.get(metric)
        if value is None or not math.isfinite(value):
            continue  # missing: the unmeasured check; non-finite: the nonfinite check
        severity = limit.severity(value)
        if severity is None:
            continue
        bound = limit.fail if severity == "fail" else limit.warn
        sign = ">" if METRIC_DIRECTIONS[metric] == "lower" else "<"
        check = "divergence" if metric in DIVERGENCE_METRICS else "threshold"
        reasons.append(_reason(check, metric, value, bound, limit.source, severity,
                               f"{metric} {value:.4g} {sign} {bound:g} ({severity} threshold from {limit.source})"))
    return reasons


def nonfinite_reasons(values: Mapping[str, float | None]) -> list[dict]:
    reasons = [_reason("nonfinite", metric, None, None, "default", "fail", f"{metric} is {value}")
               for metric, value in values.items() if value is not None and not math.isfinite(value)]
    cache = values.get("kv_nonfinite")
    if cache is not None and math.isfinite(cache) and cache > 0:
        reasons.append(_reason("nonfinite", "kv_nonfinite", cache, 0.0, "default", "fail",
                               f"{cache:g} NaN/inf value(s) read back from the KV cache"))
    return reasons


# Non-text output only warns: its "token that decodes to no text" finding also matches byte-fallback pieces
# of real tokenizers (one emoji = several such tokens), so a diverged but healthy reply can show it.
DEGENERATION = (("repetition loop", "fail"), ("non-text output", "warn"), ("early EOS", "warn"))


def degeneration_reasons(findings: list[str], reference_findings: list[str]) -> list[dict]:
    """The rule judge's degeneration findings on this reply that the reference's reply does not share."""
    reasons = []
    for prefix, severity in DEGENERATION:
        own = [f for f in findings if f.startswith(prefix)]
        if own and not any(f.startswith(prefix) for f in reference_findings):
            reasons.append(_reason("degenerate", None, None, None, "default (rule judge)", severity, own[0]))
    return reasons


def unmeasured_reasons(values: Mapping[str, float | None]) -> list[dict]:
    if any(metric in values for metric in DIVERGENCE_METRICS):
        return []
    return [_reason("unmeasured", "kl_max", None, None, "default", "warn",
                    "no teacher-forced divergence measured for this turn (backend gave no logprobs)")]


# ---------------------------------------------------------------- one run


def _index(rows: Iterable[Mapping]) -> dict[tuple, dict[str, float | None]]:
    table: dict[tuple, dict[str, float | None]] = defaultdict(dict)
    for row in rows:
        table[(row["model"], row["scenario"], row["path"], row["turn"])][row["metric"]] = _number(row)
    return table


def _findings(judgements: Iterable[Mapping]) -> dict[tuple, list[str]]:
    found = {}
    for row in judgements:
        if row.get("metric") == "judge_rule":
            found[(row["model"], row["scenario"], row["path"], row["turn"])] = \
                list((row.get("detail") or {}).get("findings") or [])
    return found


def _scenario_checks(checks: Iterable[Mapping], sources: Mapping[str, str]) -> dict[tuple, list[dict]]:
    """Failed scenario-threshold checks by turn, as reasons."""
    found: dict[tuple, list[dict]] = defaultdict(list)
    for row in checks:
        key = (row["model"], row["scenario"], row["path"], row["turn"])
        if not row.get("passed", True):
            source = sources.get(row["scenario"], "scenario file")
            message = re.sub(r"^turn \d+: ", "", row.get("message") or f"{row['metric']} beyond {row.get('limit')}")
            found[key].append(_reason("threshold", row["metric"], row.get("value"), row.get("limit"), source,
                                      "fail", message))
    return found


def _limited_metrics(checks: Iterable[Mapping]) -> dict[tuple, set[str]]:
    limited: dict[tuple, set[str]] = defaultdict(set)
    for row in checks:
        limited[(row["model"], row["scenario"], row["path"], row["turn"])].add(row["metric"])
    return limited


def verdict_of(reasons: list[dict]) -> str:
    severities = {r["severity"] for r in reasons}
    return "fail" if "fail" in severities else "warn" if "warn" in severities else "pass"


def compute_verdicts(records: Iterable[Mapping], checks: Iterable[Mapping] = (), judgements: Iterable[Mapping] = (),
                     errors: Iterable[Mapping] = (), overrides: Mapping[str, Limit] | None = None,
                     scenario_sources: Mapping[str, str] | None = None,
                     random_weight_models: Iterable[str] = ()) -> list[dict]:
    """One verdict row per (model, scenario, path, turn) of every candidate path (contract: docs/CONTRACTS.md).

    Models with random weights (tests, no trained canary) write noise: their task and degeneration checks
    mean nothing and are left out; divergence, non-finite and threshold checks still apply."""
    noise_models = set(random_weight_models)
    checks = list(checks)
    values = _index(records)
    findings = _findings(judgements)
    scenario = _scenario_checks(checks, scenario_sources or {})
    limited = _limited_metrics(checks)
    overrides = dict(overrides or {})
    rows = []
    for key in sorted(k for k in values if k[2] != REFERENCE):
        model, name, path, turn = key
        own, reference = values[key], values.get((model, name, REFERENCE, turn), {})
        limits = {m: lim for m, lim in default_limits().items() if m not in limited.get(key, ())} | overrides
        scenario_reasons = [r for r in scenario.get(key, []) if r["metric"] not in overrides]
        text_reasons = [] if model in noise_models else (
            task_reasons(own, reference)
            + degeneration_reasons(findings.get(key, []), findings.get((model, name, REFERENCE, turn), [])))
        reasons = (text_reasons + limit_reasons(own, limits) + scenario_reasons + nonfinite_reasons(own)
                   + unmeasured_reasons(own))
        rows.append(_row(key, reasons))
    return rows + _error_rows(errors, {k[:3] for k in values})


def _row(key: tuple, reasons: list[dict]) -> dict:
    model, scenario, path, turn = key
    return {"model": model, "scenario": scenario, "path": path, "turn": turn, "verdict": verdict_of(reasons),
            "reasons": reasons}


def _error_rows(errors: Iterable[Mapping], measured_units: set[tuple]) -> list[dict]:
    """A unit that errored and left no records still gets a row: it is unmeasured, never silently passed."""
    rows, seen = [], set()
    for error in errors:
        unit = (error["model"], error["scenario"], error["path"])
        if error["path"] == REFERENCE or unit in measured_units or unit in seen:
            continue
        seen.add(unit)
        reason = _reason("unmeasured", None, None, None, "run", "warn", f"unit errored: {error.get('error', '?')}")
        rows.append(_row((*unit, error.get("turn")), [reason]))
    return rows


# ---------------------------------------------------------------- the matrix


def _badness(row: Mapping) -> tuple:
    """Sort key: fail > warn > pass, then how far past its limit the worst reason went."""
    ratio = 0.0
    for reason in row["reasons"]:
        value, limit = reason.get("value"), reason.get("limit")
        if isinstance(value, (int, float)) and isinstance(limit, (int, float)) and limit:
            ratio = max(ratio, abs(value / limit))
        elif reason["severity"] == "fail":
            ratio = max(ratio, math.inf)
    return VERDICTS.index(row["verdict"]), ratio


def verdict_matrix(rows: Iterable[Mapping]) -> dict[str, dict[str, dict]]:
    """{model: {path: {"pass": n, "warn": n, "fail": n, "worst_turn": {...}}}} (the manifest's `verdicts`)."""
    grouped: dict[str, dict[str, list[Mapping]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        grouped[row["model"]][row["path"]].append(row)
    matrix: dict[str, dict[str, dict]] = {}
    for model, paths in grouped.items():
        for path, turns in paths.items():
            counts = {v: sum(r["verdict"] == v for r in turns) for v in VERDICTS}
            worst = max(turns, key=_badness)
            first = worst["reasons"][0]["message"] if worst["reasons"] else ""
            matrix.setdefault(model, {})[path] = counts | {"worst_turn": {
                "scenario": worst["scenario"], "turn": worst["turn"], "verdict": worst["verdict"], "reason": first}}
    return matrix


def failing_paths(matrix: Mapping[str, Mapping[str, Mapping]]) -> list[tuple[str, str]]:
    """(model, path) of every path with at least one failing turn."""
    return [(model, path) for model, paths in matrix.items() for path, cell in paths.items() if cell["fail"]]


# ---------------------------------------------------------------- diagnosis


def _context(tokens: list[str], at: int, width: int = 6) -> str:
    before = "".join(tokens[max(0, at - width):at])
    here = tokens[at] if at < len(tokens) else "<end>"
    after = "".join(tokens[at + 1:at + 1 + width])
    return f"{'...' if at > width else ''}{before}[{here}]{after}{'...' if at + 1 + width < len(tokens) else ''}"


def first_divergence(reference: Mapping | None, path: Mapping | None) -> str | None:
    """`first divergent token N: reference '...[x]...' vs path '...[y]...'` from two texts.jsonl rows."""
    if not reference or not path:
        return None
    ref_ids, own_ids = list(reference.get("token_ids") or []), list(path.get("token_ids") or [])
    if ref_ids == own_ids:
        return None
    at = next((i for i, (a, b) in enumerate(zip(ref_ids, own_ids)) if a != b), min(len(ref_ids), len(own_ids)))
    ref_tokens = list(reference.get("tokens") or []) or [str(i) for i in ref_ids]
    own_tokens = list(path.get("tokens") or []) or [str(i) for i in own_ids]
    return (f"first divergent token {at}: reference {_context(ref_tokens, at)!r} vs path "
            f"{_context(own_tokens, at)!r}")


def diagnosis(row: Mapping, texts: Mapping[tuple, Mapping], turn_metrics: Mapping[tuple, Mapping] | None = None) -> str:
    """A verdict row as a diagnosis: the turn, each reason (metric, value, limit and its source), the worst
    attention layer and head where the run captured attention error, and the first divergent token with both
    texts around it. `texts`: texts.jsonl rows keyed (model, scenario, path, turn); `turn_metrics`: that key ->
    {metric: value} from records.jsonl."""
    key = (row["model"], row["scenario"], row["path"], row["turn"])
    lines = [f"{row['model']}::{row['scenario']}::{row['path']} turn {row['turn']}: {row['verdict'].upper()}"]
    lines += [f"  [{r['severity']}] {r['check']}: {r['message']}" for r in row["reasons"]]
    worst = worst_attention((turn_metrics or {}).get(key) or {})
    if worst:
        lines.append(f"  {worst}")
    divergence = first_divergence(texts.get((*key[:2], REFERENCE, key[3])), texts.get(key))
    if divergence:
        lines.append(f"  {divergence}")
    own = texts.get(key)
    if own is not None and row["verdict"] != "pass":
        reference = texts.get((*key[:2], REFERENCE, key[3])) or {}
        lines.append(f"  reference reply: {reference.get('text', '')[:160]!r}")
        lines.append(f"  path reply:      {own.get('text', '')[:160]!r}")
    return "\n".join(lines)


def worst_attention(metrics: Mapping) -> str | None:
    """Where a turn's attention error sits (harness/analysis/attention_error.py aggregates), or None."""
    layer, head = metrics.get("attn_worst_layer"), metrics.get("attn_worst_head")
    if layer is None:
        return None
    where = f"layer {int(layer)}" + (f", head {int(head)} of layer {int(metrics['attn_worst_head_layer'])}"
                                     if head is not None and metrics.get("attn_worst_head_layer") is not None else "")
    error = metrics.get("attn_out_rel_err_max")
    return f"worst attention error: {where}" + (f" (attn_out_rel_err_max {error:.3g})" if error is not None else "")
