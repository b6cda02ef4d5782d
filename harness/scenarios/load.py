"""Scenario files: load, validate and compile them into the turns the runner replays.

The YAML format is fixed in docs/CONTRACTS.md and documented for authors in scenarios/README.md.
A file is checked completely before anything is returned: all problems are collected and raised together as one
`ScenarioError`, each line naming the file, the scenario, the field and the offending value. Files and directories
named on the command line, YAML and JSONL task files alike, are loaded by `harness.scenarios.sources`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import hashlib
import json
import math
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from harness.records import METRIC_DIRECTIONS
from harness.scenarios import bounds
from harness.scenarios.filler import filler_text, insert_needle

KINDS = ("chat", "arithmetic", "recall", "long_context")
DEFAULT_MAX_NEW_TOKENS = 64
# A reply budget no model can use: 1,048,576 = 2^20 tokens, above the context of every model the harness
# has replayed (the bundled canaries: 4,096; Llama 3.1 / Qwen2.5: 131,072). Each model's own context is
# checked again before a run (harness.run_inputs.scenario_budget_problems), as `harness serve` checks it.
MAX_NEW_TOKENS_LIMIT = 1 << 20
DEFAULT_FILLER_SEED = 0

FILE_KEYS = ("defaults", "scenarios")
COMMON_KEYS = ("id", "kind", "tags", "system", "generation", "thresholds", "rules")
KIND_KEYS = {
    "chat": ("turns",),
    "arithmetic": ("turns", "prompt", "answer"),
    "recall": ("turns", "facts"),
    "long_context": ("needle", "question", "answer", "filler"),
}
DEFAULTS_KEYS = ("kind", "tags", "system", "generation", "thresholds", "rules", "filler")
TURN_KEYS = ("user", "assistant", "expect")
GENERATION_KEYS = ("max_new_tokens", "greedy")
FILLER_KEYS = ("chars", "depth", "seed")
RULE_TYPES = {"ends_with": str, "starts_with": str, "max_sentences": int}

INTEGER_ANSWER = re.compile(r"-?\d+")


class ScenarioError(ValueError):
    """Every problem found in the loaded scenario files, one `file: scenario: field: what` per line."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        noun = "problem" if len(self.problems) == 1 else "problems"
        super().__init__(f"{len(self.problems)} {noun} in scenario files:\n" + "\n".join(self.problems))


@dataclass(frozen=True, slots=True)
class Turn:
    user: str
    assistant: str | None = None  # fixed reply: replayed as history, never generated
    expect: str | None = None     # answer the generated reply must contain (see harness.scenarios.checks)


@dataclass(frozen=True, slots=True)
class Scenario:
    """One compiled scenario. `content_hash` covers what is replayed and judged, not id/source/tags,
    so a renamed file or id still pairs with its earlier runs."""

    id: str
    kind: str  # chat | arithmetic | recall | long_context
    turns: tuple[Turn, ...]
    system: str | None = None
    tags: tuple[str, ...] = ()
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    # metric -> bound, direction from METRIC_DIRECTIONS; dicts stay out of hash(scenario)
    thresholds: dict[str, float] = field(default_factory=dict, hash=False)
    rules: dict[str, object] = field(default_factory=dict, hash=False)  # ends_with | starts_with | max_sentences
    source: str = ""        # the file it came from
    content_hash: str = ""  # computed when left empty

    def __post_init__(self) -> None:
        where = f"{self.source or '<no file>'}: scenario {self.id!r}"
        if self.kind not in KINDS:
            raise ValueError(f"{where}: field 'kind': unknown kind {self.kind!r}; expected one of {KINDS}")
        if not self.turns:
            raise ValueError(f"{where}: field 'turns': no turns")
        if self.max_new_tokens <= 0:
            raise ValueError(f"{where}: field 'generation.max_new_tokens': must be > 0, got {self.max_new_tokens}")
        if not self.content_hash:
            object.__setattr__(self, "content_hash", scenario_hash(self))


