"""What every judge returns: a 1-5 score (or why there is none), the reason, and what produced it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

STATUSES = ("ok", "unparsable", "failed", "skipped")
SCORE_RANGE = (1, 5)
# Per-turn judge metrics and which way is good; meant for harness.records.METRIC_DIRECTIONS.
JUDGE_METRIC_DIRECTIONS: dict[str, str] = {
    "judge_rule": "higher",            # rule judge, 1-5
    "judge_agreement": "higher",       # reference-agreement judge, 1-5
    "judge_llm": "higher",             # LLM judge, single answer, 1-5
    "judge_llm_reference": "higher",   # LLM judge, reference-guided (arithmetic), 1-5
    "judge_pairwise": "higher",        # LLM judge, candidate vs reference: 1 win, 0.5 tie, 0 loss
}


@dataclass(frozen=True, slots=True)
class Verdict:
    """One judge's verdict on one reply. `score` is None unless status is "ok": an unparsable or
    failed judgement is recorded as such, never defaulted and never averaged in."""

    metric: str  # a JUDGE_METRIC_DIRECTIONS key
    status: str  # ok | unparsable | failed | skipped
    score: float | None
    reason: str
    judge_model: str | None = None  # LLM judges: the model that judged
    template_sha256: str | None = None  # LLM judges: the prompt template's text
    prompt_sha256: str | None = None  # LLM judges: the rendered prompt(s)
    raw_replies: tuple[str, ...] = ()  # LLM judges: every reply, verbatim (pairwise: both orders)
    detail: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.metric not in JUDGE_METRIC_DIRECTIONS:
            raise ValueError(f"Verdict.metric {self.metric!r}: expected one of {', '.join(JUDGE_METRIC_DIRECTIONS)}")
        if self.status not in STATUSES:
            raise ValueError(f"Verdict.status {self.status!r}: expected one of {', '.join(STATUSES)}")
        if (self.score is None) == (self.status == "ok"):
            raise ValueError(f"Verdict {self.metric}: status {self.status!r} with score {self.score!r}; "
                             f"a score goes with status 'ok' and only with it")

    def as_row(self) -> dict:
        return {"metric": self.metric, "value": self.score, "status": self.status, "reason": self.reason,
                "judge_model": self.judge_model, "template_sha256": self.template_sha256,
                "prompt_sha256": self.prompt_sha256, "raw_replies": list(self.raw_replies), "detail": self.detail}


def summarise(verdicts: Iterable[Verdict]) -> dict[str, float | int | None]:
    """Mean of the scored verdicts, with the unscored ones counted beside it, never folded in."""
    verdicts = list(verdicts)
    scores = [v.score for v in verdicts if v.status == "ok"]
    counts = {status: sum(v.status == status for v in verdicts) for status in STATUSES}
    return {"mean": sum(scores) / len(scores) if scores else None, "scored": len(scores),
            "unparsable": counts["unparsable"], "failed": counts["failed"], "skipped": counts["skipped"]}
