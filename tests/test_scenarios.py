"""Scenario files: each kind compiles as docs/CONTRACTS.md says, and every invalid file is refused
with one error naming the file, the scenario and the field."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from harness.scenarios.filler import filler_text, insert_needle
from harness.scenarios.load import Scenario, ScenarioError, Turn
from harness.scenarios.sources import load_scenarios

REPO = Path(__file__).resolve().parent.parent

CHAT = """\
  - id: chat-1
    kind: chat
    system: "You are a sales assistant. End every answer with the word Thanks."
    rules: {ends_with: Thanks, max_sentences: 1}
    turns:
      - user: "What plans do you offer?"
      - user: "And the price?"
        assistant: "It costs 10 dollars. Thanks"
      - user: "Any discount?"
"""
ARITHMETIC = """\
  - id: arith-1
    kind: arithmetic
    system: "Answer with the number only."
    prompt: "What is 7 * 8 + 3 * 4?"
    answer: "68"
    generation: {max_new_tokens: 8, greedy: true}
    thresholds: {kl_max: 0.05, answer_correct: 1}
"""
RECALL = """\
  - id: recall-1
    kind: recall
    facts: {name: Alexander}
    turns:
      - user: "Hello, my name is Alexander."
      - user: "Tell me about rivers."
      - user: "What is my name?"
        expect: {fact: name}
"""
NEEDLE = """\
  - id: needle-1
    kind: long_context
    needle: "The secret code is 4711."
    question: "What is the secret code?"
    answer: "4711"
    filler: {chars: 2000, depth: 0.5, seed: 7}
"""


def write(directory: Path, body: str, name: str = "s.yaml") -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


def scenarios_file(directory: Path, *entries: str, name: str = "s.yaml", defaults: str = "") -> Path:
    return write(directory, defaults + "scenarios:\n" + "".join(entries), name)


def load_error(*paths: Path) -> str:
    with pytest.raises(ScenarioError) as info:
        load_scenarios(list(paths))
    return str(info.value)


# --- loading each kind ------------------------------------------------------------------------


def test_chat_compiles_turns_rules_and_system(tmp_path):
    (scenario,) = load_scenarios([scenarios_file(tmp_path, CHAT)])
    assert scenario.kind == "chat" and scenario.id == "chat-1"
    assert scenario.system.startswith("You are a sales assistant")
    assert scenario.rules == {"ends_with": "Thanks", "max_sentences": 1}
    assert scenario.turns == (
        Turn("What plans do you offer?"),
        Turn("And the price?", assistant="It costs 10 dollars. Thanks"),
        Turn("Any discount?"),
    )
    assert scenario.max_new_tokens == 64  # the default
    assert scenario.source == str(tmp_path / "s.yaml")


def test_arithmetic_prompt_becomes_one_turn(tmp_path):
    (scenario,) = load_scenarios([scenarios_file(tmp_path, ARITHMETIC)])
    assert scenario.turns == (Turn("What is 7 * 8 + 3 * 4?", expect="68"),)
    assert scenario.max_new_tokens == 8
    assert scenario.thresholds == {"kl_max": 0.05, "answer_correct": 1.0}


def test_arithmetic_explicit_turns_and_integer_answers(tmp_path):
    path = scenarios_file(tmp_path, """\
  - id: arith-2
    kind: arithmetic
    turns:
      - user: "What is 12 * 12?"
        expect: 144
      - user: "Now add 56."
        expect: "200"
""")
    (scenario,) = load_scenarios([path])
    assert [t.expect for t in scenario.turns] == ["144", "200"]


def test_recall_resolves_fact(tmp_path):
    (scenario,) = load_scenarios([scenarios_file(tmp_path, RECALL)])
    assert [t.expect for t in scenario.turns] == [None, None, "Alexander"]


def test_long_context_builds_filler_needle_and_question(tmp_path):
    (scenario,) = load_scenarios([scenarios_file(tmp_path, NEEDLE)])
    expected = insert_needle(filler_text(2000, 7), "The secret code is 4711.", 0.5) + "\nWhat is the secret code?"
    assert scenario.turns == (Turn(expected, expect="4711"),)


def test_defaults_merge_into_every_scenario(tmp_path):
    defaults = """\
