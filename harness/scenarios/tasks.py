"""Task files: a user's own JSONL items become scenarios, without writing YAML.

One JSON object per line (blank lines and lines starting with `//` are skipped). The keys say what an item is:

| item | required keys | optional keys | becomes |
|---|---|---|---|
| question / answer (GSM8K style) | `question`, `answer` | `id`, `system`, `max_new_tokens`, `tags` | an `arithmetic` scenario: the answer is the number after GSM8K's `####` (`"... #### 72"`), or the whole answer when it is an integer (`72`, `"1,591"`) |
| needle | `needle`, `question`, `answer` | `chars` (4000), `depth` (0.5), `seed` (the line number), `id`, `system`, `max_new_tokens`, `tags` | a `long_context` scenario: the needle hidden in `chars` characters of filler at `depth` |

Answers are checked as the YAML kinds check them (scenarios/README.md): arithmetic by the last number in the
reply, needles by the answer as a whole word. Each scenario gets id `<file stem>-<line>` unless the item names
one, tags `[tasks, <file stem>]` plus its own, `thresholds: {answer_correct: 1}`, and for GSM8K items the system
prompt "Solve the problem. End your answer with the final number." and 256 new tokens unless the item says
otherwise (needles: no system prompt, 32 tokens).

Every item is compiled by the YAML loader's own checks (`harness.scenarios.load`), so the scenarios, their
content hashes and their errors are those of the same scenario written in YAML; a problem names the file, the
line and the field: `tasks.jsonl:12: field 'answer': ...`. All problems are raised together (`ScenarioError`).
`write_yaml` writes them as a scenario file (`harness scenarios from-jsonl FILE --out DIR`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from harness.files import UnreadableFile, read_bounded
from harness.scenarios import bounds
from harness.scenarios.load import Scenario, ScenarioError, _compile, _Where

SUFFIXES = (".jsonl",)
ARITHMETIC_SYSTEM = "Solve the problem. End your answer with the final number."
ARITHMETIC_TOKENS = 256  # GSM8K solutions run to ~100-200 tokens before the number
NEEDLE_TOKENS = 32
NEEDLE_DEFAULTS = {"chars": 4000, "depth": 0.5}
COMMON_OPTIONAL = ("id", "system", "max_new_tokens", "tags")
SHAPES = {
    "question/answer": (("question", "answer"), COMMON_OPTIONAL),
    "needle": (("needle", "question", "answer"), COMMON_OPTIONAL + ("chars", "depth", "seed")),
}
GSM8K_FINAL = re.compile(r"####\s*(-?[\d,]+(?:\.0+)?)\s*$")
INTEGER = re.compile(r"-?\d{1,3}(?:,\d{3})+|-?\d+")


def is_task_file(path: str | Path) -> bool:
    return Path(path).suffix in SUFFIXES


def load_task_file(file: str | Path, problems: list[str] | None = None) -> list[Scenario]:
    """The scenarios of one JSONL task file. With `problems`, problems are appended there (and the valid items'
    scenarios returned); without, they are raised as one ScenarioError."""
    return [scenario for _, scenario in _compiled(Path(file), problems)]


def _compiled(file: Path, problems: list[str] | None) -> list[tuple[dict, Scenario]]:
    collected: list[str] = [] if problems is None else problems
    before = len(collected)
    found = []
    filler_left = bounds.MAX_FILE_FILLER_CHARS
    first_line: dict[str, int] = {}  # id -> the line that gave it first
    for line_no, item in _items(file, collected):
        raw = to_raw(item, file, line_no, _Where(f"{file}:{line_no}", collected))
        if raw is None:
            continue
        chars = raw.get("filler", {}).get("chars")
        filler_left -= chars if isinstance(chars, int) and 0 < chars <= bounds.MAX_FILLER_CHARS else 0
        if filler_left < 0:  # checked before the text is generated, as for a YAML file
            collected.append(f"{file}:{line_no}: field 'chars': the file's needle filler adds up to more than "
                             f"{bounds.MAX_FILE_FILLER_CHARS:,} characters; split the file")
            continue
        if (duplicate := _duplicate_id(raw["id"], line_no, first_line)) is not None:
            collected.append(f"{file}:{line_no}: field 'id': {duplicate}")
            continue
        scenario = _compile(dict(raw), raw["id"], str(file), _Where(f"{file}:{line_no}: scenario {raw['id']!r}",
                                                                    collected))
        if scenario is not None:
            found.append((raw, scenario))
    if problems is None and len(collected) > before:
        raise ScenarioError(collected)
    return found


def _duplicate_id(item_id: Any, line_no: int, first_line: dict[str, int]) -> str | None:
    """Why `item_id` is refused as one an earlier line gave (the loader, and so `--tasks`, refuses it), or None;
    records the line that gave it first."""
    if not isinstance(item_id, str):
        return None  # a wrong type: the loader names it
    if item_id in first_line:
        return f"{item_id!r} is also the id of line {first_line[item_id]}; ids must be unique"
    first_line[item_id] = line_no
    return None


def _items(file: Path, problems: list[str]):
    try:
        text = read_bounded(file, bounds.MAX_FILE_BYTES, "task file").decode("utf-8")
    except UnreadableFile as error:
        problems.append(f"{error} (limits in harness/scenarios/bounds.py)")
        return
    except (OSError, UnicodeDecodeError) as error:
        problems.append(f"{file}: cannot read file: {error}")
        return
    found = False
    for line_no, line in enumerate(text.split("\n"), start=1):  # JSON Lines ends a line at \n only (not U+2028)
        if not line.strip() or line.lstrip().startswith("//"):
            continue
        found = True
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            problems.append(f"{file}:{line_no}: not JSON: {error.msg} at column {error.colno}")
            continue
        except RecursionError:
            problems.append(f"{file}:{line_no}: nested too deep for the JSON parser")
            continue
        if not isinstance(item, dict):
            problems.append(f"{file}:{line_no}: expected a JSON object, got {type(item).__name__}")
            continue
        yield line_no, item
    if not found:
        problems.append(f"{file}: no task items (one JSON object per line)")


def to_raw(item: dict[str, Any], file: Path, line_no: int, where: _Where) -> dict | None:
    """The YAML-shaped scenario of one item, or None (problems reported to `where`)."""
    shape = "needle" if "needle" in item else "question/answer"
    required, optional = SHAPES[shape]
    missing = [key for key in required if key not in item]
    for key in missing:
        where.error(key, f"missing required field for a {shape} item (keys: {', '.join(required)})")
    unknown = sorted(set(item) - set(required) - set(optional))
    for key in unknown:
        where.error(key, f"unknown key for a {shape} item; allowed: {', '.join(required + optional)}")
    if missing or unknown:
        return None
    stem = re.sub(r"\s+", "_", file.stem)
    raw: dict[str, Any] = {"id": item.get("id", f"{stem}-{line_no}"), "thresholds": {"answer_correct": 1}}
    tags = item.get("tags", [])
    raw["tags"] = ["tasks", stem, *tags] if isinstance(tags, list) else tags  # a wrong type: the loader names it
    if shape == "needle":
        raw.update(kind="long_context", needle=item["needle"], question=item["question"], answer=item["answer"],
                   filler={"chars": item.get("chars", NEEDLE_DEFAULTS["chars"]),
                           "depth": item.get("depth", NEEDLE_DEFAULTS["depth"]), "seed": item.get("seed", line_no)},
                   generation={"max_new_tokens": item.get("max_new_tokens", NEEDLE_TOKENS)})
    else:
        answer = final_answer(item["answer"])
        if answer is None:
            where.error("answer", f"no integer answer: expected an integer or GSM8K's '#### N' at the end, got "
                                  f"{_short(item['answer'])}")
            return None
        raw.update(kind="arithmetic", prompt=item["question"], answer=answer,
                   system=item.get("system", ARITHMETIC_SYSTEM),
                   generation={"max_new_tokens": item.get("max_new_tokens", ARITHMETIC_TOKENS)})
    if "system" in item and shape == "needle":
        raw["system"] = item["system"]
    return raw


def final_answer(answer: Any) -> str | None:
    """'... #### 1,591' -> '1591'; 72 / '72' / '-4' -> the integer as text; anything else None."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return str(answer)
    if isinstance(answer, float):
        return str(int(answer)) if answer.is_integer() else None
    if not isinstance(answer, str):
        return None
    text = answer.strip()
    match = GSM8K_FINAL.search(text)
    if match:
        text = match.group(1)
    text = re.sub(r"\.0+$", "", text)
    if INTEGER.fullmatch(text):
        return text.replace(",", "")
    return None


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


def to_yaml(raws: list[dict], source: str) -> str:
    """A scenario file (scenarios/README.md's format) holding the items' scenarios, loadable by `load_scenarios`."""
    header = f"# Generated from {source} by `harness scenarios from-jsonl`.\n"
    return header + yaml.safe_dump({"scenarios": raws}, sort_keys=False, allow_unicode=True, width=120)


def write_yaml(file: str | Path, out_dir: str | Path) -> tuple[Path, int]:
    """`harness scenarios from-jsonl FILE --out DIR`: (DIR/<stem>.yaml, scenarios written); raises ScenarioError
    listing every bad item (nothing is written then)."""
    raws = [raw for raw, _ in _compiled(Path(file), None)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{Path(file).stem}.yaml"
    target.write_text(to_yaml(raws, str(file)), encoding="utf-8")
    return target, len(raws)
