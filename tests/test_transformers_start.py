"""transformers' two start-up scans, remembered between `harness run` processes (harness/transformers_start.py).

A remembered answer must be the answer: equal to the scan's own, and computed again when a file it is read from is
added or changed. The scans are counted through stand-ins of the scanning functions (the tests can fail: a stale
answer, or a scan run again where nothing changed); one test imports the real transformers in a process of its own
with the caches in place and compares them with its own scans.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from harness import transformers_start


def scanner(tmp_path: Path):
    """A module holding a counting `define_import_structure` (the names of the .py files under a folder)."""
    module = types.ModuleType("stand_in_import_utils")
    module.__file__ = str(tmp_path / "import_utils.py")
    Path(module.__file__).write_text("# the scanner's own source: part of the key\n")
    calls = []

    def define_import_structure(module_path, prefix=None):
        calls.append(str(module_path))
        folder = Path(module_path)
        folder = folder.parent if folder.is_file() else folder
        return {frozenset(): {f"{prefix or ''}{p.relative_to(folder)}": {p.read_text()} for p in folder.rglob("*.py")}}

    module.define_import_structure = define_import_structure
    return module, calls


def test_the_import_structure_is_scanned_once_and_again_after_any_change(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    tree = tmp_path / "models"
    (tree / "llama").mkdir(parents=True)
    (tree / "llama" / "modeling_llama.py").write_text("A")
    (tree / "__init__.py").write_text("")
    module, calls = scanner(tmp_path)
    transformers_start.remember_import_structure(module, cache)
    scan = module.define_import_structure

    first = scan(tree, prefix="models")
    assert scan(tree, prefix="models") == first and len(calls) == 1  # the second from the cache
    assert scan(tree / "__init__.py") != first and len(calls) == 2  # other arguments: a key of their own
    (tree / "llama" / "modeling_llama.py").write_text("BB")  # an edit (its size and time change)
    assert scan(tree, prefix="models")[frozenset()]["modelsllama/modeling_llama.py"] == {"BB"}
    assert len(calls) == 3
    (tree / "gemma").mkdir()  # a new folder, no file yet: transformers lists it
    scan(tree, prefix="models")
    assert len(calls) == 4
    (tree / "gemma" / "modeling_gemma.py").write_text("C")
    assert "modelsgemma/modeling_gemma.py" in scan(tree, prefix="models")[frozenset()] and len(calls) == 5
    Path(module.__file__).write_text("# another transformers: the scanner changed\n")
    scan(tree, prefix="models")
    assert len(calls) == 6
    (tree / "README.md").write_text("not read by the scan")
    scan(tree, prefix="models")
    assert len(calls) == 6


def test_an_unreadable_or_unwritable_cache_gives_the_scans_own_answer(tmp_path):
    tree = tmp_path / "models"
    tree.mkdir()
    (tree / "a.py").write_text("A")
    module, calls = scanner(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    transformers_start.remember_import_structure(module, cache)
    answer = module.define_import_structure(tree)
    for kept in cache.iterdir():
        kept.write_bytes(b"cut sh")  # a file cut short: computed again, and kept whole again
    assert module.define_import_structure(tree) == answer and len(calls) == 2
    assert module.define_import_structure(tree) == answer and len(calls) == 2

    module, calls = scanner(tmp_path)
    transformers_start.remember_import_structure(module, tmp_path / "no-such-folder")
    assert module.define_import_structure(tree) == answer == module.define_import_structure(tree)
    assert len(calls) == 2 and not (tmp_path / "no-such-folder").exists()


def test_packages_distributions_are_remembered_until_a_distribution_changes(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    calls = []

    def compute():
        calls.append(1)
        return {p.name.split("-")[0]: [p.name] for p in site.iterdir() if p.name.endswith(".dist-info")}

    cache = tmp_path / "cache"
    cache.mkdir()
    mapping = transformers_start.remembered_distributions(compute, cache)
    assert mapping() == {} and mapping() == {} and len(calls) == 1
    info = site / "thing-1.0.dist-info"
    info.mkdir()
    (info / "RECORD").write_text("thing/__init__.py,,\n")
    assert mapping() == {"thing": ["thing-1.0.dist-info"]} and len(calls) == 2
    (info / "RECORD").write_text("thing/__init__.py,,\nthing/more.py,,\n")  # rewritten in place
    mapping()
    assert len(calls) == 3
    kept = [json.loads(f.read_text()) for f in cache.glob("packages-distributions-*.json")]
    assert len(kept) == 3 and mapping() in kept and len(calls) == 3  # one answer a state of the distributions


def test_the_real_scans_equal_their_remembered_answers(tmp_path):
    """transformers imported in a process with the caches in place, twice (the second from the cache): its import
    structure and the distributions equal what the unremembered functions compute in the same process."""
    code = """
