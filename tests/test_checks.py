"""Answer and rule checks on hand-written replies, including the broken ones from FAILURE-CLASSES.md."""

from __future__ import annotations

import pytest

from harness.scenarios.checks import broken_rules, check_answer, check_rules, count_sentences, last_number
from harness.scenarios.load import Scenario, Turn


def scenario(kind: str, expect: str | None = None, **rules: object) -> tuple[Scenario, Turn]:
    turn = Turn("question", expect=expect)
    return Scenario(id="s", kind=kind, turns=(turn,), rules=dict(rules)), turn


@pytest.mark.parametrize("reply, answer, correct", [
    ("68", "68", True),
    ("The answer is 68.", "68", True),
    ("7 * 8 = 56, 3 * 4 = 12, so 56 + 12 = 68", "68", True),   # the last integer counts
    ("7 × 7 = 56", "68", False),                             # failure class 2's wrong answer
    ("37 * 43 = 1,591", "1591", True),                       # thousands separator
    ("1591.0", "1591", True),
    ("68.5", "68", False),
    ("It is -5.", "-5", True),
    ("10-5", "5", True),                                     # a minus glued to a digit is subtraction
    ("sixty-eight", "68", False),
    ("", "68", False),
])
def test_arithmetic_answer_is_the_last_number(reply, answer, correct):
    s, turn = scenario("arithmetic", expect=answer)
    assert check_answer(s, turn, reply) is correct


@pytest.mark.parametrize("kind", ["recall", "long_context"])
@pytest.mark.parametrize("reply, answer, correct", [
    ("Your name is Alexander.", "Alexander", True),
    ("your name is ALEXANDER", "Alexander", True),                        # case-insensitive
    ("I don't actually know your name.", "Alexander", False),            # failure class 2
    ("Alexandersson", "Alexander", False),                                # whole word only
    ("The code is 4711", "4711", True),
    ("The code is 47110", "4711", False),
    ("room Juniper-2", "Juniper", True),
])
def test_recall_and_needle_answers_are_whole_words(kind, reply, answer, correct):
    s, turn = scenario(kind, expect=answer)
    assert check_answer(s, turn, reply) is correct


def test_nothing_to_check_gives_none():
    s, turn = scenario("chat")
    assert check_answer(s, turn, "anything") is None
    assert check_rules(s, "anything") is None


@pytest.mark.parametrize("reply, kept", [
    ("We offer three plans. Thanks", True),
    ("We offer three plans. Thanks!", True),               # trailing punctuation stripped
    ("We offer three plans. Thanks.\n", True),
    ("We offer three plans. thanks", False),               # equality, not case-folded
    ("We offer three plans, thanks to you", False),
    ("...a S componentes_obs Worce!!!!!!!!!!!!!!!!", False),   # failure class 1
    ("", False),
])
def test_ends_with(reply, kept):
    s, _ = scenario("chat", ends_with="Thanks")
    assert check_rules(s, reply) is kept


def test_ends_with_several_words():
    s, _ = scenario("chat", ends_with="Thank you")
    assert check_rules(s, "Have a nice day. Thank you!") is True
    assert check_rules(s, "Have a nice day. Thank you all!") is False


@pytest.mark.parametrize("reply, kept", [
    ("Sure, here it is.", True),
    ("  Sure! Here it is.", True),
    ("Surely not.", False),                                # whole words
    ("Well, sure.", False),
])
def test_starts_with(reply, kept):
    s, _ = scenario("chat", starts_with="Sure")
    assert check_rules(s, reply) is kept


@pytest.mark.parametrize("reply, sentences", [
    ("One sentence.", 1),
    ("One. Two! Three?", 3),
    ("It costs 10.5 dollars. Thanks", 2),                   # a decimal point is not a sentence end
    ("Trailing words count too", 1),
    ("Wait... what?!", 2),
    ("!!!!!!!!!!!!!!!!", 0),                                # no words, no sentence
    ("", 0),
])
def test_count_sentences(reply, sentences):
    assert count_sentences(reply) == sentences


def test_max_sentences_and_all_rules_together():
    s, _ = scenario("chat", ends_with="Thanks", max_sentences=1)
    assert check_rules(s, "It costs 10 dollars. Thanks") is False     # two sentences
    assert check_rules(s, "It costs 10 dollars, Thanks") is True
    assert broken_rules(s, "One. Two. Three") == [
        "ends_with 'Thanks': reply ends with 'Three'",
        "max_sentences 1: reply has 3 sentences",
    ]


def test_last_number_none_without_digits():
    assert last_number("no digits here") is None
