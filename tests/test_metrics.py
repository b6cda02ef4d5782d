import math

import pytest
import torch

from harness.analysis.metrics import (
    SERIES_KEYS,
    SUMMARY_KEYS,
    percentile,
    free_running,
    noise_floor,
    teacher_forced,
    teacher_forced_topk,
    token_edit_distance,
)
from harness.records import METRIC_DIRECTIONS

# ---------------------------------------------------------------- free-running


@pytest.mark.parametrize("reference, candidate, first, prefix_frac", [
    ([1, 2, 3, 4], [1, 2, 3, 4], None, 1.0),   # identical
    ([1, 2, 3, 4], [1, 2, 9, 4], 2, 0.5),      # substitution at index 2
    ([1, 2, 3, 4], [1, 2], 2, 0.5),            # candidate stops early (early EOS): shorter length
    ([1, 2], [1, 2, 3, 4], 2, 1.0),            # candidate runs on past the reference
    ([5, 6, 7], [8, 6, 7], 0, 0.0),            # first token differs
    ([], [], None, 1.0),                       # both empty
    ([], [3], 0, 0.0),                         # only the reference is empty
])
def test_free_running_divergence(reference, candidate, first, prefix_frac):
    out = free_running(reference, candidate)
    assert out["first_divergent_token"] == first
    assert out["exact_match"] == (1.0 if first is None else 0.0)
    assert out["common_prefix_frac"] == prefix_frac
    assert set(out) <= set(METRIC_DIRECTIONS)


@pytest.mark.parametrize("a, b, distance", [
    ([], [], 0),
    ([1, 2, 3], [], 3),
    ([], [1, 2], 2),
    ([1, 2, 3], [1, 2, 3], 0),
    ([1, 2, 3], [1, 9, 3], 1),                     # one substitution
    ([1, 2, 3], [1, 3], 1),                        # one deletion
    ([1, 3], [1, 2, 3], 1),                        # one insertion
    ([1, 2, 3, 4], [2, 3, 4, 5], 2),               # shift: delete head, insert tail
    ([ord(c) for c in "kitten"], [ord(c) for c in "sitting"], 3),  # the textbook pair
    ([ord(c) for c in "flaw"], [ord(c) for c in "lawn"], 2),        # delete head, insert tail
    ([7, 7, 7], [8, 8], 3),                        # nothing shared: 2 substitutions + 1 deletion
])
def test_token_edit_distance(a, b, distance):
    assert token_edit_distance(a, b) == distance
    assert token_edit_distance(b, a) == distance
    assert free_running(a, b)["token_edit_distance"] == float(distance)


def test_edit_distance_accepts_tensor_tokens():
    assert token_edit_distance(torch.tensor([1, 2, 3]), [1, 3]) == 1
    assert free_running(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3]))["exact_match"] == 1.0


# ---------------------------------------------------------------- teacher-forced


def test_teacher_forced_identical_is_exactly_zero():
    torch.manual_seed(0)
    logits = torch.randn(7, 13, dtype=torch.bfloat16)  # awkward T and V
    tokens = logits.float().argmax(-1).tolist()
    out = teacher_forced(logits, logits.clone(), tokens)
    assert out.series["kl"] == [0.0] * 7
    assert out.series["ref_logprob_delta"] == [0.0] * 7
    entropy = out.series["ref_entropy"][0]
    margin = out.series["ref_margin"][0]
    assert out.summary == {"kl_mean": 0.0, "kl_max": 0.0, "top1_agree": 1.0, "ref_logprob_delta_mean": 0.0,
                           "ref_logprob_delta_min": 0.0, "ref_rank_mean": 0.0, "ref_rank_max": 0.0,
                           "kl_p99": 0.0, "kl_p999": 0.0, "kl_max_pos": 0.0, "kl_max_ref_entropy": entropy,
                           "kl_max_ref_margin": margin, "confident_flips": 0.0, "near_tie_flips": 0.0,
                           "first_flip_topk_ok": None}
    assert out.series["flip"] == [0.0] * 7
    assert set(out.summary) == set(SUMMARY_KEYS) <= set(METRIC_DIRECTIONS)
    assert set(out.series) == set(SERIES_KEYS)