def scenario_hash(scenario: Scenario) -> str:
    """sha256 of the canonical JSON of the compiled scenario without id, source and tags."""
    payload = dataclasses.asdict(scenario)
    for name in ("id", "source", "tags", "content_hash"):
        payload.pop(name)
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------------------
# Problem collection


@dataclass(slots=True)
class _Where:
    """Where problems are reported: 'file: scenario 'id'' plus the list they are appended to."""

    label: str
    problems: list[str]
    count: int = 0

    def error(self, field_name: str, message: str) -> None:
        self.count += 1
        self.problems.append(f"{self.label}: field '{field_name}': {message}")


_SHORT_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_SHORT_REPR.maxlevel, _SHORT_REPR.maxdict, _SHORT_REPR.maxlist = 3, 6, 6
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 70


def _show(value: Any) -> str:
    """A value for an error message: bounded before it is built (a value may be an alias-expanded graph)."""
    text = _SHORT_REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _type_name(value: Any) -> str:
    return {dict: "mapping", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__)


# ---------------------------------------------------------------------------------------------
# YAML


class _StrictLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's parser when present
    """SafeLoader that refuses a key repeated in one mapping (YAML would keep the last silently)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, collections.abc.Hashable) and key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark)
        if isinstance(key, collections.abc.Hashable):
            seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(file: Path, problems: list[str]) -> Any:
    try:
        bounds.check_yaml_bounds(file)  # size, depth and alias expansion, before a node is built
        return yaml.load(file.read_text(encoding="utf-8"), Loader=_StrictLoader)
    except bounds.YAMLBoundsError as exc:
        problems.append(str(exc))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problems.append(f"{file}: YAML syntax error{at}: {exc.problem}")
    except yaml.YAMLError as exc:
        problems.append(f"{file}: YAML syntax error: {exc}")
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(f"{file}: cannot read file: {exc}")
    return None


# ---------------------------------------------------------------------------------------------
# File level


def _load_file(file: Path, problems: list[str]) -> list[tuple[str, Scenario | None]]:
    """(id, scenario or None when invalid) for every scenario with a usable id."""
    before = len(problems)
    document = _read_yaml(file, problems)
    if len(problems) > before:
        return []
    where = _Where(str(file), problems)
    if not isinstance(document, dict):
        where.error("scenarios", f"expected a mapping with a 'scenarios' list, got {_type_name(document)}")
        return []
    _check_keys(document, FILE_KEYS, "", where)
    defaults = _check_defaults(document.get("defaults", {}), where)
    entries = document.get("scenarios")
    if not isinstance(entries, list) or not entries:
        where.error("scenarios", f"expected a non-empty list of scenarios, got {_show(entries)}")
        return []
    loaded = []
    filler_left = bounds.MAX_FILE_FILLER_CHARS
    for index, raw in enumerate(entries):
        scenario_id = _scenario_id(raw, index, where)
        if scenario_id is None:
            continue
        scenario_where = _Where(f"{file}: scenario {scenario_id!r}", problems)
        merged = _merge_defaults(defaults, raw)
        filler_left -= _filler_chars(merged)
        if filler_left < 0:  # checked before the text is generated
            scenario_where.error("filler.chars", f"the file's long_context filler adds up to more than "
                                                 f"{bounds.MAX_FILE_FILLER_CHARS:,} characters; split it")
            loaded.append((scenario_id, None))
            continue
        loaded.append((scenario_id, _compile(merged, scenario_id, str(file), scenario_where)))
    return loaded


def _filler_chars(merged: dict) -> int:
    filler = merged.get("filler") if merged.get("kind") == "long_context" else None
    chars = filler.get("chars") if isinstance(filler, dict) else None
    return chars if isinstance(chars, int) and 0 < chars <= bounds.MAX_FILLER_CHARS else 0


def _scenario_id(raw: Any, index: int, file_where: _Where) -> str | None:
    where = _Where(f"{file_where.label}: scenarios[{index}]", file_where.problems)
    if not isinstance(raw, dict):
        where.error("scenarios", f"expected a mapping, got {_show(raw)}")
        return None
    if "id" not in raw:
        where.error("id", "missing required field")
        return None
    scenario_id = raw["id"]
    if not isinstance(scenario_id, str) or not scenario_id or re.search(r"\s", scenario_id):
        where.error("id", f"expected a non-empty string without whitespace, got {_show(scenario_id)}")
        return None
    return scenario_id


def _check_defaults(raw: Any, where: _Where) -> dict:
    """Validate the file's defaults; keep only the keys that passed, so each problem is reported once."""
    if not isinstance(raw, dict):
        where.error("defaults", f"expected a mapping, got {_show(raw)}")
        return {}
    _check_keys(raw, DEFAULTS_KEYS, "defaults", where)
    checks = {
        "kind": lambda v, f: _check_kind(v, f, where),
        "tags": lambda v, f: _check_tags(v, f, where),
        "system": lambda v, f: _check_text(v, f, where),
        "generation": lambda v, f: _check_generation(v, f, where),
        "thresholds": lambda v, f: _check_thresholds(v, f, where),
        "rules": lambda v, f: _check_rules(v, f, where),
        "filler": lambda v, f: _check_filler(v, f, where, require=False),
    }
    kept = {}
    for key, check in checks.items():
        if key in raw:
            before = where.count
            check(raw[key], f"defaults.{key}")
            if where.count == before:
                kept[key] = raw[key]
    return kept


