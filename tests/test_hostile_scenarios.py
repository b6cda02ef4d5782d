"""Hostile scenario files (issue 15, item 2): each is refused within 2 s and 200 MB (peak resident memory over the imports), with an error that
names the file and the field, and never a traceback. Each file is loaded in a child process whose
address space is capped at 3 GiB, so a loader that expands a bomb fails the test instead of the machine."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HOSTILE = Path(__file__).parent / "data" / "hostile"
REPO = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import json, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # torch's import maps ~1 GiB
    from harness.scenarios.load import ScenarioError
    from harness.scenarios.sources import load_scenarios
    before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # after imports (harness imports torch)
    started = time.perf_counter()
    try:
        load_scenarios([sys.argv[1]])
        outcome = "loaded"
    except ScenarioError as error:
        outcome = str(error)
    seconds = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before_mb
    print(json.dumps({"outcome": outcome, "seconds": seconds, "peak_mb": peak_mb}))
""")

LIMIT_SECONDS, LIMIT_MB = 2.0, 200  # the bound for any hostile file


def load_in_child(file: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(file)], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_refused(result: dict, file: Path, field: str) -> None:
    assert result["outcome"] != "loaded"
    assert str(file) in result["outcome"] and field in result["outcome"], result["outcome"]
    assert result["seconds"] < LIMIT_SECONDS, result
    assert result["peak_mb"] < LIMIT_MB, result


@pytest.mark.parametrize("name, field", [
    ("alias_bomb_tags.yaml", "field 'bomb"),            # anchors under an unknown key, expanded in tags
    ("alias_bomb_system.yaml", "field 'defaults.x"),
    ("alias_bomb_thresholds.yaml", "field 'scenarios[0].thresholds"),
    ("filler_chars_huge.yaml", "field 'filler.chars'"),
])
def test_hostile_files_in_tests_data_are_refused_quickly(name, field):
    file = HOSTILE / name
    assert_refused(load_in_child(file), file, field)


def test_deep_nesting_is_refused_without_recursion_error(tmp_path):
    file = tmp_path / "deep.yaml"
    file.write_text("scenarios:\n  - id: deep\n    kind: chat\n    tags: " + "[" * 50_000 + "]" * 50_000 + "\n")
    result = load_in_child(file)
    assert "RecursionError" not in result["outcome"]
    assert_refused(result, file, "field 'scenarios[0].tags")
    assert "nested more than" in result["outcome"]


def test_sixty_megabyte_file_is_refused_before_parsing(tmp_path):
    file = tmp_path / "huge.yaml"
    line = '      - user: "' + "x" * 100 + '"\n'
    with open(file, "w") as handle:
        handle.write("scenarios:\n  - id: huge\n    kind: chat\n    turns:\n")
        handle.writelines([line] * (60 * 2**20 // len(line)))
    result = load_in_child(file)
    assert_refused(result, file, "MiB")


def test_bounds_do_not_refuse_the_bundled_scenarios():
    from harness.scenarios.sources import load_scenarios

    assert len(load_scenarios([REPO / "scenarios"])) > 100


def test_anchors_and_aliases_within_bounds_still_load(tmp_path):
    from harness.scenarios.sources import load_scenarios

    file = tmp_path / "aliases.yaml"
    file.write_text(textwrap.dedent("""\
        defaults:
          tags: &common [canary, aliased]
        scenarios:
          - id: a
            kind: chat
            tags: *common
            turns: &chat [{user: "Hello there."}, {user: "And then?"}]
          - id: b
            kind: chat
            turns: *chat
    """))
    loaded = load_scenarios([file])
    assert [s.id for s in loaded] == ["a", "b"] and loaded[1].turns == loaded[0].turns
