"""Self-consistency of one server: the logprobs it reported while decoding a reply against the logprobs it gives
when the same prompt + reply tokens are sent back as a prompt (prefill), and against a second, identical decode.

A healthy server agrees with itself up to its own numerical noise (a prefill chunk and a decode step sum in a
different order; on an FP8-cache engine a `raw_prefill` chunk attends to raw K/V where decode reads FP8 codes). A
decode-side bug (a decode kernel reading the cache wrong, a scale that never reaches it) makes the two disagree,
with no reference model needed: SGLang's check of a server against itself. Pure functions on top-k dicts
({token id: logprob} per position, as servers list them); the requests are `harness/replay/self_consistency.py`.
The limit below is a verdict input on the "implementation" question (docs/VERDICTS.md, "Self-consistency").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from harness.analysis.metrics import teacher_forced_topk

IMPLEMENTATION = "implementation"  # the verdict question (harness.analysis.verdicts.IMPLEMENTATION)
DECODE_VS_PREFILL = ("selfcons_kl_mean", "selfcons_kl_max", "selfcons_logprob_delta_mean",
                     "selfcons_logprob_delta_max", "selfcons_flips", "selfcons_near_tie_flips", "selfcons_tokens")
REPEAT = ("selfcons_repeat_delta_max", "selfcons_repeat_diverged")
SELF_CONSISTENCY_METRICS = (*DECODE_VS_PREFILL, *REPEAT, "selfcons_history_turns")
GATED = "selfcons_logprob_delta_max"

# Per turn, the largest |decode - prefill| logprob of a decoded token, in nats. Measured with
# `python benchmarks/self_consistency_gap.py --out DIR [--scenarios tests/data/free_text.yaml]` (each path behind
# `harness serve` on loopback, CPU, the bundled gqa canary, `harness run --candidate --self-consistency`, own history):
# healthy max 1.03 (fp8_e4m3:calibrated:raw_prefill on free text, whose prefill chunk attends to raw K/V while decode
# reads FP8; the other healthy paths <= 0.35: fp8_e5m2 0.35, per_head 0.19, kernel=reference 0.24, bf16 0.064; on the
# canary set every healthy path <= 1.6e-5, the model is sure of its tokens there); the planted fault (scales dropped
# in decode, tests/faulty_decode.py) per turn at least 24.1 (canary, 21 turns) and 26.2 (free text, 5 turns).
# fail = 4.9x the healthy max and 4.8x below the fault's smallest turn; warn = 1.9x the healthy max.
SELFCONS_DELTA_WARN = 2.0
SELFCONS_DELTA_FAIL = 5.0


def decode_vs_prefill(decode_top: Sequence[Mapping[int, float]], prefill_top: Sequence[Mapping[int, float]],
                      token_ids: Sequence[int]) -> dict[str, float | None]:
    """Per turn: the decode's logprobs of its own tokens against the prefill replay's of the same tokens.

    selfcons_kl_mean / _max      KL(prefill || decode) per token over the listed top-k (shared tokens plus one
                                 'other' bucket: `metrics.teacher_forced_topk`, a lower bound on the true KL)
    selfcons_logprob_delta_*     |decode logprob - prefill logprob| of the decoded token (both sides list it)
    selfcons_flips               positions where the prefill's argmax is not the decoded token and the prefill
                                 leads its runner-up by more than CONFIDENT_MARGIN (near_tie_flips: the rest)
    """
    if not len(decode_top) == len(prefill_top) == len(token_ids):
        raise ValueError(f"{len(decode_top)} decode rows, {len(prefill_top)} prefill rows and {len(token_ids)} "
                         f"tokens; need one of each per position")
    if not token_ids:
        return dict.fromkeys(DECODE_VS_PREFILL) | {"selfcons_tokens": 0.0}
    compared = teacher_forced_topk([dict(r) for r in prefill_top], [dict(r) for r in decode_top], token_ids)
    deltas = [abs(d[t] - p[t]) for d, p, t in zip(decode_top, prefill_top, token_ids)]
    summary = compared.summary
    return {"selfcons_kl_mean": summary["kl_mean"], "selfcons_kl_max": summary["kl_max"],
            "selfcons_logprob_delta_mean": math.fsum(deltas) / len(deltas),
            "selfcons_logprob_delta_max": max(deltas),
            "selfcons_flips": summary["confident_flips"], "selfcons_near_tie_flips": summary["near_tie_flips"],
            "selfcons_tokens": float(len(token_ids))}


def repeat_decode(first_ids: Sequence[int], first_top: Sequence[Mapping[int, float]],
                  second_ids: Sequence[int], second_top: Sequence[Mapping[int, float]]) -> dict[str, float]:
    """Two identical decode requests (the second a prefix-cache hit on a server that caches prefixes): the largest
    |logprob difference| of any token both list, over the positions where both decoded the same tokens so far,
    and whether the replies' tokens differ at all (1.0) or not (0.0)."""
    worst = 0.0
    for a, b, row_a, row_b in zip(first_ids, second_ids, first_top, second_top):
        shared = row_a.keys() & row_b.keys()
        worst = max([worst, *(abs(row_a[t] - row_b[t]) for t in shared)])
        if a != b:
            break
    return {"selfcons_repeat_delta_max": worst, "selfcons_repeat_diverged": float(list(first_ids) != list(second_ids))}