def test_teacher_forced_two_token_kl_by_hand():
    # position 0: ref (0.75, 0.25), path (0.5, 0.5); position 1: ref (0.2, 0.8), path (0.6, 0.4)
    ref = torch.tensor([[0.75, 0.25], [0.2, 0.8]]).log()
    path = torch.tensor([[0.5, 0.5], [0.6, 0.4]]).log()
    kl0 = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    kl1 = 0.2 * math.log(0.2 / 0.6) + 0.8 * math.log(0.8 / 0.4)
    out = teacher_forced(ref, path, [0, 1])
    assert out.series["kl"] == pytest.approx([kl0, kl1], rel=1e-6)  # float32 inputs
    assert out.series["top1_agree"] == [1.0, 0.0]  # path argmax: 0 (tie -> lowest id), 0
    assert out.series["ref_logprob_delta"] == pytest.approx([math.log(0.5 / 0.75), math.log(0.4 / 0.8)], rel=1e-6)
    assert out.series["ref_rank"] == [0.0, 1.0]  # tie at position 0 does not push token 0 down
    assert out.summary["kl_mean"] == pytest.approx((kl0 + kl1) / 2, rel=1e-6)
    assert out.summary["kl_max"] == pytest.approx(kl1, rel=1e-6)
    assert out.summary["top1_agree"] == 0.5
    assert out.summary["ref_logprob_delta_min"] == pytest.approx(math.log(0.5), rel=1e-6)
    assert (out.summary["ref_rank_mean"], out.summary["ref_rank_max"]) == (0.5, 1.0)


def test_teacher_forced_accepts_raw_logits():
    # logits shifted by a constant are the same distribution: log_softmax is applied inside
    logits = torch.tensor([[2.0, 1.0, -1.0], [0.0, 3.0, 0.5]], dtype=torch.float64)
    out = teacher_forced(logits, logits + 17.0, [0, 1])
    assert out.summary["kl_max"] == pytest.approx(0.0, abs=1e-12)
    assert out.summary["top1_agree"] == 1.0


def test_teacher_forced_rank_with_ties():
    path = torch.tensor([[3.0, 3.0, 1.0, 3.0, 2.0]])
    ref = torch.zeros(1, 5)
    assert teacher_forced(ref, path, [3]).series["ref_rank"] == [0.0]  # ties with 0 and 1: not strictly greater
    assert teacher_forced(ref, path, [4]).series["ref_rank"] == [3.0]
    assert teacher_forced(ref, path, [2]).series["ref_rank"] == [4.0]
    assert teacher_forced(ref, path, [3]).series["top1_agree"] == [0.0]  # argmax picks token 0 of the tie
    assert teacher_forced(ref, path, [0]).series["top1_agree"] == [1.0]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_teacher_forced_nonfinite_path_is_inf_kl(bad):
    ref = torch.tensor([[1.0, 0.0, -1.0], [0.5, 0.2, 0.1]])
    path = ref.clone()
    path[1, 2] = bad
    out = teacher_forced(ref, path, [0, 0])
    assert out.series["kl"] == [0.0, math.inf]
    assert out.series["top1_agree"] == [1.0, 0.0]
    assert out.series["ref_logprob_delta"] == [0.0, -math.inf]
    assert out.series["ref_rank"] == [0.0, 2.0]
    assert out.summary["kl_mean"] == math.inf and out.summary["kl_max"] == math.inf


def test_teacher_forced_masked_path_token_is_not_an_error():
    # -inf is a masked token: KL is +inf only because the reference puts mass on it
    ref = torch.tensor([[0.0, 0.0]])
    out = teacher_forced(ref, torch.tensor([[0.0, -math.inf]]), [0])
    assert out.series["kl"] == [math.inf] and out.series["top1_agree"] == [1.0]
    assert teacher_forced(torch.tensor([[0.0, -math.inf]]), torch.tensor([[0.0, -math.inf]]), [0]).series["kl"] == [0.0]


