"""Divergence by reply and context position, and the length trend test (harness/analysis/strata.py): bucket sums on a
hand-made series, the signed-rank p-value against brute force, a planted loss that grows with length seen and
flat noise left alone, the per-path verdict rows carrying both (the report's figure: tests/test_report.py)."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest

from harness.analysis.strata import (
    EXACT_MAX_TURNS,
    KL_FLOOR,
    TREND_WARN_P,
    length_trend,
    path_strata,
    position_strata,
    signed_rank_p_greater,
    turn_growth,
)
from harness.analysis.verdicts import DEFAULT_YARDSTICK, compute_path_verdicts

RUNS = Path(__file__).resolve().parent / "data" / "runs"
YARD = DEFAULT_YARDSTICK
PATH = "fp8_e4m3"


def series_row(path: str, turn: int, name: str, values: list, scenario: str = "s1", model: str = "m") -> dict:
    return {"model": model, "scenario": scenario, "path": path, "turn": turn, "series": name, "values": values}


def record(path: str, turn: int, metric: str, value, scenario: str = "s1", model: str = "m") -> dict:
    return {"model": model, "scenario": scenario, "path": path, "turn": turn, "metric": metric, "value": value}


def buckets(rows: list[dict]) -> dict[str, tuple]:
    return {r["bucket"]: (r["tokens"], r["kl_mean"], r["flip_rate"]) for r in rows}


# ---------------------------------------------------------------- buckets


def test_buckets_split_a_hand_made_reply_by_reply_index_and_by_absolute_position():
    kl = [0.001] * 16 + [0.01, 0.01, 0.01, math.nan]  # 20 positions, the last not measured
    flip = [0.0] * 15 + [1.0] + [1.0, 0.0, 0.0, 0.0]
    turns = {("m", "s1", PATH, 0): {"kl": kl, "flip": flip}}
    records = {("m", "s1", "reference", 0): {"context_tokens": 250.0},  # the teacher-forced prompt: the reference's
               ("m", "s1", PATH, 0): {"context_tokens": 999.0}}
    strata = position_strata(turns, records)
    generation = buckets(strata["generation_position"])
    assert generation["[0, 16)"] == (16, pytest.approx(0.001), pytest.approx(1 / 16))
    assert generation["[16, 64)"] == (3, pytest.approx(0.01), pytest.approx(1 / 3))  # the NaN is not a token
    assert generation["[64, 256)"] == (0, None, None) and generation["[256, inf)"] == (0, None, None)
    context = buckets(strata["context_position"])  # positions 250..268: 6 below 256, 13 from 256 on
    assert context["[0, 256)"] == (6, pytest.approx(0.001), pytest.approx(0.0))
    assert context["[256, 1024)"] == (13, pytest.approx((10 * 0.001 + 3 * 0.01) / 13), pytest.approx(2 / 13))
    assert "unknown" not in context


def test_without_the_references_prompt_length_the_paths_own_is_used_and_without_either_tokens_are_unknown():
    turns = {("m", "s1", PATH, 0): {"kl": [0.5] * 4}, ("m", "s1", PATH, 1): {"kl": [0.25] * 2}}
    strata = position_strata(turns, {("m", "s1", PATH, 0): {"context_tokens": 4094.0}})
    context = buckets(strata["context_position"])
    assert context["[1024, 4096)"][0] == 2 and context["[4096, inf)"][0] == 2
    assert context["unknown"] == (2, pytest.approx(0.25), None)  # no flip series (runs before it): no rate


# ---------------------------------------------------------------- the signed-rank test


def brute_force_p(differences: list[float]) -> float:
    from harness.analysis.strata import midranks

    nonzero = [d for d in differences if d != 0]
    ranks = midranks([abs(d) for d in nonzero])
    observed = sum(r for r, d in zip(ranks, nonzero) if d > 0)
    sums = [sum(r for r, s in zip(ranks, signs) if s) for signs in itertools.product((0, 1), repeat=len(nonzero))]
    return sum(s >= observed - 1e-9 for s in sums) / len(sums)


@pytest.mark.parametrize("differences", [
    [1.0, 2.0, 3.0, 4.0, 5.0],  # all positive: 2**-5
    [-1.0, 2.0, -3.0, 4.0, 5.0, 0.0],  # a zero is dropped
    [1.0, 1.0, -1.0, 2.0, 2.0, -3.0, 0.5],  # ties share midranks
    [0.3, -0.1, 0.7, 0.2, -0.9, 1.1, 0.4, 0.6, -0.05, 0.8, 0.15],  # awkward n = 11
])
def test_the_exact_signed_rank_p_value_matches_every_sign_assignment(differences):
    assert signed_rank_p_greater(differences) == pytest.approx(brute_force_p(differences))


def test_the_normal_approximation_takes_over_close_to_the_exact_tail():
    rng = random.Random(3)
    differences = [rng.gauss(0.3, 1.0) for _ in range(EXACT_MAX_TURNS)]
    exact = signed_rank_p_greater(differences)
    approximate = signed_rank_p_greater(differences + [0.0])  # same data; the zero is dropped, so still exact
    assert approximate == exact
    longer = differences + [rng.gauss(0.3, 1.0)]  # 61 turns: the normal approximation
    assert 0 < signed_rank_p_greater(longer) < 1
    assert abs(signed_rank_p_greater(longer) - exact) < 0.05
    assert signed_rank_p_greater([]) == 1.0


# ---------------------------------------------------------------- the length trend


def noisy(rng: random.Random, scale: float, length: int, growth: float = 1.0) -> list[float]:
    """Per-token KL: log-normal noise around `scale`, multiplied from 1 up to `growth` over the reply."""
    return [scale * rng.lognormvariate(0, 1.5) * growth ** (i / (length - 1)) for i in range(length)]


def trend_turns(seed: int, growth: float, turns: int = 12, yard_growth: float = 1.0) -> tuple[dict, dict]:
    rng = random.Random(seed)
    path, stick = {}, {}
    for turn in range(turns):
        length = rng.randint(24, 96)  # replies of different lengths, as real turns have
        stick[("s1", turn)] = {"kl": noisy(rng, 3e-3, length, yard_growth)}
        path[("s1", turn)] = {"kl": noisy(rng, 3e-3, length, growth * yard_growth)}
    return path, stick


@pytest.mark.parametrize("seed", range(5))
def test_a_planted_loss_growing_tenfold_over_the_reply_is_seen(seed):
    path, stick = trend_turns(seed, growth=10.0)
    trend = length_trend(path, stick)
    assert trend["p_value"] < TREND_WARN_P, trend
    assert trend["median_growth"] > 3 and trend["turns"] == 12


def test_flat_noise_warns_no_more_often_than_the_level_says():
    """Healthy-like: path and yardstick are independent noise of one size, flat over the reply. Over 200 seeded
    runs the exact test may reject at p < 0.01 about twice by chance; allow up to 6 (P(more) < 0.5%)."""
    rejected = sum(length_trend(*trend_turns(seed, growth=1.0))["p_value"] < TREND_WARN_P for seed in range(200))
    assert rejected <= 6


def test_growth_the_yardstick_shares_is_not_held_against_the_path():
    path, stick = trend_turns(7, growth=1.0, yard_growth=10.0)  # both grow 10x: content, not the path
    assert length_trend(path, stick)["p_value"] > TREND_WARN_P


def test_with_five_turns_the_test_cannot_warn_and_says_so():
    path, stick = trend_turns(1, growth=10.0, turns=5)
    trend = length_trend(path, stick)
    assert trend["min_p_value"] == 2 ** -5 and trend["p_value"] >= trend["min_p_value"] > TREND_WARN_P


def test_a_path_that_never_diverges_and_short_replies_are_left_out():
    flat = [1e-3] * 20
    assert turn_growth([0.0] * 20, [1e-2] * 10 + [1e-4] * 10) is None  # a BF16 cache: no loss to grow
    assert turn_growth([KL_FLOOR / 10] * 20, flat) is None
    assert turn_growth([1e-3] * 7, [1e-3] * 7) is None  # too short to halve
    assert turn_growth([1e-3] * 10 + [1e-2] * 10, flat) == pytest.approx(math.log(10))
    assert turn_growth([1e-3] * 10 + [math.inf] * 10, flat) is None  # the nonfinite check judges it


# ---------------------------------------------------------------- per-path verdicts


def planted_run(growth: float, turns: int = 12) -> tuple[list[dict], list[dict]]:
    path_turns, stick_turns = trend_turns(11, growth=growth, turns=turns)
    records, series = [], []
    for (scenario, turn), found in path_turns.items():
        stick = stick_turns[(scenario, turn)]["kl"]
        for name, kl in ((PATH, found["kl"]), (YARD, stick)):
            records.append(record(name, turn, "kl_mean", sum(kl) / len(kl)))
            series += [series_row(name, turn, "kl", kl), series_row(name, turn, "flip", [0.0] * len(kl))]
        records += [record("reference", turn, "reply_tokens", len(stick)),
                    record("reference", turn, "context_tokens", 40 + 100 * turn)]
    return records, series


def path_row(rows: list[dict], path: str = PATH) -> dict:
    return next(r for r in rows if r["path"] == path)


def test_path_verdicts_carry_the_strata_and_warn_on_a_growing_loss_without_failing():
    records, series = planted_run(growth=10.0)
    row = path_row(compute_path_verdicts(records, kl_series=series))
    strata = row["numbers"]["strata"]
    assert sum(b["tokens"] for b in strata["generation_position"]) == sum(len(s["values"]) for s in series
                                                                           if s["path"] == PATH and s["series"] == "kl")
    assert {b["bucket"] for b in strata["context_position"]} >= {"[0, 256)", "[256, 1024)", "[1024, 4096)"}
    assert row["numbers"]["length_trend"]["p_value"] < TREND_WARN_P
    trend = [r for r in row["reasons"] if r["check"] == "trend"]
    assert len(trend) == 1 and trend[0]["severity"] == "warn" and trend[0]["question"] == "acceptable"
    assert "Wilcoxon" in trend[0]["message"] and row["verdict"] == "warn"
    stick = path_row(compute_path_verdicts(records, kl_series=series), YARD)
    assert stick["numbers"]["length_trend"] == {"p_value": None, "why": "the yardstick itself"}


def test_a_flat_path_gets_the_numbers_and_no_trend_reason():
    records, series = planted_run(growth=1.0)
    row = path_row(compute_path_verdicts(records, kl_series=series))
    assert row["numbers"]["length_trend"]["p_value"] >= TREND_WARN_P
    assert not [r for r in row["reasons"] if r["check"] == "trend"]


def test_without_a_yardstick_the_trend_is_not_tested_and_says_why():
    records, series = planted_run(growth=10.0)
    series = [s for s in series if s["path"] != YARD]
    found = path_strata(series, {}, YARD)[("m", PATH)]
    assert found["length_trend"] == {"p_value": None, "why": f"no yardstick path {YARD} in this run"}


def test_a_series_row_without_its_key_names_the_field():
    with pytest.raises(ValueError, match="series.jsonl row without turn"):
        path_strata([{"model": "m", "scenario": "s1", "path": PATH, "series": "kl", "values": [0.1]}], {}, YARD)


# ---------------------------------------------------------------- reader and report


def test_the_reader_computes_the_strata_of_a_run_stored_before_them():
    from harness.runs.read import read_run

    strata = read_run(RUNS / "baseline").position_strata  # no flip series, no strata in its verdicts
    mla = strata[("canary-mla", "fp8_e4m3")]["strata"]["generation_position"]
    assert mla[0]["bucket"] == "[0, 16)" and mla[0]["tokens"] > 0 and mla[0]["flip_rate"] is None
    assert strata[("canary-mla", "fp8_e4m3")]["length_trend"] == {  # it ran no yardstick
        "p_value": None, "why": f"no yardstick path {YARD} in this run"}
