"""Next-token candidates at the first divergent token (harness/analysis/candidates.py)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.analysis.candidates import candidates_at_divergence, top_candidates
from harness.types import Scores


def test_top_candidates_from_full_logits_are_normalised_and_ordered():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [3.0, 1.0, 2.0, -1.0]])
    best = top_candidates(logits, None, 1, k=3)
    assert [token for token, _ in best] == [0, 2, 1]
    expected = torch.log_softmax(logits[1].double(), dim=-1)  # float64 reference for the log-probs
    assert [lp for _, lp in best] == pytest.approx([expected[0].item(), expected[2].item(), expected[1].item()],
                                                   abs=1e-12)
    assert top_candidates(logits, None, 2) is None  # past the scored positions


def test_top_candidates_from_endpoint_topk_break_ties_by_id():
    top = [{5: -0.1, 3: -2.0, 9: -2.0, 1: -4.0}]
    assert top_candidates(None, top, 0, k=3) == [[5, -0.1], [3, -2.0], [9, -2.0]]
    assert top_candidates(None, [{}], 0) is None


def test_candidates_keep_nonfinite_logprobs_as_none_and_need_a_divergence():
    reference = Scores(logprobs=torch.tensor([[2.0, 1.0, 0.0]]), top_logprobs=None)
    broken = Scores(logprobs=torch.tensor([[math.nan, 1.0, 0.0]]), top_logprobs=None)
    found = candidates_at_divergence(reference, broken, 0)
    assert found["position"] == 0 and found["reference"][0][0] == 0
    assert all(lp is None for _, lp in found["path"])  # NaN in the path's cache: stored as None, never NaN
    assert candidates_at_divergence(reference, broken, None) is None
