"""Scenario sources: the files and directories a run names, YAML scenario files (`harness.scenarios.load`) and
JSONL task files (`harness.scenarios.tasks`) alike, loaded into one checked list with ids unique across them.
Every problem of every file is raised together as one `ScenarioError`."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from harness.scenarios import tasks
from harness.scenarios.load import Scenario, ScenarioError, _load_file


def find_scenario_files(paths: Sequence[str | Path]) -> tuple[list[Path], list[str]]:
    """Files named directly, plus every *.yaml / *.yml under named directories (sorted), deduplicated."""
    files: list[Path] = []
    problems: list[str] = []
    seen: set[Path] = set()
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
            if not found:
                problems.append(f"{path}: no *.yaml or *.yml files in this directory")
        elif path.is_file():
            found = [path]
        elif path.exists():  # a FIFO, socket or device: reading it could block for ever
            problems.append(f"{path}: not a regular file or directory (a scenario file must be a regular file)")
            found = []
        else:
            problems.append(f"{path}: no such file or directory")
            found = []
        for file in found:
            if file.resolve() not in seen:
                seen.add(file.resolve())
                files.append(file)
    return files, problems


def load_scenarios(paths: Sequence[str | Path]) -> list[Scenario]:
    """Load and validate scenario files or directories; raise one ScenarioError listing every problem."""
    files, problems = find_scenario_files(paths)
    scenarios: list[Scenario] = []
    first_seen: dict[str, str] = {}  # id -> file that defined it first
    for file in files:
        for scenario_id, scenario in _load_any(file, problems):
            where = f"{file}: scenario {scenario_id!r}"
            if scenario_id in first_seen:
                problems.append(f"{where}: field 'id': duplicate id {scenario_id!r}, "
                                f"already defined in {first_seen[scenario_id]}")
                continue
            first_seen[scenario_id] = str(file)
            if scenario is not None:
                scenarios.append(scenario)
    if problems:
        raise ScenarioError(problems)
    return scenarios


def _load_any(file: Path, problems: list[str]) -> list[tuple[str, Scenario | None]]:
    """A YAML scenario file, or a JSONL task file (harness/scenarios/tasks.py) named directly."""
    if tasks.is_task_file(file):
        return [(scenario.id, scenario) for scenario in tasks.load_task_file(file, problems)]
    return _load_file(file, problems)
