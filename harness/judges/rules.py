"""Rule judge: the scenario's own checks plus degeneration, scored 1-5 with every finding as the reason.

Score: start at 5. A repetition loop caps it at 1 (the reply is broken). A wrong expected answer caps
it at 2. Each broken rule costs 1, an early EOS 2, non-text output 2. Never below 1.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

import numpy as np

from harness.judges.verdict import Verdict
from harness.scenarios.checks import broken_rules, check_answer
from harness.scenarios.load import Scenario
from harness.types import Generation

SPECIAL_TOKEN_TEXT = re.compile(r"<\|[^|<>]{1,40}\|>|</?s>|\[/?INST\]")  # chat-template markers leaking into text


@dataclass(frozen=True, slots=True)
class DegenerationLimits:
    loop_min_chars: int = 12  # a loop covers at least this many characters ("!!!!!!!!!!!!")
    loop_min_repeats: float = 3.0  # ... and repeats its unit at least this often
    loop_max_period: int = 64  # longest repeated unit looked for, in characters
    early_eos_fraction: float = 0.5  # EOS before this fraction of the reference's length is early
    early_eos_min_tokens: int = 1  # an EOS with fewer tokens than this is early even without a reference

    def __post_init__(self) -> None:
        if self.loop_min_chars < 2 or self.loop_min_repeats < 2 or self.loop_max_period < 1:
            raise ValueError(f"DegenerationLimits: loop_min_chars >= 2, loop_min_repeats >= 2 and "
                             f"loop_max_period >= 1 needed, got {self}")
        if not 0 <= self.early_eos_fraction <= 1:
            raise ValueError(f"DegenerationLimits.early_eos_fraction must be in [0, 1], got {self.early_eos_fraction}")


def repetition_loop(text: str, limits: DegenerationLimits = DegenerationLimits()) -> tuple[int, int, str] | None:
    """The longest periodic run in `text`: (start, length, unit), if it is a loop by `limits`.

    A run of period p is a maximal stretch where text[i] == text[i - p]; with the unit it repeats, it spans
    run + p characters. Taken in order of period, then position, the first run of the greatest span wins.
    All periods are compared at once (a [periods, len(text)] boolean table): O(len(text) * loop_max_period).
    """
    longest_period = min(limits.loop_max_period, len(text) // 2)
    if longest_period < 1:
        return None
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)  # one code per character
    periods = np.arange(1, longest_period + 1)[:, None]  # [P, 1]
    earlier = np.arange(len(codes))[None, :] - periods  # [P, n]: i - p
    same = np.zeros((longest_period, len(codes) + 2), dtype=np.int8)  # same[p - 1, i + 1]: text[i] == text[i - p]
    same[:, 1:-1] = (earlier >= 0) & (codes[None, :] == codes[np.maximum(earlier, 0)])
    edges = np.diff(same, axis=1)
    rows, starts = np.nonzero(edges == 1)  # row-major: by period, then position; each run starts, then ends
    ends = np.nonzero(edges == -1)[1]  # a run of matches is text[starts:ends], its unit just before
    period = rows + 1
    spans = ends - starts + period
    loops = (spans >= limits.loop_min_chars) & (spans / period >= limits.loop_min_repeats)
    if not loops.any():
        return None
    first = int(np.argmax(np.where(loops, spans, -1)))  # the first of the greatest spans
    start, unit = int(starts[first] - period[first]), int(period[first])
    return start, int(spans[first]), text[start:start + unit]


def non_text(generation: Generation) -> list[str]:
    """Descriptions of output that is not text: control characters, U+FFFD, private-use characters,
    leaked template markers, tokens that decode to nothing."""
    found = []
    bad = [c for c in generation.text if (unicodedata.category(c) in ("Cc", "Co", "Cs") and c not in "\n\t\r")
           or c == "\ufffd"]
    if bad:
        found.append(f"{len(bad)} non-text character(s) {sorted(set(map(repr, bad)))[:5]}")
    markers = SPECIAL_TOKEN_TEXT.findall(generation.text)
    if markers:
        found.append(f"template markers in the text {sorted(set(markers))[:5]}")
    empty = sum(1 for token in generation.tokens if token == "")
    if empty:
        found.append(f"{empty} token(s) that decode to no text")
    return found


def early_eos(generation: Generation, reference: Generation | None, limits: DegenerationLimits) -> str | None:
    if generation.finish_reason != "eos":
        return None
    length = len(generation.token_ids)
    if length < limits.early_eos_min_tokens:
        return f"EOS after {length} token(s)"
    if reference is not None and length < limits.early_eos_fraction * len(reference.token_ids):
        return f"EOS after {length} token(s), the reference wrote {len(reference.token_ids)}"
    return None


def rule_judge(scenario: Scenario, turn: int, generation: Generation, reference: Generation | None = None,
               limits: DegenerationLimits = DegenerationLimits()) -> Verdict:
    """Score one generated reply of `scenario` at `turn` (reference: the BF16 reply, for early EOS)."""
    findings, score, cap = [], 5, 5
    loop = repetition_loop(generation.text, limits)
    if loop is not None:
        start, span, unit = loop
        findings.append(f"repetition loop: {unit!r} x{span / len(unit):.0f} ({span} chars from {start})")
        cap = 1
    answer = check_answer(scenario, scenario.turns[turn], generation.text)
    if answer is False:
        findings.append(f"expected answer {scenario.turns[turn].expect!r} missing")
        cap = min(cap, 2)
    for broken in broken_rules(scenario, generation.text) if scenario.rules else []:
        findings.append(f"rule {broken}")
        score -= 1
    eos = early_eos(generation, reference, limits)
    if eos is not None:
        findings.append(f"early EOS: {eos}")
        score -= 2
    problems = non_text(generation)
    if problems:  # one deduction, however many kinds of non-text output
        findings.append("non-text output: " + "; ".join(problems))
        score -= 2
    reason = "; ".join(findings) if findings else "answer, rules and form all fine"
    return Verdict(metric="judge_rule", status="ok", score=float(max(1, min(score, cap))), reason=reason,
                   detail={"answer_correct": answer, "findings": findings})