def test_teacher_forced_empty_turn():
    out = teacher_forced(torch.zeros(0, 11), torch.zeros(0, 11), [])
    assert out.summary == dict.fromkeys(SUMMARY_KEYS)
    assert out.series == {k: [] for k in SERIES_KEYS}


@pytest.mark.parametrize("ref, path, tokens, message", [
    (torch.zeros(2, 3), torch.zeros(2, 4), [0, 0], "path_logprobs shape"),
    (torch.zeros(3), torch.zeros(3), [0], r"shape \[T, V\]"),
    (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), [0, 0], "float tensor"),
    (torch.zeros(2, 3), torch.zeros(2, 3), [0], "2 logprob rows"),
    (torch.zeros(2, 3), torch.zeros(2, 3), [0, 3], r"reference_tokens\[1\] = 3"),
    (torch.tensor([[0.0, math.nan]]), torch.zeros(1, 2), [0], "reference logprobs hold NaN"),
])
def test_teacher_forced_rejects_bad_inputs(ref, path, tokens, message):
    with pytest.raises(ValueError, match=message):
        teacher_forced(ref, path, tokens)


# ---------------------------------------------------------------- teacher-forced, top-k only


def test_topk_identical_is_exactly_zero():
    top = [{5: math.log(0.6), 2: math.log(0.3)}, {1: math.log(0.9), 7: math.log(0.05)}]
    out = teacher_forced_topk(top, [dict(d) for d in top], [5, 1])
    entropy = [-sum(p * math.log(p) for p in probs) for probs in ((0.6, 0.3, 0.1), (0.9, 0.05, 0.05))]
    assert out.series == {"kl": [0.0, 0.0], "top1_agree": [1.0, 1.0], "ref_logprob_delta": [0.0, 0.0],
                          "ref_rank": [0.0, 0.0], "ref_entropy": pytest.approx(entropy, rel=1e-12),
                          "ref_margin": pytest.approx([math.log(2), math.log(18)], rel=1e-12), "flip": [0.0, 0.0]}
    assert out.summary["kl_mean"] == 0.0 and out.summary["ref_logprob_delta_min"] == 0.0
    assert out.summary["first_flip_topk_ok"] is None and out.summary["confident_flips"] == 0.0


def test_topk_kl_by_hand_with_other_bucket():
    # both list tokens 1 and 2; ref's other = 0.1, path's other = 0.3
    ref = [{1: math.log(0.6), 2: math.log(0.3)}]
    path = [{1: math.log(0.5), 2: math.log(0.2)}]
    expected = 0.6 * math.log(0.6 / 0.5) + 0.3 * math.log(0.3 / 0.2) + 0.1 * math.log(0.1 / 0.3)
    out = teacher_forced_topk(ref, path, [1])
    assert out.series["kl"] == [pytest.approx(expected, rel=1e-12)]
    assert out.series["ref_logprob_delta"] == [pytest.approx(math.log(0.5 / 0.6), rel=1e-12)]


def test_topk_one_sided_tokens_go_to_other_and_kl_is_a_lower_bound():
    # full distributions over 4 tokens; each side lists its own top-2
    p, q = [0.5, 0.3, 0.15, 0.05], [0.5, 0.1, 0.3, 0.1]
    ref, path = [{0: math.log(0.5), 1: math.log(0.3)}], [{0: math.log(0.5), 2: math.log(0.3)}]
    approx = teacher_forced_topk(ref, path, [1]).series["kl"][0]
    # buckets: {0} and other; ref (0.5, 0.5), path (0.5, 0.5) -> 0
    assert approx == pytest.approx(0.0, abs=1e-12)
    exact = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    assert approx <= exact


def test_topk_missing_reference_token_in_path():
    ref = [{3: math.log(0.7), 4: math.log(0.2)}]
    path = [{4: math.log(0.6), 8: math.log(0.3)}]
    out = teacher_forced_topk(ref, path, [3])
    assert out.series["ref_logprob_delta"] == [None]
    assert out.series["top1_agree"] == [0.0]
    assert out.series["ref_rank"] == [2.0]  # below both listed entries: lower bound
    # summary uses the bound: below the smallest listed path logprob
    assert out.summary["ref_logprob_delta_min"] == pytest.approx(math.log(0.3) - math.log(0.7), rel=1e-12)


