"""Reference-agreement judge: how close a path's reply is to the BF16 reference's, scored 1-5.

similarity = 1 - token_edit_distance / max(len(reference), len(candidate)) over token ids.
Score: 5 identical; 4 similarity >= 0.9; 3 >= 0.7; 2 >= 0.4; else 1. When the scenario expects an
answer that the reference gives and the candidate does not, the score is capped at 2.
"""

from __future__ import annotations

from harness.analysis.metrics import token_edit_distance
from harness.judges.verdict import Verdict
from harness.scenarios.checks import check_answer
from harness.scenarios.load import Scenario
from harness.types import Generation

SIMILARITY_BANDS = ((0.9, 4.0), (0.7, 3.0), (0.4, 2.0))  # (lowest similarity, score), best band first


def agreement_judge(scenario: Scenario, turn: int, candidate: Generation, reference: Generation) -> Verdict:
    ref, cand = list(reference.token_ids), list(candidate.token_ids)
    if ref == cand:
        return Verdict("judge_agreement", "ok", 5.0, "identical to the reference", detail={"similarity": 1.0})
    similarity = 1.0 - token_edit_distance(ref, cand) / max(len(ref), len(cand))
    score = next((band_score for floor, band_score in SIMILARITY_BANDS if similarity >= floor), 1.0)
    reason = f"token similarity {similarity:.2f} to the reference"
    ref_answer = check_answer(scenario, scenario.turns[turn], reference.text)
    cand_answer = check_answer(scenario, scenario.turns[turn], candidate.text)
    if ref_answer and cand_answer is False:
        score = min(score, 2.0)
        reason += f"; the reference gives the expected answer {scenario.turns[turn].expect!r}, this reply does not"
    return Verdict("judge_agreement", "ok", score, reason, detail={"similarity": similarity})
