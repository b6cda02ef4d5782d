"""Token-level divergence metrics: plain functions on token ids and log-probabilities."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

SUMMARY_KEYS = ("kl_mean", "kl_max", "top1_agree", "ref_logprob_delta_mean", "ref_logprob_delta_min",
                "ref_rank_mean", "ref_rank_max",
                # robust divergence statistics (docs/VERDICTS.md): percentiles of the per-token KL, the max's
                # place and what the reference was doing there, flips split by the reference's confidence
                "kl_p99", "kl_p999", "kl_max_pos", "kl_max_ref_entropy", "kl_max_ref_margin",
                "confident_flips", "near_tie_flips", "first_flip_topk_ok")
SERIES_KEYS = ("kl", "top1_agree", "ref_logprob_delta", "ref_rank", "ref_entropy", "ref_margin", "flip")
# A flip (the path's argmax is not the reference's) is confident where the reference's top-1 log-prob leads its
# top-2 by more than this many nats (top-1 at least e = 2.7x as likely as the runner-up): a path that changes
# such a token changed the decision, not a coin toss. Below it the flip is a near-tie.
CONFIDENT_MARGIN = 1.0
# vLLM's check_logprobs_close: at the first position where two outputs differ, each side's token must be in the
# other side's top-k logprobs; vLLM's tests ask for k = 5 (NUM_LOG_PROBS in tests/models).
VLLM_TOPK = 5
# Value each metric takes when the path is identical to the reference; the noise floor is the
# largest distance from it. Prefix rules cover kl_*, ref_logprob_delta_* and ref_rank_*.
IDENTICAL_RUN_VALUES = {"exact_match": 1.0, "top1_agree": 1.0, "common_prefix_frac": 1.0,
                        "token_edit_distance": 0.0, "confident_flips": 0.0, "near_tie_flips": 0.0}
IDENTICAL_ZERO_PREFIXES = ("kl_", "ref_logprob_delta_", "ref_rank_")
# Where kl_max sits and what the reference does there: descriptions of the reference, not distances from it.
NOT_DISTANCES = ("kl_max_pos", "kl_max_ref_entropy", "kl_max_ref_margin")
# Leftover probability within this of 0 is rounding in the listed logprobs, not mass. Servers compute
# logprobs as log_softmax in float32: each listed value is off by up to ~|logit| float32 ulps, so the
# listed mass is off by up to ~64 * 2**-24 for logits up to 64 in magnitude. Measured on real vLLM 0.32
# replies (float32 and bf16 servers, the 12 canary scenarios, 12,492 prompt_logprobs rows): listed mass
# exceeds 1 by up to 1.4e-7 (4,504 rows), and 1,973 rows leave between 1e-9 and this tolerance unlisted;
# with the former 1e-9, 6 of 12 candidate units got an infinite KL. 2**-18 = 3.8e-6 is 28x the largest excess.
TOPK_MASS_TOL = 2.0 ** -18


# ---------------------------------------------------------------- free-running


def free_running(reference: Sequence[int], candidate: Sequence[int]) -> dict[str, float | None]:
    """Compare the path's own greedy reply with the reference reply, token by token.

    first_divergent_token: first index i with reference[i] != candidate[i]; when one is a strict
        prefix of the other, the shorter length; None when the two are identical.
    exact_match: 1.0 when identical, else 0.0.
    common_prefix_frac: common prefix length / len(reference); 1.0 when both are empty, 0.0 when
        only the reference is.
    token_edit_distance: Levenshtein distance over token ids (see `token_edit_distance`).
    """
    reference, candidate = [int(t) for t in reference], [int(t) for t in candidate]
    prefix = _common_prefix_len(reference, candidate)
    identical = prefix == len(reference) == len(candidate)
    return {
        "first_divergent_token": None if identical else prefix,
        "exact_match": float(identical),
        "common_prefix_frac": prefix / len(reference) if reference else float(identical),
        "token_edit_distance": float(token_edit_distance(reference, candidate)),
    }


def token_edit_distance(a: Sequence[int], b: Sequence[int]) -> int:
    """Levenshtein distance: fewest single-token insertions, deletions and substitutions turning a into b.

    D[i][j] = min(D[i-1][j] + 1, D[i][j-1] + 1, D[i-1][j-1] + [a[i-1] != b[j-1]]), kept in two rows.
    The shared prefix and suffix are stripped first (they never change the distance), so nearly
    identical replies cost O(n); the worst case is O(n * m) time, O(min(n, m)) memory.
    """
    a, b = [int(t) for t in a], [int(t) for t in b]
    start = _common_prefix_len(a, b)
    a, b = a[start:], b[start:]
    while a and b and a[-1] == b[-1]:
        a.pop()
        b.pop()
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


# ---------------------------------------------------------------- teacher-forced


@dataclass(frozen=True, slots=True)
class TeacherForced:
    """Teacher-forced comparison of one turn: `summary` (SUMMARY_KEYS; None when the turn has no
    tokens) and per-position `series` (SERIES_KEYS; the top-k variant leaves None in
    ref_logprob_delta where the reference token is not in the path's top-k)."""

    summary: dict[str, float | None]
    series: dict[str, list[float | None]]


def teacher_forced(reference_logprobs: torch.Tensor, path_logprobs: torch.Tensor,
                   reference_tokens: Sequence[int]) -> TeacherForced:
    """Score the path's next-token distributions along the reference continuation.

    Inputs are [T, V] logits or logprobs in any float dtype; both are put through log_softmax in
    float64 here, so lr = log p_ref and lp = log p_path. With t the reference token at a position:
        kl                = sum_v p_ref[v] * (lr[v] - lp[v])   (KL(ref || path), nats; terms with
                            p_ref = 0 are 0; rounding below 0 clamped to 0; identical inputs give 0.0)
        top1_agree        = [argmax lp == t]   (ties go to the lowest id, as torch.argmax)
        ref_logprob_delta = lp[t] - lr[t]
        ref_rank          = #{v : lp[v] > lp[t]}   (strictly greater: ties do not push t down)
        ref_entropy       = -sum_v p_ref[v] * lr[v]   (nats)
        ref_margin        = lr[top-1] - lr[top-2]   (how sure the reference is, nats)
        flip              = [argmax lp != argmax lr]
    Summary (`_summarise`): means / extremes of these, kl_p99 / kl_p999 (linear-interpolated percentiles of
    kl), kl_max_pos (first position of the max) with ref_entropy and ref_margin there, confident_flips /
    near_tie_flips (flips where ref_margin > / <= CONFIDENT_MARGIN, counts), and first_flip_topk_ok: vLLM's
    check_logprobs_close at the first flip (1.0 when the reference's argmax is in the path's top VLLM_TOPK and
    the path's argmax in the reference's; 0.0 when not; None when nothing flipped).
    A position whose path logits hold NaN or +inf (or are all -inf) is total disagreement: kl = +inf,
    top1_agree = 0, ref_logprob_delta = -inf, ref_rank = V - 1; kl_mean then reads +inf too.
    -inf logits are masked tokens, not errors. A non-finite reference row raises ValueError.
    """
    tokens = _check_teacher_forced_inputs(reference_logprobs, path_logprobs, reference_tokens)
    if not tokens:
        return _empty_teacher_forced()
    ref = torch.log_softmax(reference_logprobs.to(torch.float64), dim=-1)  # [T, V]
    path = torch.log_softmax(path_logprobs.to(torch.float64), dim=-1)  # [T, V]
    _check_reference_finite(ref)
    broken = path.isnan().any(dim=-1)  # [T]; NaN, +inf and all -inf logits all come out as NaN
    p_ref = ref.exp()
    kl = torch.where(p_ref > 0, p_ref * (ref - path), 0.0).sum(dim=-1).clamp_min(0.0)
    idx = torch.tensor(tokens, device=path.device).unsqueeze(1)  # [T, 1]
    path_tok = path.gather(1, idx)  # [T, 1]
    delta = path_tok.squeeze(1) - ref.gather(1, idx).squeeze(1)
    rank = (path > path_tok).sum(dim=-1).to(torch.float64)
    top1 = (path.argmax(dim=-1) == idx.squeeze(1)).to(torch.float64)
    kl, top1 = kl.masked_fill(broken, math.inf), top1.masked_fill(broken, 0.0)
    delta, rank = delta.masked_fill(broken, -math.inf), rank.masked_fill(broken, path.shape[1] - 1)
    entropy = torch.where(p_ref > 0, -p_ref * ref, 0.0).sum(dim=-1)
    top2 = ref.topk(min(2, ref.shape[1]), dim=-1).values  # [T, 2]
    margin = top2[:, 0] - top2[:, -1] if top2.shape[1] == 2 else torch.full_like(entropy, math.inf)
    ref_top, path_top = ref.argmax(dim=-1), path.argmax(dim=-1)
    flip = ((ref_top != path_top) | broken).to(torch.float64)
    series = {"kl": kl.tolist(), "top1_agree": top1.tolist(), "ref_logprob_delta": delta.tolist(),
              "ref_rank": rank.tolist(), "ref_entropy": entropy.tolist(), "ref_margin": margin.tolist(),
              "flip": flip.tolist()}
    summary = _summarise(**series) | {"first_flip_topk_ok": _first_flip_topk_ok(ref, path, ref_top, path_top, flip)}
    return TeacherForced(summary=summary, series=series)


def _first_flip_topk_ok(ref: torch.Tensor, path: torch.Tensor, ref_top: torch.Tensor, path_top: torch.Tensor,
                        flip: torch.Tensor) -> float | None:
    """vLLM's check_logprobs_close at the first flip: each side's argmax inside the other's top VLLM_TOPK."""
    flipped = flip.nonzero().flatten()
    if not len(flipped):
        return None
    at = int(flipped[0])
    if path[at].isnan().any():
        return 0.0
    ref_in_path = int((path[at] > path[at, ref_top[at]]).sum()) < VLLM_TOPK
    path_in_ref = int((ref[at] > ref[at, path_top[at]]).sum()) < VLLM_TOPK
    return float(ref_in_path and path_in_ref)


def _check_teacher_forced_inputs(reference_logprobs: torch.Tensor, path_logprobs: torch.Tensor,
                                 reference_tokens: Sequence[int]) -> list[int]:
    for name, x in (("reference_logprobs", reference_logprobs), ("path_logprobs", path_logprobs)):
        if not isinstance(x, torch.Tensor) or x.ndim != 2 or not x.is_floating_point():
            got = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a float tensor of shape [T, V], got {got}")
    if path_logprobs.shape != reference_logprobs.shape:
        raise ValueError(f"path_logprobs shape {tuple(path_logprobs.shape)} != reference_logprobs "
                         f"shape {tuple(reference_logprobs.shape)}")
    num_positions, vocab = reference_logprobs.shape
    tokens = [int(t) for t in reference_tokens]
    if len(tokens) != num_positions:
        raise ValueError(f"{len(tokens)} reference_tokens for {num_positions} logprob rows; need one per row")
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"reference_tokens[{bad}] = {tokens[bad]} is outside the vocabulary [0, {vocab})")
    return tokens