def test_topk_rank_ties_and_nan():
    ref = [{1: math.log(0.5)}, {0: math.log(0.5)}]
    path = [{0: math.log(0.4), 1: math.log(0.4), 2: math.log(0.1)}, {0: math.nan, 1: math.log(0.5)}]
    out = teacher_forced_topk(ref, path, [1, 0])
    assert out.series["ref_rank"][0] == 0.0 and out.series["top1_agree"][0] == 0.0  # tie -> token 0 is top-1
    assert out.series["kl"][1] == math.inf
    assert out.summary["kl_mean"] == math.inf


def test_topk_empty_and_bad_inputs():
    assert teacher_forced_topk([], [], []).summary == dict.fromkeys(SUMMARY_KEYS)
    with pytest.raises(ValueError, match="need one of each"):
        teacher_forced_topk([{}], [], [0])
    with pytest.raises(ValueError, match="position 0: empty top-k"):
        teacher_forced_topk([{0: 0.0}], [{}], [0])
    with pytest.raises(ValueError, match="reference token 5 missing"):
        teacher_forced_topk([{0: 0.0}], [{0: 0.0}], [5])


# ---------------------------------------------------------------- noise floor


def test_noise_floor():
    records = [
        {"metric": "kl_mean", "value": 0.0},
        {"metric": "kl_mean", "value": 3e-4},
        {"metric": "kl_max", "value": 1e-3},
        {"metric": "ref_logprob_delta_min", "value": -0.02},
        {"metric": "ref_logprob_delta_mean", "value": 0.01},
        {"metric": "token_edit_distance", "value": 2.0},
        {"metric": "exact_match", "value": 1.0},
        {"metric": "exact_match", "value": 0.0},
        {"metric": "top1_agree", "value": 0.96},             # reference self-consistency: skipped
        {"metric": "common_prefix_frac", "value": 0.75},
        {"metric": "ref_rank_max", "value": 1.0},            # reference self-consistency: skipped
        {"metric": "first_divergent_token", "value": 12},   # no identical-run value: skipped
        {"metric": "kl_max", "value": None},                 # missing: skipped
        {"metric": "kl_max", "value": math.nan},             # pandas' missing marker: skipped
    ]
    assert noise_floor(records) == pytest.approx({
        "kl_mean": 3e-4, "kl_max": 1e-3, "ref_logprob_delta_min": 0.02, "ref_logprob_delta_mean": 0.01,
        "token_edit_distance": 2.0, "exact_match": 1.0, "common_prefix_frac": 0.25,
    })
    assert noise_floor([]) == {}


def test_topk_kl_tolerates_logprob_rounding_of_a_bf16_server():
    # a bf16 server's top logprob is exactly 0.0: its listed mass exceeds 1 by ~7e-8 (issue 13), while
    # the fp32 reference leaves ~1e-7 unlisted. Both are rounding: KL must be finite and tiny, not inf.
    ref = [{7: -2e-7, 3: -17.0, 9: -18.0}]  # leaves 1.4e-7 unlisted
    path = [{7: 0.0, 3: -16.5, 9: -17.9}]
    kl = teacher_forced_topk(ref, path, [7]).series["kl"][0]
    assert math.isfinite(kl) and kl < 1e-6


def test_topk_kl_still_flags_mass_the_path_lost():
    # the reference leaves 0.1 outside its top-k; the path lists all its mass on shared tokens: KL is a
    # finite lower bound (the path's leftover is taken as the most rounding could hide), and large
    ref = [{1: math.log(0.6), 2: math.log(0.3)}]
    path = [{1: math.log(0.7), 2: math.log(0.3)}]
    from harness.analysis.metrics import TOPK_MASS_TOL
    expected = 0.6 * math.log(0.6 / 0.7) + 0.1 * math.log(0.1 / TOPK_MASS_TOL)
    assert teacher_forced_topk(ref, path, [1]).series["kl"] == [pytest.approx(expected, rel=1e-9)]
    assert expected > 0.9


