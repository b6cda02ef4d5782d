"""Limits a scenario file must keep before anything is built from it.

A hostile file can make a YAML loader hang or eat memory: aliases that expand to billions of nodes
("billion laughs"), tens of thousands of nested levels (the composer recurses), a file of tens of
megabytes. `check_yaml_bounds` streams the file's parse events (libyaml when present: no Python
recursion, memory bounded by the file) and refuses it at the first limit crossed, before a single
node is composed; the loader builds the document only from a file that passed.

The limits are far above any real scenario file (the largest bundled one, scenarios/canary/accuracy/
recall.yaml, is 39 KB, 7 levels deep and uses no aliases) and far below what hurts: a 2 MiB file
parses in well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

MAX_FILE_BYTES = 2 * 1024 * 1024    # 50x the largest bundled scenario file
MAX_DEPTH = 64                      # nested mappings/lists; a scenario needs 6
MAX_NODES = 200_000                 # nodes after alias expansion (recall.yaml: ~6,000)
MAX_SCALAR_CHARS = 8 * 1024 * 1024  # characters of all scalars after alias expansion
MAX_FILLER_CHARS = 1_000_000        # one long_context scenario's filler (~250k tokens of prose)
MAX_FILE_FILLER_CHARS = 16_000_000  # all filler of one file: 16 MB of generated text at most

_EventLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class YAMLBoundsError(ValueError):
    """The file crosses a limit; the message names the file, the field (where known) and the limit."""


@dataclass(slots=True)
class _Open:
    """One collection being parsed: where it is, and how many nodes / scalar characters it expands to."""

    anchor: str | None
    path: str | None  # None for the document root
    is_mapping: bool
    nodes: int = 1
    chars: int = 0
    at_key: bool = True  # mappings: the next child is a key
    key: str = "?"
    index: int = 0


def check_yaml_bounds(file: Path) -> None:
    """Raise YAMLBoundsError when `file` is too big, too deep or expands too far; yaml.YAMLError on bad syntax."""
    size = file.stat().st_size
    if size > MAX_FILE_BYTES:
        raise YAMLBoundsError(f"{file}: file is {size / 2**20:.1f} MiB; scenario files are limited to "
                              f"{MAX_FILE_BYTES // 2**20} MiB (harness/scenarios/bounds.py)")
    try:
        with open(file, "rb") as handle:
            _check_events(file, yaml.parse(handle, Loader=_EventLoader))
    except yaml.MarkedYAMLError as error:
        if _EventLoader is yaml.SafeLoader or "nesting depth" not in str(error.problem):
            raise
        # libyaml >= 0.2.5 stops at 1,000 open flow collections while scanning ahead, before our depth
        # check sees an event: the Python parser yields events one by one, so the limit below names the field
        with open(file, "rb") as handle:
            _check_events(file, yaml.parse(handle, Loader=yaml.SafeLoader))


def _check_events(file: Path, events) -> None:
    anchors: dict[str, tuple[int, int]] = {}  # anchor -> (nodes, chars) it expands to
    stack = [_Open(None, None, is_mapping=False)]
    total = _Open(None, None, is_mapping=False, nodes=0)  # the whole document, aliases expanded
    for event in events:
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            path, _ = _next_child(stack[-1])
            stack.append(_Open(event.anchor, path, is_mapping=isinstance(event, yaml.MappingStartEvent)))
            _count(file, total, 1, 0, path)
            if len(stack) - 1 > MAX_DEPTH:
                _fail(file, path, f"nested more than {MAX_DEPTH} levels deep")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            done = stack.pop()
            if done.anchor:
                anchors[done.anchor] = (done.nodes, done.chars)
            stack[-1].nodes += done.nodes  # already in `total`
            stack[-1].chars += done.chars
        elif isinstance(event, yaml.ScalarEvent):
            path, is_key = _next_child(stack[-1])
            if is_key:
                stack[-1].key = event.value[:60]
            if event.anchor:
                anchors[event.anchor] = (1, len(event.value))
            _add(file, stack, total, 1, len(event.value), path)
        elif isinstance(event, yaml.AliasEvent):
            path, _ = _next_child(stack[-1])
            nodes, chars = anchors.get(event.anchor, (1, 0))
            _add(file, stack, total, nodes, chars, path)


def _next_child(parent: _Open) -> tuple[str, bool]:
    """(field of the parent's next child, e.g. `scenarios[3].tags`; whether it is a mapping key)."""
    if parent.path is None:
        return "", False
    if parent.is_mapping:
        parent.at_key = not parent.at_key
        if not parent.at_key:
            return parent.path, True
        return f"{parent.path}.{parent.key}" if parent.path else parent.key, False
    parent.index += 1
    return f"{parent.path}[{parent.index - 1}]", False


def _add(file: Path, stack: list[_Open], total: _Open, nodes: int, chars: int, path: str) -> None:
    """Count a value (an alias: what it expands to) into its collection and the document's total."""
    stack[-1].nodes += nodes
    stack[-1].chars += chars
    _count(file, total, nodes, chars, path)


def _count(file: Path, total: _Open, nodes: int, chars: int, path: str) -> None:
    total.nodes += nodes
    total.chars += chars
    if total.nodes > MAX_NODES:
        _fail(file, path, f"expands to more than {MAX_NODES:,} YAML nodes (aliases included): "
                          "an alias bomb or a far too large file")
    if total.chars > MAX_SCALAR_CHARS:
        _fail(file, path, f"expands to more than {MAX_SCALAR_CHARS:,} characters of text (aliases included)")


def _fail(file: Path, path: str, message: str) -> None:
    field = f"field '{_top_field(path)}': " if path else ""
    raise YAMLBoundsError(f"{file}: {field}{message} (limits in harness/scenarios/bounds.py)")


def _top_field(path: str) -> str:
    return path if len(path) <= 80 else path[:77] + "..."