def _merge_defaults(defaults: dict, raw: dict) -> dict:
    """Scenario values win; mappings merge key by key; tags are the union (defaults first)."""
    merged = dict(raw)
    kind = raw.get("kind", defaults.get("kind"))
    for key, value in defaults.items():
        if key == "filler" and kind != "long_context":
            continue
        if key not in raw:
            merged[key] = value
        elif key == "tags" and isinstance(raw[key], list) and all(isinstance(t, str) for t in raw[key]):
            # Malformed scenario tags stay as written, for _check_tags to name them.
            merged[key] = list(dict.fromkeys([*value, *raw[key]]))
        elif isinstance(value, dict) and isinstance(raw[key], dict):
            merged[key] = {**value, **raw[key]}
    return merged


# ---------------------------------------------------------------------------------------------
# Scenario level


def _compile(raw: dict, scenario_id: str, source: str, where: _Where) -> Scenario | None:
    kind = _check_kind(raw.get("kind"), "kind", where) if "kind" in raw else None
    if "kind" not in raw:
        where.error("kind", f"missing required field; expected one of {', '.join(KINDS)}")
    allowed = COMMON_KEYS + (KIND_KEYS[kind] if kind else tuple(k for ks in KIND_KEYS.values() for k in ks))
    _check_keys(raw, allowed, "", where, kind=kind)
    system = _check_text(raw["system"], "system", where) if raw.get("system") is not None else None
    tags = _check_tags(raw.get("tags", []), "tags", where)
    max_new_tokens = _check_generation(raw.get("generation", {}), "generation", where)
    thresholds = _check_thresholds(raw.get("thresholds", {}), "thresholds", where)
    rules = _check_rules(raw.get("rules", {}), "rules", where)
    turns = _COMPILE_TURNS[kind](raw, where) if kind else None
    if where.count:
        return None
    return Scenario(id=scenario_id, kind=kind, turns=turns, system=system, tags=tags,
                    max_new_tokens=max_new_tokens, thresholds=thresholds, rules=rules, source=source)


def _check_keys(raw: dict, allowed: Sequence[str], prefix: str, where: _Where, kind: str | None = None) -> None:
    for key in raw:
        if key in allowed:
            continue
        owners = [k for k, keys in KIND_KEYS.items() if key in keys]
        name = f"{prefix}.{key}" if prefix else str(key)
        if kind and owners:
            where.error(name, f"not used by kind {kind!r} (only by {', '.join(owners)})")
        else:
            where.error(name, f"unknown key {_show(key)}; expected one of {', '.join(allowed)}")