# ---------------------------------------------------------------- robust statistics and flips


def test_percentile_matches_numpy_linear():
    import numpy as np
    values = [0.3, 0.0, 7.0, 1e-6, 2.5, 0.01, 0.4]  # awkward: 7 values, unsorted
    for q in (0.0, 50.0, 99.0, 99.9, 100.0):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    assert percentile([1.0, math.inf], 99.9) == math.inf and percentile([1.0, 2.0, math.inf], 0) == 1.0
    with pytest.raises(ValueError, match="NaN"):
        percentile([1.0, math.nan], 50)


def test_flips_split_by_reference_margin_and_vllm_rule():
    # position 0: reference sure (token 0 leads by 3 nats), path prefers token 1: a confident flip, and each
    # argmax is the other's runner-up, so check_logprobs_close holds. Position 1: a near-tie flip (margin 0.2).
    # Position 2: the path's argmax (token 6) is last of 7 under the reference: outside its top 5.
    ref = torch.tensor([[3.0, 0.0, -9, -9, -9, -9, -9], [0.2, 0.0, -9, -9, -9, -9, -9],
                        [5.0, 4.0, 3.0, 2.0, 1.0, 0.5, -1.0]], dtype=torch.float64)
    path = torch.tensor([[0.0, 3.0, -9, -9, -9, -9, -9], [0.0, 0.2, -9, -9, -9, -9, -9],
                         [5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 9.0]], dtype=torch.float64)
    out = teacher_forced(ref, path, [0, 0, 0])
    assert out.series["flip"] == [1.0, 1.0, 1.0]
    assert out.series["ref_margin"] == pytest.approx([3.0, 0.2, 1.0], abs=1e-12)
    assert out.summary["confident_flips"] == 1.0  # margin 1.0 is not > CONFIDENT_MARGIN: near-tie
    assert out.summary["near_tie_flips"] == 2.0
    assert out.summary["first_flip_topk_ok"] == 1.0
    later = teacher_forced(ref[2:], path[2:], [0])
    assert later.summary["first_flip_topk_ok"] == 0.0
    assert later.summary["kl_max_pos"] == 0.0 and later.summary["kl_max_ref_margin"] == pytest.approx(1.0)


def test_stratified_divergence_bins_by_entropy_and_context_position():
    from harness.analysis.metrics import stratified_divergence

    key = {"model": "m", "scenario": "s", "path": "p", "turn": 0}
    rows = [key | {"series": "kl", "values": [0.1, 0.3, None, 2.0], "values_text": {"2": "inf"}},
            key | {"series": "ref_entropy", "values": [0.1, 1.0, 1.0, 3.0]},
            key | {"series": "flip", "values": [0.0, 1.0, 1.0, 1.0]}]
    out = stratified_divergence(rows, {("m", "s", "p", 0): 254})  # positions 254, 255, (256: inf), 257
    got = {(r["by"], r["bin"]): (r["tokens"], r["kl_mean"], r["flips"]) for r in out}
    assert got[("reference entropy", "[0, 0.5)")] == (1, 0.1, 0)
    assert got[("reference entropy", "[0.5, 2)")] == (2, pytest.approx((0.3 + math.inf) / 2), 2)
    assert got[("reference entropy", "[2, inf)")] == (1, 2.0, 1)
    assert got[("context position", "[0, 256)")] == (2, pytest.approx(0.2), 1)
    assert got[("context position", "[256, 1024)")][0] == 2  # the inf token is kept, never dropped


def test_noise_floor_skips_where_kl_max_sits():
    from harness.analysis.metrics import noise_floor

    rows = [{"metric": "kl_max", "value": 0.0}, {"metric": "kl_max_pos", "value": 17.0},
            {"metric": "kl_max_ref_entropy", "value": 2.3}, {"metric": "kl_max_ref_margin", "value": 0.4},
            {"metric": "confident_flips", "value": 0.0}]
    assert noise_floor(rows) == {"kl_max": 0.0, "confident_flips": 0.0}