import importlib.metadata, sys
from harness import transformers_start
print(transformers_start.remember())
import transformers
from transformers.utils import import_utils
remembered = import_utils.define_import_structure
assert remembered.__code__.co_filename.endswith("transformers_start.py"), remembered
from pathlib import Path
models = Path(transformers.__file__).parent / "models"
for args in ((models, "models"), (models / "__init__.py", None)):
    assert remembered(*args) == remembered.__wrapped__(*args), args
assert importlib.metadata.packages_distributions() == importlib.metadata.packages_distributions.__wrapped__()
folder = transformers_start.cache_folder()
assert folder.name == "start", folder
kept = [p.name.split("-")[0] for p in folder.iterdir()]
print(kept.count("import") >= 2, kept.count("packages"))
"""
    env = {**os.environ, "FP8_HARNESS_START_CACHE": str(tmp_path / "start"),
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    env.pop("HARNESS_LEAN_IMPORTS", None)
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.splitlines() == ["('packages_distributions', 'define_import_structure')",
                                            "True 1"], done.stdout


@pytest.mark.parametrize("setting", ["turned off", "transformers imported already"])
def test_nothing_is_put_in_place_where_it_cannot_or_must_not(tmp_path, setting):
    code = ("import importlib.metadata, sys; from harness import transformers_start; "
            + ("import transformers.utils.import_utils; " if setting != "turned off" else "")
            + "print(transformers_start.remember()); "
            "print(getattr(importlib.metadata.packages_distributions, 'remembered', False)); "
            "print(any(isinstance(f, transformers_start.PatchAfterImport) for f in sys.meta_path))")
    env = {**os.environ, "FP8_HARNESS_START_CACHE": str(tmp_path / "start"),
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           "HARNESS_LEAN_IMPORTS": "0" if setting == "turned off" else "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = ["()", "False", "False"] if setting == "turned off" else ["('packages_distributions',)", "True", "False"]
    assert done.stdout.splitlines() == expected


def test_a_cache_folder_that_cannot_be_made_puts_nothing_in_place(tmp_path):
    """$FP8_HARNESS_START_CACHE under a regular file (no folder can be made there): nothing is remembered, and
    transformers imports as without it."""
    (tmp_path / "a-file").write_text("")
    code = ("import importlib.metadata, sys; from harness import transformers_start; "
            "print(transformers_start.remember()); import transformers.utils.import_utils as u; "
            "print(getattr(importlib.metadata.packages_distributions, 'remembered', False), "
            "getattr(getattr(u.define_import_structure, '__code__', None), 'co_filename', 'not a Python function'))")
    env = {**os.environ, "FP8_HARNESS_START_CACHE": str(tmp_path / "a-file" / "start"),
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    env.pop("HARNESS_LEAN_IMPORTS", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == "()" and done.stdout.splitlines()[1].startswith("False"), done.stdout
    assert "transformers_start" not in done.stdout, done.stdout  # transformers' own function, not ours