def _check_kind(value: Any, name: str, where: _Where) -> str | None:
    if value not in KINDS:
        where.error(name, f"unknown kind {_show(value)}; expected one of {', '.join(KINDS)}")
        return None
    return value


def _check_text(value: Any, name: str, where: _Where) -> str | None:
    if not isinstance(value, str) or not value.strip():
        where.error(name, f"expected a non-empty string, got {_show(value)}")
        return None
    return value


def _check_answer_text(value: Any, name: str, where: _Where) -> str | None:
    """An answer may be written as a YAML integer (`answer: 68`); it is compared as text."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return _check_text(value, name, where)


def _check_tags(value: Any, name: str, where: _Where) -> tuple[str, ...]:
    if not isinstance(value, list):
        where.error(name, f"expected a list of strings, got {_show(value)}")
        return ()
    before = where.count
    for i, tag in enumerate(value):
        if not isinstance(tag, str) or not tag or re.search(r"\s", tag):
            where.error(f"{name}[{i}]", f"expected a non-empty string without whitespace, got {_show(tag)}")
    return tuple(dict.fromkeys(value)) if where.count == before else ()


def _check_positive_int(value: Any, name: str, where: _Where) -> int | None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        where.error(name, f"expected a positive integer, got {_show(value)}")
        return None
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_generation(value: Any, name: str, where: _Where) -> int:
    if not isinstance(value, dict):
        where.error(name, f"expected a mapping, got {_show(value)}")
        return DEFAULT_MAX_NEW_TOKENS
    _check_keys(value, GENERATION_KEYS, name, where)
    if value.get("greedy", True) is not True:
        where.error(f"{name}.greedy",
                    f"only greedy decoding is supported (must be true), got {_show(value['greedy'])}")
    if "max_new_tokens" not in value:
        return DEFAULT_MAX_NEW_TOKENS
    budget = _check_positive_int(value["max_new_tokens"], f"{name}.max_new_tokens", where)
    if budget is not None and budget > MAX_NEW_TOKENS_LIMIT:
        where.error(f"{name}.max_new_tokens", f"{budget} is above the limit of {MAX_NEW_TOKENS_LIMIT} tokens "
                                              f"(longer than any model's context)")
        return DEFAULT_MAX_NEW_TOKENS
    return budget or DEFAULT_MAX_NEW_TOKENS


def _check_thresholds(value: Any, name: str, where: _Where) -> dict[str, float]:
    if not isinstance(value, dict):
        where.error(name, f"expected a mapping of metric: bound, got {_show(value)}")
        return {}
    thresholds = {}
    for metric, bound in value.items():
        if metric not in METRIC_DIRECTIONS:
            where.error(f"{name}.{metric}", f"unknown metric {_show(metric)}; "
                                            f"expected one of {', '.join(METRIC_DIRECTIONS)}")
        elif not _is_number(bound):
            where.error(f"{name}.{metric}", f"expected a finite number, got {_show(bound)}")
        else:
            thresholds[metric] = float(bound)
    return thresholds


def _check_rules(value: Any, name: str, where: _Where) -> dict[str, object]:
    if not isinstance(value, dict):
        where.error(name, f"expected a mapping, got {_show(value)}")
        return {}
    _check_keys(value, tuple(RULE_TYPES), name, where)
    rules: dict[str, object] = {}
    for rule, expected_type in RULE_TYPES.items():
        if rule not in value:
            continue
        if expected_type is int:
            rules[rule] = _check_positive_int(value[rule], f"{name}.{rule}", where)
        else:
            rules[rule] = _check_text(value[rule], f"{name}.{rule}", where)
    return rules


def _check_filler(value: Any, name: str, where: _Where, require: bool = True) -> tuple[int, float, int] | None:
    if not isinstance(value, dict):
        where.error(name, f"expected a mapping with chars, depth, seed, got {_show(value)}")
        return None
    _check_keys(value, FILLER_KEYS, name, where)
    before = where.count
    for key in ("chars", "depth"):
        if require and key not in value:
            where.error(f"{name}.{key}", "missing required field")
    chars = _check_positive_int(value["chars"], f"{name}.chars", where) if "chars" in value else None
    if chars is not None and chars > bounds.MAX_FILLER_CHARS:
        where.error(f"{name}.chars", f"at most {bounds.MAX_FILLER_CHARS:,} characters (~250k tokens), got {chars:,}")
    depth = value.get("depth")
    if "depth" in value and (not _is_number(depth) or not 0.0 <= depth <= 1.0):
        where.error(f"{name}.depth", f"expected a number within [0, 1] (0 = start, 1 = end), got {_show(depth)}")
    seed = value.get("seed", DEFAULT_FILLER_SEED)
    if not isinstance(seed, int) or isinstance(seed, bool):
        where.error(f"{name}.seed", f"expected an integer, got {_show(seed)}")
    return (chars, float(depth), seed) if where.count == before and require else None


# ---------------------------------------------------------------------------------------------
# Turns, per kind


def _check_turn_list(raw: dict, where: _Where) -> list[dict] | None:
    if "turns" not in raw:
        where.error("turns", "missing required field")
        return None
    value = raw["turns"]
    if not isinstance(value, list) or not value:
        where.error("turns", f"expected a non-empty list of turns, got {_show(value)}")
        return None
    if not all(isinstance(turn, dict) for turn in value):
        for i, turn in enumerate(value):
            if not isinstance(turn, dict):
                where.error(f"turns[{i}]", f"expected a mapping with 'user', got {_show(turn)}")
        return None
    for i, turn in enumerate(value):
        _check_keys(turn, TURN_KEYS, f"turns[{i}]", where)
        if "user" not in turn:
            where.error(f"turns[{i}].user", "missing required field")
        else:
            _check_text(turn["user"], f"turns[{i}].user", where)
        if turn.get("assistant") is not None:
            _check_text(turn["assistant"], f"turns[{i}].assistant", where)
            if "expect" in turn:
                where.error(f"turns[{i}].expect", f"{_show(turn['expect'])} on a turn with a fixed assistant "
                                                  "reply: nothing is generated there to check")
    if not any(turn.get("assistant") is None for turn in value):
        where.error("turns", "every turn has a fixed assistant reply: nothing would be generated")
    return value


def _build_turns(turns: list[dict], expects: dict[int, str]) -> tuple[Turn, ...]:
    return tuple(Turn(user=t.get("user"), assistant=t.get("assistant"), expect=expects.get(i))
                 for i, t in enumerate(turns))


def _chat_turns(raw: dict, where: _Where) -> tuple[Turn, ...] | None:
    turns = _check_turn_list(raw, where)
    for i, turn in enumerate(turns or []):
        if "expect" in turn and turn.get("assistant") is None:
            where.error(f"turns[{i}].expect", f"chat turns have no answer to check (use scenario 'rules', "
                                              f"or kind arithmetic / recall), got {_show(turn['expect'])}")
    return _build_turns(turns, {}) if turns else None


def _arithmetic_turns(raw: dict, where: _Where) -> tuple[Turn, ...] | None:
    if "turns" in raw:
        for key in ("prompt", "answer"):
            if key in raw:
                where.error(key, "give either 'prompt' + 'answer' or 'turns', not both")
        turns = _check_turn_list(raw, where)
        expects = {i: t["expect"] for i, t in enumerate(turns or []) if "expect" in t and t.get("assistant") is None}
        fields = {i: f"turns[{i}].expect" for i in expects}
    else:
        for key in ("prompt", "answer"):
            if key not in raw:
                where.error(key, "missing required field (or give 'turns')")
        if "prompt" in raw:
            _check_text(raw["prompt"], "prompt", where)
        turns = [{"user": raw.get("prompt")}]
        expects = {0: raw["answer"]} if "answer" in raw else {}
        fields = {0: "answer"}
    checked = {i: _check_integer_answer(expects[i], fields[i], where) for i in expects}
    if turns and not expects and "turns" in raw:
        where.error("turns", "no turn has an 'expect': an arithmetic scenario needs an answer to check")
    return _build_turns(turns, checked) if turns else None


def _check_integer_answer(value: Any, name: str, where: _Where) -> str | None:
    text = _check_answer_text(value, name, where)
    if text is not None and not INTEGER_ANSWER.fullmatch(text.strip()):
        where.error(name, f"an arithmetic answer must be an integer, got {_show(value)}")
        return None
    return text.strip() if text is not None else None


def _recall_turns(raw: dict, where: _Where) -> tuple[Turn, ...] | None:
    facts = _check_facts(raw, where)
    turns = _check_turn_list(raw, where)
    if not turns:
        return None
    expects = {}
    for i, turn in enumerate(turns):
        if "expect" in turn and turn.get("assistant") is None:
            value = _resolve_fact(turn["expect"], facts, turns[:i], f"turns[{i}].expect", where)
            expects[i] = value
    if not expects:
        where.error("turns", "no turn has an 'expect: {fact: ...}': a recall scenario must ask about a fact")
    return _build_turns(turns, expects)


def _check_facts(raw: dict, where: _Where) -> dict[str, str]:
    if "facts" not in raw:
        where.error("facts", "missing required field (a mapping of fact name: value)")
        return {}
    value = raw["facts"]
    if not isinstance(value, dict) or not value:
        where.error("facts", f"expected a non-empty mapping of fact name: value, got {_show(value)}")
        return {}
    facts = {}
    for key, fact in value.items():
        text = _check_answer_text(fact, f"facts.{key}", where)
        if text is not None:
            facts[str(key)] = text
    return facts


def _resolve_fact(expect: Any, facts: dict[str, str], earlier: list[dict], name: str, where: _Where) -> str | None:
    if not isinstance(expect, dict) or set(expect) != {"fact"}:
        where.error(name, f"expected {{fact: <name from facts>}}, got {_show(expect)}")
        return None
    key = expect["fact"]
    if not isinstance(key, str) or key not in facts:
        where.error(name, f"fact {_show(key)} is not in 'facts' ({', '.join(facts) or 'none'})")
        return None
    value = facts[key]
    planted = any(isinstance(t.get("user"), str) and contains_word(t["user"], value) for t in earlier)
    if not planted:
        where.error(name, f"fact {key!r} = {value!r} is not planted in an earlier user turn")
        return None
    return value


def _long_context_turns(raw: dict, where: _Where) -> tuple[Turn, ...] | None:
    for key in ("needle", "question", "answer", "filler"):
        if key not in raw:
            where.error(key, "missing required field")
    needle = _check_text(raw["needle"], "needle", where) if "needle" in raw else None
    question = _check_text(raw["question"], "question", where) if "question" in raw else None
    answer = _check_answer_text(raw["answer"], "answer", where) if "answer" in raw else None
    filler = _check_filler(raw["filler"], "filler", where) if "filler" in raw else None
    if needle and answer and not contains_word(needle, answer):
        where.error("answer", f"{answer!r} does not occur in the needle {needle!r}: the question is unanswerable")
    if None in (needle, question, answer, filler):
        return None
    chars, depth, seed = filler
    text = insert_needle(filler_text(chars, seed), needle, depth) + "\n" + question
    return (Turn(user=text, expect=answer),)


_COMPILE_TURNS = {
    "chat": _chat_turns,
    "arithmetic": _arithmetic_turns,
    "recall": _recall_turns,
    "long_context": _long_context_turns,
}


def contains_word(text: str, word: str) -> bool:
    """`word` occurs in `text` as a whole word (no letter, digit or _ on either side), ignoring case."""
    return re.search(rf"(?<!\w){re.escape(word.strip())}(?!\w)", text, re.IGNORECASE) is not None