def _check_reference_finite(ref: torch.Tensor) -> None:
    bad_rows = ref.isnan().any(dim=-1).nonzero().flatten().tolist()
    if bad_rows:
        raise ValueError(f"reference logprobs hold NaN/+inf (or an all -inf row) at positions "
                         f"{bad_rows[:10]}; the reference itself is broken, nothing can be measured")


def _empty_teacher_forced() -> TeacherForced:
    return TeacherForced(summary=dict.fromkeys(SUMMARY_KEYS), series={k: [] for k in SERIES_KEYS})


def _summarise(kl: list[float], top1_agree: list[float], ref_logprob_delta: list[float],
               ref_rank: list[float], ref_entropy: list[float], ref_margin: list[float],
               flip: list[float]) -> dict[str, float | None]:
    if not kl:
        return dict.fromkeys(SUMMARY_KEYS)
    at = kl.index(max(kl))
    confident = sum(1 for f, m in zip(flip, ref_margin) if f and m > CONFIDENT_MARGIN)
    return {
        "kl_mean": _mean(kl), "kl_max": max(kl),
        "top1_agree": _mean(top1_agree),
        "ref_logprob_delta_mean": _mean(ref_logprob_delta), "ref_logprob_delta_min": min(ref_logprob_delta),
        "ref_rank_mean": _mean(ref_rank), "ref_rank_max": max(ref_rank),
        "kl_p99": percentile(kl, 99.0), "kl_p999": percentile(kl, 99.9),
        "kl_max_pos": float(at), "kl_max_ref_entropy": ref_entropy[at], "kl_max_ref_margin": ref_margin[at],
        "confident_flips": float(confident), "near_tie_flips": float(sum(1 for f in flip if f) - confident),
        "first_flip_topk_ok": None,
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`, linearly interpolated between order statistics (numpy's default
    'linear' method): rank (n - 1) * q / 100. +inf entries sort last; NaN is refused. Empty input is an error."""
    ordered = sorted(float(v) for v in values)
    if not ordered:
        raise ValueError("percentile of no values")
    if any(math.isnan(v) for v in ordered):
        raise ValueError("percentile: NaN among the values")
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    if ordered[high] == math.inf:
        return math.inf if rank > low or ordered[low] == math.inf else ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


# ---------------------------------------------------------------- teacher-forced, top-k only


def teacher_forced_topk(reference_top: list[dict[int, float]], path_top: list[dict[int, float]],
                        reference_tokens: Sequence[int]) -> TeacherForced:
    """`teacher_forced` for endpoints that return only the top-k logprobs per position ({token: logprob}).

    Each reference dict must hold its own reference token; an empty dict is refused. With t the
    reference token, lr/lp the listed reference/path logprobs:
        top1_agree        = [t is the path's highest listed token]   (ties go to the lowest id)
        ref_logprob_delta = lp[t] - lr[t] when t is in the path's top-k; else None in the series.
            A missing t lies below the smallest listed path logprob, so the summary uses
            min(lp) - lr[t] there: ref_logprob_delta_mean/min are upper bounds (optimistic).
        ref_rank          = #{listed v : lp[v] > lp[t]}; k (every listed token) when t is missing,
            which is a lower bound on the true rank.
        kl                = sum over buckets b of P(b) * (log P(b) - log Q(b)), an approximate KL and a
            lower bound on the true KL(ref || path). Buckets: each token listed in both top-k lists,
            plus one 'other' bucket holding the rest of the mass, 1 - sum of the listed probabilities
            (tokens listed on one side only go there too: their probability on the other side is
            unknown). Merging outcomes never raises KL (log-sum inequality), hence the bound.
            Leftover mass within TOPK_MASS_TOL of 0 counts as 0 (logprob rounding). When the reference
            has leftover mass and the path lists none, the path's true leftover lies in [0, TOPK_MASS_TOL]
            (it cannot be told from rounding), so TOPK_MASS_TOL is used: the largest value, keeping the
            bound. A listed token with logprob -inf on the path side gives +inf, and so does NaN.
    """
    tokens = [int(t) for t in reference_tokens]
    if not len(reference_top) == len(path_top) == len(tokens):
        raise ValueError(f"{len(reference_top)} reference_top, {len(path_top)} path_top and {len(tokens)} "
                         f"reference_tokens; need one of each per position")
    if not tokens:
        return _empty_teacher_forced()
    rows = [_topk_position(i, ref, path, t) for i, (ref, path, t) in enumerate(zip(reference_top, path_top, tokens))]
    kl, top1, delta, delta_bound, rank, entropy, margin, flip = (list(column) for column in zip(*rows))
    series = {"kl": kl, "top1_agree": top1, "ref_logprob_delta": delta, "ref_rank": rank, "ref_entropy": entropy,
              "ref_margin": margin, "flip": flip}
    summary = _summarise(kl, top1, delta_bound, rank, entropy, margin, flip)
    first = next((i for i, f in enumerate(flip) if f), None)
    if first is not None:
        summary["first_flip_topk_ok"] = _topk_flip_ok(reference_top[first], path_top[first])
    return TeacherForced(summary=summary, series=series)


def _listed_top(top: dict[int, float]) -> int:
    return max(top, key=lambda v: (top[v], -v))


def _topk_flip_ok(ref: dict[int, float], path: dict[int, float]) -> float:
    """check_logprobs_close on listed top-k: each side's argmax listed, within the first VLLM_TOPK, by the other."""
    if any(math.isnan(lp) for lp in path.values()):
        return 0.0
    ref_top, path_top = _listed_top(ref), _listed_top(path)
    ok = all(token in other and sum(lp > other[token] for lp in other.values()) < VLLM_TOPK
             for token, other in ((ref_top, path), (path_top, ref)))
    return float(ok)


def _topk_position(i: int, ref: dict[int, float], path: dict[int, float], token: int) -> tuple:
    """(kl, top1_agree, ref_logprob_delta or None, delta or its upper bound, ref_rank, ref_entropy, ref_margin,
    flip) at position i. Entropy counts the unlisted mass as one outcome (a lower bound on the true entropy);
    the margin is exact when the reference lists two tokens or more (else +inf)."""
    if not ref or not path:
        raise ValueError(f"position {i}: empty top-k ({len(ref)} reference, {len(path)} path entries)")
    if token not in ref:
        raise ValueError(f"position {i}: reference token {token} missing from the reference top-k {sorted(ref)}")
    path_top1 = _listed_top(path)
    in_path = token in path
    path_lp = path[token] if in_path else min(path.values())
    rank = sum(lp > path_lp for lp in path.values()) if in_path else len(path)
    delta = path_lp - ref[token]
    probs = [math.exp(lp) for lp in ref.values()]
    entropy = -sum(p * math.log(p) for p in [*probs, _leftover_mass(probs)] if p > 0)
    ordered = sorted(ref.values(), reverse=True)
    margin = ordered[0] - ordered[1] if len(ordered) > 1 else math.inf
    broken = any(math.isnan(lp) for lp in path.values())
    flip = float(broken or path_top1 != _listed_top(ref))
    return (_topk_kl(ref, path), float(path_top1 == token), delta if in_path else None, delta, float(rank),
            max(0.0, entropy), margin, flip)


def _topk_kl(ref: dict[int, float], path: dict[int, float]) -> float:
    if any(math.isnan(lp) for lp in path.values()):
        return math.inf
    shared = sorted(ref.keys() & path.keys())
    p = [math.exp(ref[v]) for v in shared]
    q = [math.exp(path[v]) for v in shared]
    p.append(_leftover_mass(p))
    q.append(_leftover_mass(q) or TOPK_MASS_TOL)  # hidden by rounding at most: see teacher_forced_topk
    return max(0.0, sum(_kl_term(pb, qb) for pb, qb in zip(p, q)))


def _leftover_mass(probs: list[float]) -> float:
    rest = 1.0 - math.fsum(probs)
    return rest if rest > TOPK_MASS_TOL else 0.0


def _kl_term(p: float, q: float) -> float:
    if p == 0.0:
        return 0.0
    return math.inf if q == 0.0 else p * (math.log(p) - math.log(q))


# ---------------------------------------------------------------- noise floor


def noise_floor(records: Iterable[Mapping[str, object]]) -> dict[str, float]:
    """Largest deviation from the identical-run value, per metric, over records of a path that should
    match the reference (e.g. bf16 against itself, or two reference runs).

    records: tidy rows with at least `metric` and `value` (e.g. DataFrame.to_dict("records")).
    deviation = |value - identical value|: |value| for kl_*, ref_logprob_delta_*, ref_rank_* and
    token_edit_distance; 1 - value for exact_match, top1_agree and common_prefix_frac.
    Metrics with no identical-run value (first_divergent_token, task checks) and missing values
    (None or NaN, pandas' missing marker) are skipped; metrics never seen are absent.

    top1_agree and ref_rank_* are left out: they compare the reference's greedy tokens with the argmax
    of its own teacher-forced scoring, which differs at near-ties even for an identical path (decoding
    one token at a time and scoring a whole chunk round bf16 matmuls differently), so they measure the
    reference's self-consistency, not the path against the reference.
    """
    floor: dict[str, float] = {}
    for row in records:
        metric, value = str(row["metric"]), row["value"]
        if metric == "top1_agree" or metric.startswith("ref_rank_"):
            continue
        ideal = _identical_run_value(metric)
        if ideal is None or value is None or math.isnan(float(value)):
            continue
        floor[metric] = max(floor.get(metric, 0.0), abs(float(value) - ideal))
    return floor


def _identical_run_value(metric: str) -> float | None:
    if metric in NOT_DISTANCES:
        return None
    if metric in IDENTICAL_RUN_VALUES:
        return IDENTICAL_RUN_VALUES[metric]
    return 0.0 if metric.startswith(IDENTICAL_ZERO_PREFIXES) else None


# ---------------------------------------------------------------- stratified divergence

# Reference-entropy bins (nats): where the reference is sure, unsure, or spread over many tokens. A path whose
# KL grows where the reference is sure changes decisions; KL where it is spread is mostly reshuffled tail mass.
ENTROPY_BINS = (0.0, 0.5, 2.0, math.inf)
# Context-position bins (tokens of prompt + reply before the position): FP8 cache error grows with the cache.
POSITION_BINS = (0, 256, 1024, 4096, math.inf)


def _bin_label(edges: Sequence[float], i: int) -> str:
    high = edges[i + 1]
    return f"[{edges[i]:g}, {'inf' if high == math.inf else f'{high:g}'})"


def _bin_of(edges: Sequence[float], value: float) -> int:
    return next(i for i in range(len(edges) - 1) if value < edges[i + 1])


def stratified_divergence(series_rows: Iterable[Mapping], context_tokens: Mapping[tuple, float]) -> list[dict]:
    """Teacher-forced KL and flips per (model, path) and bin, by the reference's entropy at the position and by
    the position in the context. `series_rows`: series.jsonl rows (`kl`, `ref_entropy`, `flip`, values decoded
    here); `context_tokens`: (model, scenario, path, turn) -> the turn's prompt length. Turns stored before the
    scorer recorded entropies are counted in the position bins only. Rows: {model, path, by, bin, tokens,
    kl_mean, flips}."""
    from harness.records import decode_values

    turns: dict[tuple, dict[str, list]] = {}
    for row in series_rows:
        key = (row["model"], row["scenario"], row["path"], row["turn"])
        turns.setdefault(key, {})[row["series"]] = decode_values(dict(row))
    sums: dict[tuple, list[float]] = {}
    for key, series in turns.items():
        kl, entropy, flip = series.get("kl") or [], series.get("ref_entropy"), series.get("flip")
        start = context_tokens.get(key, 0.0) or 0.0
        for i, value in enumerate(kl):
            if value is None or math.isnan(value):
                continue
            flipped = float(bool(flip[i])) if flip and i < len(flip) and flip[i] is not None else 0.0
            where = [("context position", _bin_label(POSITION_BINS, _bin_of(POSITION_BINS, start + i)))]
            if entropy and i < len(entropy) and entropy[i] is not None:
                where.append(("reference entropy", _bin_label(ENTROPY_BINS, _bin_of(ENTROPY_BINS, entropy[i]))))
            for by, label in where:
                entry = sums.setdefault((key[0], key[2], by, label), [0.0, 0.0, 0.0])
                entry[0] += 1
                entry[1] += value
                entry[2] += flipped
    return [{"model": model, "path": path, "by": by, "bin": label, "tokens": int(n), "kl_mean": total / n,
             "flips": int(flips)} for (model, path, by, label), (n, total, flips) in sorted(sums.items())]