# ---------------------------------------------------------------- the verdict input


def _reason(metric: str, value, limit, severity: str, message: str) -> dict:
    return {"check": "self-consistency", "metric": metric, "value": value, "limit": limit,
            "source": "default (self-consistency)", "severity": severity, "message": message,
            "question": IMPLEMENTATION}


def _limit_reason(metric: str, value: float, what: str) -> list[dict]:
    severity = "fail" if value > SELFCONS_DELTA_FAIL else "warn" if value > SELFCONS_DELTA_WARN else None
    if severity is None:
        return []
    bound = SELFCONS_DELTA_FAIL if severity == "fail" else SELFCONS_DELTA_WARN
    return [_reason(metric, value, bound, severity,
                    f"{what}: {metric} {value:.4g} nats > {bound:g} ({severity}; a healthy server stays within its "
                    f"own noise, docs/VERDICTS.md 'Self-consistency')")]


def self_consistency_reasons(values: Mapping[str, float | None]) -> list[dict]:
    """The turn's self-consistency reasons: the decode against its prefill replay and against a repeated decode,
    each by the measured limit; a turn where self-consistency was asked for and could not be measured warns."""
    if not any(metric in values for metric in SELF_CONSISTENCY_METRICS):
        return []
    reasons = []
    for metric, what in ((GATED, "the server's decode disagrees with its own prefill of the same tokens"),
                         ("selfcons_repeat_delta_max", "two identical decodes (a prefix-cache hit) disagree")):
        value = values.get(metric)
        if value is not None and math.isfinite(value):
            reasons += _limit_reason(metric, value, what)
        elif value is not None:
            reasons.append(_reason(metric, None, None, "fail", f"{what}: {metric} is {value}"))
    if values.get(GATED) is None:
        reasons.append(_reason(GATED, None, None, "warn", "self-consistency unmeasured on this turn: the server "
                               "could not give it (the reason is in the turn's records and the manifest warnings)"))
    return reasons


def turn_reasons(reasons: list[dict], values: Mapping[str, float | None],
                 reference: Mapping[str, float | None]) -> list[dict]:
    """A turn's verdict reasons with its self-consistency reasons added. In a run with no reference (self-consistency
    only) there is no teacher-forced divergence to miss: its 'unmeasured' warning is dropped (the path verdict's
    `unanswered` names the precision question as not answered), and the turn is judged on what was measured."""
    ours = self_consistency_reasons(values)
    if reference or not any(metric in values for metric in SELF_CONSISTENCY_METRICS):
        return reasons + ours
    return [r for r in reasons if not (r.get("check") == "unmeasured" and r.get("metric") == "kl_max")] + ours
