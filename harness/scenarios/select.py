"""Pick scenarios by id, tag or kind, and models by label, as `harness run --select` / `--models` ask.

A selection is a list of terms; a scenario is kept when it matches any of them:
`tag:NAME`, `kind:NAME`, `id:GLOB`, or a bare GLOB matched against the id, the tags and the kind.
A term that matches nothing is an error naming what there is, so a typo never runs an empty or partial set.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from pathlib import Path

from harness.scenarios.load import Scenario

FIELDS = ("tag", "kind", "id")


def split_terms(specs: Sequence[str]) -> list[str]:
    """`["tag:recall,kind:chat", "id:canary-*"]` -> one term per item; empty items are an error."""
    terms = [term.strip() for spec in specs for term in spec.split(",")]
    if any(not term for term in terms):
        raise ValueError(f"--select {','.join(specs)!r}: an empty term; expected tag:NAME, kind:NAME, id:GLOB or GLOB")
    return terms


def term_matches(term: str, scenario: Scenario) -> bool:
    field, sep, pattern = term.partition(":")
    if not sep:
        field, pattern = "any", term
    if field not in FIELDS + ("any",):
        raise ValueError(f"--select {term!r}: unknown field {field!r}; expected one of {', '.join(FIELDS)} "
                         "(tag:NAME, kind:NAME, id:GLOB) or a bare GLOB")
    values = {"tag": scenario.tags, "kind": (scenario.kind,), "id": (scenario.id,),
              "any": (scenario.id, scenario.kind, *scenario.tags)}[field]
    return any(fnmatch.fnmatchcase(value, pattern) for value in values)


def select_scenarios(scenarios: Sequence[Scenario], specs: Sequence[str]) -> list[Scenario]:
    """The scenarios matching any term of `specs` (all of them when `specs` is empty), in their order."""
    if not specs:
        return list(scenarios)
    terms = split_terms(specs)
    unmatched = [term for term in terms if not any(term_matches(term, s) for s in scenarios)]
    if unmatched:
        tags = sorted({tag for s in scenarios for tag in s.tags})
        kinds = sorted({s.kind for s in scenarios})
        raise ValueError(f"--select: {', '.join(unmatched)} matched no scenario of the {len(scenarios)} loaded; "
                         f"kinds: {', '.join(kinds)}; tags: {', '.join(tags) or 'none'}; "
                         f"ids like {', '.join(s.id for s in scenarios[:3])}")
    return [s for s in scenarios if any(term_matches(term, s) for term in terms)]


def select_models(models: Sequence[Path], labels: Sequence[str], label_of=lambda d: Path(d).name) -> tuple[Path, ...]:
    """The model directories whose label (directory name) is one of `labels` (comma-separated allowed)."""
    if not labels:
        return tuple(models)
    wanted = [label.strip() for spec in labels for label in spec.split(",")]
    if not all(wanted):
        raise ValueError(f"--models {','.join(labels)!r}: an empty label; expected model labels (directory "
                         f"names), comma-separated, e.g. --models mla,hybrid")
    known = {label_of(m): m for m in models}
    missing = [label for label in wanted if label not in known]
    if missing:
        raise ValueError(f"--models: no model labelled {', '.join(missing)}; the models are "
                         f"{', '.join(known) or 'none'}")
    return tuple(m for m in models if label_of(m) in wanted)
