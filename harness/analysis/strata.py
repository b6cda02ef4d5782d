"""Teacher-forced divergence stratified by position, and a trend test: does a path's KL grow with the reply's length
more than the yardstick's does on the same turns? (issue 40; TensorRT-LLM#16916's accuracy loss grew with the
generation length, 92 -> 74, and a pooled mean over short and long replies hides that.)

**Strata** (per model and path, pooled over every teacher-forced token of its turns): KL mean and flip rate (the
path's argmax is not the reference's: top-1 disagreement) per bucket of
- generation position: the token's index in the reply, buckets `GENERATION_BUCKETS` ([0, 16), [16, 64),
  [64, 256), [256, inf));
- context position: the token's absolute position in the sequence the scorer read, the turn's prompt (system,
  earlier turns, this user message) plus the reply before it, buckets `CONTEXT_BUCKETS` ([0, 256), [256, 1k),
  [1k, 4k), [4k, inf)). The prompt length is the reference's `context_tokens` record (the teacher-forced prompt is
  the reference's history), else the path's own (the same prompt in a reference-history run; runs made before the
  reference recorded it). Tokens of a turn with neither are counted under `unknown`.

**Length trend test.** Unit: a turn (model, scenario, turn) teacher-forced by both the path and the yardstick
along the same reference tokens. Per turn, split the reply's positions into an early and a late half and take
    growth = log(late_path / early_path) - log(late_yardstick / early_yardstick)
with each side's half-mean KL floored at `KL_FLOOR`: how many times more the path's KL grows from the first half
of the reply to the second than the yardstick's does. Content drives KL up and down along a reply (the
reference's entropy changes), and the yardstick sees the same content, so the difference is the path's own
growth. H0: growth is symmetric about 0 over turns; H1: it is positive. Test: one-sided Wilcoxon signed-rank,
exact (every sign assignment, midranks for ties) up to `EXACT_MAX_TURNS` turns, the normal approximation with tie
and continuity corrections above. Why this test:
- the turn is the unit, not the token: one token's cache error stays in the cache for every later position, so
  tokens of a turn are not independent, and a token-level test would give p-values far too small on healthy paths;
- it is paired (the same turns and tokens for path and yardstick) and uses the growths' sizes, not only their
  signs (a sign test needs 7 turns all growing to reach p < 0.01 and ignores by how much);
- it assumes no distribution of the per-turn growth (heavy-tailed: half-means of per-token KL span decades).
Its limit: with n turns the smallest p it can give is 2**-n (`min_p_value`): under 7 usable turns it can never
warn. A turn whose reply is shorter than `MIN_REPLY_TOKENS`, whose halves are not finite (the nonfinite check
judges those), or where the path's KL stays below `KL_FLOOR` in both halves (no loss to grow; a BF16 cache) is left
out. A path warns ("trend", question "acceptable") at p < `TREND_WARN_P`; this test alone never fails a path.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

REFERENCE = "reference"
GENERATION_BUCKETS = (0, 16, 64, 256, math.inf)  # reply token index
CONTEXT_BUCKETS = (0, 256, 1024, 4096, math.inf)  # absolute position: prompt length + reply token index
STRATA_SERIES = ("kl", "flip")  # the series.jsonl rows the strata read
TREND_WARN_P = 0.01
MIN_REPLY_TOKENS = 8  # 4 tokens a half at least
EXACT_MAX_TURNS = 60  # exact null distribution: 60 turns sum doubled ranks up to 3660, a list of that size per turn
# 1e-6 nats: the float32 reference's own KL against the BF16 one measured 6.1e-07 nats (docs/VERDICTS.md); a half
# whose mean KL is below it is the reference's arithmetic noise, not a loss.
KL_FLOOR = 1e-6


# ---------------------------------------------------------------- strata


def bucket_label(edges: Sequence[float], i: int) -> str:
    high = edges[i + 1]
    return f"[{edges[i]:g}, {'inf' if high == math.inf else f'{high:g}'})"


def bucket_of(edges: Sequence[float], position: float) -> int:
    return next(i for i in range(len(edges) - 1) if position < edges[i + 1])


def turn_series(series_rows: Iterable[Mapping]) -> dict[tuple, dict[str, list]]:
    """(model, scenario, path, turn) -> {series name: values} for the `kl` and `flip` rows of series.jsonl, NaN/inf
    restored. A row without model, scenario, path, turn or series is a ValueError naming the field."""
    from harness.records import decode_values

    turns: dict[tuple, dict[str, list]] = {}
    for row in series_rows:
        missing = [f for f in ("model", "scenario", "path", "turn", "series") if row.get(f) is None]
        if missing:
            raise ValueError(f"series.jsonl row without {', '.join(missing)}: {dict(row)!r:.200}")
        if row["series"] in STRATA_SERIES:
            key = (row["model"], row["scenario"], row["path"], int(row["turn"]))
            turns.setdefault(key, {})[row["series"]] = decode_values(dict(row))
    return turns


def context_tokens_index(records: Iterable[Mapping]) -> dict[tuple, dict[str, float]]:
    """records.jsonl rows -> (model, scenario, path, turn) -> {"context_tokens": value}, the index `prompt_length`
    reads (the verdicts pass their own index of every metric)."""
    return {(r["model"], r["scenario"], r["path"], r["turn"]): {"context_tokens": float(r["value"])}
            for r in records if r.get("metric") == "context_tokens" and r.get("value") is not None}


def prompt_length(records: Mapping[tuple, Mapping], key: tuple) -> float | None:
    """The turn's prompt length: the reference's `context_tokens` record, else the path's own (records indexed
    (model, scenario, path, turn) -> {metric: value}, as `verdicts._index` builds them)."""
    model, scenario, _, turn = key
    for path_key in ((model, scenario, REFERENCE, turn), key):
        value = (records.get(path_key) or {}).get("context_tokens")
        if value is not None and math.isfinite(value):
            return float(value)
    return None


def _empty_buckets(edges: Sequence[float]) -> dict[str, list[float]]:
    return {bucket_label(edges, i): [0, 0.0, 0, 0] for i in range(len(edges) - 1)}  # tokens, kl, flipped, flip-known


def _add(bucket: list, kl: float, flip) -> None:
    bucket[0] += 1
    bucket[1] += kl
    if flip is not None and not math.isnan(flip):
        bucket[2] += bool(flip)
        bucket[3] += 1


def _bucket_rows(sums: Mapping[str, list]) -> list[dict]:
    return [{"bucket": label, "tokens": tokens, "kl_mean": kl / tokens if tokens else None,
             "flip_rate": flipped / known if known else None}
            for label, (tokens, kl, flipped, known) in sums.items() if label != "unknown" or tokens]


def position_strata(turns: Mapping[tuple, Mapping[str, list]], records: Mapping[tuple, Mapping]) -> dict[str, list]:
    """One path's tokens pooled over `turns` ({key: {"kl": [...], "flip": [...]}}): {"generation_position": rows,
    "context_position": rows}, each row {bucket, tokens, kl_mean, flip_rate}; NaN KL (not measured) is skipped."""
    generation, context = _empty_buckets(GENERATION_BUCKETS), _empty_buckets(CONTEXT_BUCKETS)
    context["unknown"] = [0, 0.0, 0, 0]
    for key, series in turns.items():
        flips, start = series.get("flip") or [], prompt_length(records, key)
        for i, kl in enumerate(series.get("kl") or []):
            if kl is None or math.isnan(kl):
                continue
            flip = flips[i] if i < len(flips) else None
            _add(generation[bucket_label(GENERATION_BUCKETS, bucket_of(GENERATION_BUCKETS, i))], kl, flip)
            where = "unknown" if start is None else bucket_label(CONTEXT_BUCKETS, bucket_of(CONTEXT_BUCKETS, start + i))
            _add(context[where], kl, flip)
    return {"generation_position": _bucket_rows(generation), "context_position": _bucket_rows(context)}


# ---------------------------------------------------------------- the length trend test


def half_means(kl: Sequence[float | None]) -> tuple[float, float] | None:
    """Mean KL over the reply's first and second half of positions (NaN skipped); None for a reply shorter than
    MIN_REPLY_TOKENS or a half with nothing measured."""
    if len(kl) < MIN_REPLY_TOKENS:
        return None
    middle = len(kl) // 2
    halves = [[v for v in part if v is not None and not math.isnan(v)] for part in (kl[:middle], kl[middle:])]
    if not all(halves):
        return None
    return sum(halves[0]) / len(halves[0]), sum(halves[1]) / len(halves[1])


def turn_growth(path_kl: Sequence, yardstick_kl: Sequence) -> float | None:
    """log(late / early) of the path's half-mean KL minus the yardstick's, each floored at KL_FLOOR, over the
    positions both scored; None where the turn is left out (too short, non-finite, the path below the floor)."""
    length = min(len(path_kl), len(yardstick_kl))
    path, stick = half_means(path_kl[:length]), half_means(yardstick_kl[:length])
    if path is None or stick is None or not all(math.isfinite(v) for v in (*path, *stick)):
        return None
    if max(path) < KL_FLOOR:
        return None
    early, late = (max(v, KL_FLOOR) for v in path)
    stick_early, stick_late = (max(v, KL_FLOOR) for v in stick)
    return math.log(late / early) - math.log(stick_late / stick_early)


def midranks(magnitudes: Sequence[float]) -> list[float]:
    """Ranks 1..n of `magnitudes`, ties sharing their mean rank."""
    order = sorted(range(len(magnitudes)), key=lambda i: magnitudes[i])
    ranks = [0.0] * len(magnitudes)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and magnitudes[order[end + 1]] == magnitudes[order[start]]:
            end += 1
        for i in order[start:end + 1]:
            ranks[i] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def signed_rank_p_greater(differences: Sequence[float]) -> float:
    """One-sided Wilcoxon signed-rank p-value, H1: the differences lean positive. Zeros are dropped (Wilcoxon's
    rule); exact over all 2**n sign assignments up to EXACT_MAX_TURNS, normal approximation above. 1.0 for none."""
    nonzero = [d for d in differences if d != 0]
    if not nonzero:
        return 1.0
    ranks = midranks([abs(d) for d in nonzero])
    doubled = [round(2 * r) for r in ranks]  # midranks are halves: doubled they are integers
    observed = sum(r for r, d in zip(doubled, nonzero) if d > 0)
    if len(nonzero) > EXACT_MAX_TURNS:
        return _signed_rank_normal(ranks, observed / 2)
    counts = [1] + [0] * sum(doubled)  # counts[s]: sign assignments whose positive ranks sum to s (doubled)
    for rank in doubled:
        counts = [c + (counts[s - rank] if s >= rank else 0) for s, c in enumerate(counts)]
    return sum(counts[observed:]) / 2 ** len(nonzero)


def _signed_rank_normal(ranks: Sequence[float], observed: float) -> float:
    mean = sum(ranks) / 2
    sd = math.sqrt(sum(r * r for r in ranks) / 4)  # the variance of sum(r * sign) with ties as they are
    return 0.5 * math.erfc((observed - 0.5 - mean) / sd / math.sqrt(2))


def length_trend(path_turns: Mapping[tuple, Mapping], yardstick_turns: Mapping[tuple, Mapping]) -> dict:
    """The trend test of one path against the yardstick over their common turns (keys (scenario, turn)):
    {test, turns, growing_turns, left_out, median_growth (x-fold, late / early, path over yardstick), p_value,
    min_p_value, warn_below}."""
    growths, left_out = [], 0
    for key, series in sorted(path_turns.items()):
        stick = yardstick_turns.get(key)
        growth = turn_growth(series.get("kl") or [], stick.get("kl") or []) if stick else None
        if growth is None:
            left_out += 1
        else:
            growths.append(growth)
    ordered = sorted(growths)
    median = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2 if ordered else None
    return {"test": "one-sided Wilcoxon signed-rank over turns of log(late/early KL), path minus yardstick",
            "turns": len(growths), "growing_turns": sum(g > 0 for g in growths), "left_out": left_out,
            "median_growth": math.exp(median) if median is not None else None,
            "p_value": signed_rank_p_greater(growths), "min_p_value": 2.0 ** -sum(g != 0 for g in growths),
            "warn_below": TREND_WARN_P}


# ---------------------------------------------------------------- per path, for the verdicts


def path_strata(series_rows: Iterable[Mapping], records: Mapping[tuple, Mapping], yardstick: str | None) -> dict:
    """(model, path) -> {"strata": position_strata, "length_trend": length_trend or {p_value: None, why}} for every
    candidate path with series rows; `records` indexed (model, scenario, path, turn) -> {metric: value}."""
    by_path: dict[tuple, dict[tuple, dict]] = {}
    for (model, scenario, path, turn), series in turn_series(series_rows).items():
        if path != REFERENCE:
            by_path.setdefault((model, path), {})[(scenario, turn)] = series
    out = {}
    for (model, path), turns in by_path.items():
        keyed = {(model, scenario, path, turn): series for (scenario, turn), series in turns.items()}
        stick = by_path.get((model, yardstick)) if yardstick else None
        if stick is None or path == yardstick:
            why = "the yardstick itself" if path == yardstick else f"no yardstick path {yardstick} in this run"
            trend = {"p_value": None, "why": why}
        else:
            trend = length_trend(turns, stick)
        out[(model, path)] = {"strata": position_strata(keyed, records), "length_trend": trend}
    return out


def length_trend_reasons(numbers: Mapping, yardstick: str) -> list[dict]:
    """A warn reason (check "trend", question "acceptable") when the path's length trend test rejects at
    p < TREND_WARN_P; the same keys as every verdict reason."""
    trend = numbers.get("length_trend") or {}
    p = trend.get("p_value")
    if p is None or p >= TREND_WARN_P:
        return []
    message = (f"KL grows with reply position more than the yardstick {yardstick}'s: late-half / early-half KL "
               f"{trend['median_growth']:.3g}x the yardstick's growth (median over {trend['turns']} turns, "
               f"{trend['growing_turns']} growing); one-sided Wilcoxon signed-rank p = {p:.2g} < {TREND_WARN_P:g}")
    return [{"check": "trend", "metric": "length_trend_p", "value": p, "limit": TREND_WARN_P, "source": "default",
             "severity": "warn", "message": message, "question": "acceptable"}]