defaults:
  tags: [canary]
  generation: {max_new_tokens: 32}
  thresholds: {kl_max: 0.1}
  filler: {chars: 500, seed: 3}
"""
    needle = NEEDLE.replace("filler: {chars: 2000, depth: 0.5, seed: 7}", "filler: {depth: 0.25}")
    path = scenarios_file(tmp_path, ARITHMETIC.replace("    kind:", "    tags: [arithmetic]\n    kind:"),
                          CHAT, needle, defaults=defaults)
    arith, chat, long_context = load_scenarios([path])
    assert arith.tags == ("canary", "arithmetic") and chat.tags == ("canary",)
    assert arith.max_new_tokens == 8 and chat.max_new_tokens == 32            # the scenario wins
    assert arith.thresholds == {"kl_max": 0.05, "answer_correct": 1.0}        # merged key by key
    assert chat.thresholds == {"kl_max": 0.1}
    text = insert_needle(filler_text(500, 3), "The secret code is 4711.", 0.25)
    assert long_context.turns[0].user == text + "\nWhat is the secret code?"


def test_malformed_tags_beside_default_tags_are_named(tmp_path):
    # Found by the fuzz test: default tags merged into a list holding a list raised TypeError (unhashable).
    path = scenarios_file(tmp_path, CHAT.replace("    kind:", "    tags: [[x]]\n    kind:"),
                          defaults="defaults:\n  tags: [canary]\n", name="bad.yaml")
    message = load_error(path)
    assert f"{path}: scenario 'chat-1': field 'tags[0]': expected a non-empty string" in message, message


def test_directories_are_searched_recursively_in_sorted_order(tmp_path):
    scenarios_file(tmp_path / "b", CHAT, name="z.yml")
    scenarios_file(tmp_path / "a", RECALL)
    scenarios_file(tmp_path, ARITHMETIC, name="c.yaml")
    write(tmp_path, "not yaml scenarios", name="notes.txt")
    assert [s.id for s in load_scenarios([tmp_path])] == ["recall-1", "chat-1", "arith-1"]
    # a file named twice (directly and through its directory) is loaded once
    assert len(load_scenarios([tmp_path / "c.yaml", tmp_path])) == 3


def test_general_scenarios_load():
    scenarios = load_scenarios([REPO / "scenarios" / "general"])
    kinds = [s.kind for s in scenarios]
    assert {"chat", "arithmetic", "recall", "long_context"} <= set(kinds)


# --- content hash -----------------------------------------------------------------------------


def test_content_hash_ignores_id_file_and_tags(tmp_path):
    (original,) = load_scenarios([scenarios_file(tmp_path / "one", ARITHMETIC)])
    renamed = ARITHMETIC.replace("id: arith-1", "id: arith-renamed").replace("    kind:", "    tags: [x]\n    kind:")
    (moved,) = load_scenarios([scenarios_file(tmp_path / "two", renamed, name="other.yaml")])
    assert original.content_hash == moved.content_hash
    assert len(original.content_hash) == 64


@pytest.mark.parametrize("old, new", [
    ('prompt: "What is 7 * 8 + 3 * 4?"', 'prompt: "What is 7 * 8 + 3 * 5?"'),
    ('answer: "68"', 'answer: "69"'),
    ("max_new_tokens: 8", "max_new_tokens: 9"),
    ("kl_max: 0.05", "kl_max: 0.06"),
    ('system: "Answer with the number only."', 'system: "Answer briefly."'),
])
def test_content_hash_changes_with_content(tmp_path, old, new):
    (original,) = load_scenarios([scenarios_file(tmp_path / "one", ARITHMETIC)])
    (changed,) = load_scenarios([scenarios_file(tmp_path / "two", ARITHMETIC.replace(old, new))])
    assert original.content_hash != changed.content_hash


def test_content_hash_is_computed_for_hand_built_scenarios(tmp_path):
    (loaded,) = load_scenarios([scenarios_file(tmp_path, ARITHMETIC)])
    built = Scenario(id="x", kind="arithmetic", turns=loaded.turns, system=loaded.system,
                     max_new_tokens=8, thresholds={"kl_max": 0.05, "answer_correct": 1.0})
    assert built.content_hash == loaded.content_hash


# --- validation -------------------------------------------------------------------------------

# (scenario entry, field named in the error, words the message must contain)
INVALID = [
    pytest.param(CHAT.replace("    kind: chat", "    kind: chat\n    colour: red"),
                 "chat-1", "colour", "unknown key", id="unknown-scenario-key"),
    pytest.param(CHAT.replace("      - user: \"Any discount?\"", "      - user: \"Any discount?\"\n        mood: x"),
                 "chat-1", "turns[2].mood", "unknown key", id="unknown-turn-key"),
    pytest.param(ARITHMETIC.replace("greedy: true", "greedy: true, temperature: 0.7"),
                 "arith-1", "generation.temperature", "unknown key", id="unknown-generation-key"),
    pytest.param(NEEDLE.replace("seed: 7", "seed: 7, style: prose"),
                 "needle-1", "filler.style", "unknown key", id="unknown-filler-key"),
    pytest.param(CHAT.replace("max_sentences: 1", "max_words: 5"),
                 "chat-1", "rules.max_words", "unknown key", id="unknown-rule"),
    pytest.param(RECALL.replace("    facts:", "    answer: x\n    facts:"),
                 "recall-1", "answer", "not used by kind 'recall'", id="key-of-other-kind"),
    pytest.param(CHAT.replace("kind: chat", "kind: essay"),
                 "chat-1", "kind", "unknown kind 'essay'", id="unknown-kind"),
    pytest.param(CHAT.replace("    kind: chat\n", ""), "chat-1", "kind", "missing required field", id="missing-kind"),
    pytest.param(CHAT.replace("    system: \"You are", "    tags: canary\n    system: \"You are"),
                 "chat-1", "tags", "expected a list of strings, got 'canary'", id="tags-not-list"),
    pytest.param(CHAT.replace("max_sentences: 1", "max_sentences: one"),
                 "chat-1", "rules.max_sentences", "expected a positive integer, got 'one'", id="rule-wrong-type"),
    pytest.param(ARITHMETIC.replace("greedy: true", "greedy: false"),
                 "arith-1", "generation.greedy", "must be true), got False", id="greedy-false"),
    pytest.param(ARITHMETIC.replace("max_new_tokens: 8", "max_new_tokens: 0"),
                 "arith-1", "generation.max_new_tokens", "positive integer, got 0", id="max-new-tokens-zero"),
    pytest.param(ARITHMETIC.replace("max_new_tokens: 8", "max_new_tokens: -3"),
                 "arith-1", "generation.max_new_tokens", "positive integer, got -3", id="max-new-tokens-negative"),
    pytest.param(ARITHMETIC.replace("kl_max: 0.05", "kl_maxx: 0.05"),
                 "arith-1", "thresholds.kl_maxx", "unknown metric 'kl_maxx'", id="unknown-threshold-metric"),
    pytest.param(ARITHMETIC.replace("kl_max: 0.05", "kl_max: low"),
                 "arith-1", "thresholds.kl_max", "expected a finite number, got 'low'", id="threshold-not-number"),
    pytest.param(ARITHMETIC.replace('answer: "68"', 'answer: "sixty-eight"'),
                 "arith-1", "answer", "must be an integer, got 'sixty-eight'", id="arithmetic-answer-not-integer"),
    pytest.param(ARITHMETIC.replace('    answer: "68"\n', ""), "arith-1", "answer", "missing required field",
                 id="arithmetic-missing-answer"),
    pytest.param(NEEDLE.replace("depth: 0.5", "depth: 1.5"),
                 "needle-1", "filler.depth", "within [0, 1] (0 = start, 1 = end), got 1.5", id="depth-above-one"),
    pytest.param(NEEDLE.replace("depth: 0.5", "depth: -0.1"),
                 "needle-1", "filler.depth", "got -0.1", id="depth-below-zero"),
    pytest.param(NEEDLE.replace("chars: 2000, ", ""), "needle-1", "filler.chars", "missing required field",
                 id="filler-missing-chars"),
    pytest.param(NEEDLE.replace('    question: "What is the secret code?"\n', ""),
                 "needle-1", "question", "missing required field", id="needle-missing-question"),
    pytest.param(NEEDLE.replace('answer: "4711"', 'answer: "4712"'),
                 "needle-1", "answer", "'4712' does not occur in the needle", id="needle-without-answer"),
    pytest.param(CHAT.replace("    turns:\n", "    turns: []\n").split("      - user")[0],
                 "chat-1", "turns", "non-empty list of turns", id="empty-turns"),
    pytest.param(CHAT.replace('user: "Any discount?"', 'user: "  "'),
                 "chat-1", "turns[2].user", "non-empty string, got '  '", id="empty-user-text"),
    pytest.param(CHAT.replace('- user: "And the price?"\n        assistant:', "- assistant:"),
                 "chat-1", "turns[1].user", "missing required field", id="turn-without-user"),
    pytest.param(CHAT.replace('"Any discount?"\n', '"Any discount?"\n        expect: "5"\n'),
                 "chat-1", "turns[2].expect", "chat turns have no answer to check", id="expect-on-chat"),
    pytest.param(RECALL.replace("{fact: name}", "{fact: age}"),
                 "recall-1", "turns[2].expect", "fact 'age' is not in 'facts' (name)", id="recall-unknown-fact"),
    pytest.param(RECALL.replace("Hello, my name is Alexander.", "Hello there."),
                 "recall-1", "turns[2].expect", "'name' = 'Alexander' is not planted in an earlier user turn",
                 id="recall-fact-not-planted"),
    pytest.param(RECALL.replace('"Hello, my name is Alexander."', '"Hello there."')
                 .replace('"What is my name?"', '"By the way, my name is Alexander."')
                 .replace('"Tell me about rivers."', '"What is my name?"\n        expect: {fact: name}'),
                 "recall-1", "turns[1].expect", "not planted in an earlier user turn", id="recall-planted-too-late"),
    pytest.param(RECALL.replace("{fact: name}", "Alexander"),
                 "recall-1", "turns[2].expect", "expected {fact: <name from facts>}, got 'Alexander'",
                 id="recall-expect-not-fact"),
    pytest.param(RECALL.replace("    facts: {name: Alexander}\n", ""), "recall-1", "facts", "missing required field",
                 id="recall-missing-facts"),
    pytest.param(RECALL.replace('"What is my name?"\n', '"What is my name?"\n        assistant: "Alexander."\n'),
                 "recall-1", "turns[2].expect", "on a turn with a fixed assistant reply", id="expect-on-fixed-turn"),
    pytest.param(CHAT.replace('"What plans do you offer?"', '"Hi"\n        assistant: "Hello"')
                 .replace('"Any discount?"', '"Any discount?"\n        assistant: "No."'),
                 "chat-1", "turns", "nothing would be generated", id="no-generated-turn"),
    pytest.param(CHAT.replace("system: \"You are a sales", "system: 5\n    x_: \"You are a sales"),
                 "chat-1", "system", "non-empty string, got 5", id="system-wrong-type"),
]


@pytest.mark.parametrize("entry, scenario_id, field, words", INVALID)
def test_invalid_scenario_is_refused_naming_file_id_and_field(tmp_path, entry, scenario_id, field, words):
    path = scenarios_file(tmp_path, entry, name="bad.yaml")
    message = load_error(path)
    line = next((line for line in message.splitlines() if f"field '{field}'" in line), None)
    assert line is not None, message
    assert line.startswith(f"{path}: scenario '{scenario_id}': field '{field}': "), line
    assert words in line, line


def test_all_problems_are_collected_into_one_error(tmp_path):
    bad_arith = ARITHMETIC.replace("greedy: true", "greedy: false").replace("kl_max", "kl_maxx")
    first = scenarios_file(tmp_path, bad_arith, name="a.yaml")
    second = scenarios_file(tmp_path, NEEDLE.replace("depth: 0.5", "depth: 2"), name="b.yaml")
    with pytest.raises(ScenarioError) as info:
        load_scenarios([first, second])
    assert len(info.value.problems) == 3
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith("3 problems in scenario files:")


def test_duplicate_ids_across_files_name_both_files(tmp_path):
    first = scenarios_file(tmp_path, CHAT, name="a.yaml")
    second = scenarios_file(tmp_path, CHAT.replace("kind: chat", "kind: chat\n    tags: [again]"), name="b.yaml")
    message = load_error(first, second)
    assert f"{second}: scenario 'chat-1': field 'id': duplicate id 'chat-1', already defined in {first}" in message


def test_duplicate_ids_within_one_file(tmp_path):
    path = scenarios_file(tmp_path, CHAT, CHAT)
    assert f"{path}: scenario 'chat-1': field 'id': duplicate id 'chat-1'" in load_error(path)


@pytest.mark.parametrize("body, words", [
    ("scenarios:\n  - id: x\n    kind: [chat\n", "YAML syntax error at line"),
    ("scenarios:\n  - id: x\n    kind: chat\n    kind: recall\n", "duplicate key 'kind'"),
    ("", "expected a mapping with a 'scenarios' list"),
    ("scenarios: []\n", "field 'scenarios': expected a non-empty list"),
    ("version: 2\nscenarios:\n" + CHAT, "field 'version': unknown key"),
    ("defaults: {colour: red}\nscenarios:\n" + CHAT, "field 'defaults.colour': unknown key"),
    ("defaults: {generation: {greedy: false}}\nscenarios:\n" + CHAT, "field 'defaults.generation.greedy'"),
    ("scenarios:\n  - kind: chat\n    turns: [{user: hi}]\n", "scenarios[0]: field 'id': missing required field"),
    ("scenarios:\n  - id: two words\n    kind: chat\n    turns: [{user: hi}]\n", "field 'id': expected a non-empty"),
])
def test_invalid_file_is_refused_naming_the_file(tmp_path, body, words):
    path = write(tmp_path, body, name="bad.yaml")
    message = load_error(path)
    assert f"{path}: " in message and words in message, message


def test_missing_path_and_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    message = load_error(tmp_path / "nope.yaml", tmp_path / "empty")
    assert f"{tmp_path / 'nope.yaml'}: no such file or directory" in message
    assert f"{tmp_path / 'empty'}: no *.yaml or *.yml files" in message


def test_scenario_checks_itself_when_built_by_hand():
    with pytest.raises(ValueError, match="field 'kind'"):
        Scenario(id="x", kind="essay", turns=(Turn("hi"),))
    with pytest.raises(ValueError, match="field 'turns'"):
        Scenario(id="x", kind="chat", turns=())


@pytest.mark.parametrize("chars, seed", [(300, 1832813), (301, 5), (40, 2)])
def test_needle_at_the_end_follows_a_whole_sentence(chars, seed):
    filler = filler_text(chars, seed)
    text = insert_needle(filler, "The meeting is in room 768.", 1.0)
    head, _, _ = text.rpartition("The meeting")
    assert text.endswith("The meeting is in room 768.")
    assert head == "" or head.endswith(". "), head[-30:]  # never glued onto a cut word ("While liThe")
    assert head.strip() in filler


def test_needle_inside_the_filler_starts_a_sentence():
    filler = filler_text(800, 1563224)
    text = insert_needle(filler, "The magic word is Hoanan.", 0.13)
    before = text[:text.index("The magic word")]
    assert before.endswith(". ") and filler.startswith(before)
