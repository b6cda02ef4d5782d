"""Task checks on a generated reply: is the expected answer there, are the scenario's rules kept.

Plain functions on text, shared by the reference and every KV path (docs/CONTRACTS.md):
- arithmetic: the last integer in the reply equals the answer ("1,591" and "68.0" count as 1591, 68);
- recall / long_context: the answer occurs in the reply as a whole word, ignoring case;
- rules: `ends_with` (the reply's last word(s), trailing punctuation stripped, equal it),
  `starts_with` (the reply, leading whitespace stripped, starts with it as whole words),
  `max_sentences` (runs of text ending in . ! ? , or at the end of the reply, are at most this many).
"""

from __future__ import annotations

import re
import unicodedata

from harness.scenarios.load import Scenario, Turn, contains_word

# An optional sign not glued to a word ("7-8" is 7 and 8), digits with optional thousands groups
# and an optional decimal part ("Answer: 68." ends with the integer 68, not a decimal).
NUMBER = re.compile(r"(?<![\w-])-?\d+(?:,\d{3})*(?:\.\d+)?|(?<=\w-)\d+(?:,\d{3})*(?:\.\d+)?")
SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+")  # a terminator followed by space ends a sentence


def check_answer(scenario: Scenario, turn: Turn, reply: str) -> bool | None:
    """Whether `reply` contains the turn's expected answer; None when the turn expects nothing."""
    if turn.expect is None:
        return None
    if scenario.kind == "arithmetic":
        return last_number(reply) == float(turn.expect)
    return contains_word(reply, turn.expect)


def check_rules(scenario: Scenario, reply: str) -> bool | None:
    """Whether `reply` keeps every rule of the scenario; None when it has none."""
    if not scenario.rules:
        return None
    return not broken_rules(scenario, reply)


def broken_rules(scenario: Scenario, reply: str) -> list[str]:
    """One line per rule the reply breaks, e.g. "ends_with 'Thanks': reply ends with 'Worce'"."""
    broken = []
    for rule, value in scenario.rules.items():
        seen = RULE_CHECKS[rule](reply, value)
        if seen is not None:
            broken.append(f"{rule} {value!r}: {seen}")
    return broken


def last_number(reply: str) -> float | None:
    """The last number written in digits in `reply`, or None when there is none."""
    matches = NUMBER.findall(reply)
    return float(matches[-1].replace(",", "")) if matches else None


def count_sentences(reply: str) -> int:
    """Runs of text ending in . ! ? followed by space or the end; a trailing unterminated run counts too.
    A run without any letter or digit ("!!!!") is not a sentence."""
    return sum(1 for run in SENTENCE_BREAK.split(reply.strip()) if re.search(r"\w", run))


def _strip_trailing_punctuation(text: str) -> str:
    while text and unicodedata.category(text[-1]).startswith("P"):
        text = text[:-1]
    return text


def _ends_with(reply: str, value: str) -> str | None:
    expected = value.split()
    tail = reply.split()[-len(expected):]
    if tail:
        tail[-1] = _strip_trailing_punctuation(tail[-1])
    expected[-1] = _strip_trailing_punctuation(expected[-1])
    return None if tail == expected else f"reply ends with {' '.join(tail)!r}"


def _starts_with(reply: str, value: str) -> str | None:
    text = reply.lstrip()
    rest = text[len(value):]
    if text.startswith(value) and not (value[-1].isalnum() and rest[:1].isalnum()):
        return None
    return f"reply starts with {text[:len(value) + 10]!r}"


def _max_sentences(reply: str, value: int) -> str | None:
    count = count_sentences(reply)
    return None if count <= value else f"reply has {count} sentences"


RULE_CHECKS = {"ends_with": _ends_with, "starts_with": _starts_with, "max_sentences": _max_sentences}
