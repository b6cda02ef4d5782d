"""The folders of `harness/` are stages of one flow; a module may import its own and earlier stages only.

The order is the one `docs/ARCHITECTURE.md` draws. Imports under `if TYPE_CHECKING:` are annotations, not
dependencies, and are skipped; relative imports are resolved against the importing module's package.
`reports/` renders stored runs: it may read `harness.analysis` (pure functions) and earlier stages, never
replay, runs or an entry point. `kernels/` must import without `harness`.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Module prefix -> stage; the longest matching prefix wins. Entry points (the CLI, `harness run` as a
# function, the server, benchmarks, the pytest plugin, the canary tools) sit above every stage.
STAGES = {
    "harness.types": 0,
    "harness.records": 0,
    "harness.files": 0,
    "harness.model_layers": 0,
    "harness.forward_context": 0,
    "harness.lean_imports": 0,
    "harness.transformers_start": 0,
    "harness.scenarios": 1,
    "harness.canary": 2,
    "harness.kv_paths": 3,
    "harness.analysis": 4,
    "harness.replay": 5,
    "harness.judges": 6,
    "harness.runs": 7,
    "harness.executor": 8,
}
# reports/ sits beside harness/runs (stage 7) but only reads plain data: it may import up to stage 4.
REPORTS_STAGE = 4
ENTRY = 99
ENTRY_MODULES = ("harness.cli", "harness.job", "harness.run_inputs", "harness.serve", "harness.bench",
                 "harness.pytest_plugin", "harness.nightly", "harness.zoo", "harness.canary.train",
                 "harness.canary.retrain", "harness.canary.record_accuracy", "harness.canary.make_scenarios",
                 "harness.canary.check_variant", "harness.attention_cli", "harness.run_config",
                 "harness.families_matrix")


def stage_of(module: str) -> int | None:
    if any(module == m or module.startswith(m + ".") for m in ENTRY_MODULES):
        return ENTRY
    matches = [p for p in STAGES if module == p or module.startswith(p + ".")]
    return STAGES[max(matches, key=len)] if matches else None


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str | None:
    """The absolute module an `from ... import` names; `from .x import y` in harness.replay.a -> harness.replay.x."""
    if node.level == 0:
        return node.module
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    if node.level - 1 > len(package) - 1:
        return None  # beyond the top package: Python itself refuses it
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(tree: ast.AST, importer: str = "", is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import, leaving out `if TYPE_CHECKING:` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = absolute(node, importer, is_package)
            if module:
                found += [(node.lineno, module)] + [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return found


def backward_imports(root: Path) -> list[str]:
    """Every import under `root`'s harness/ and reports/ that points against the flow."""
    found = []
    for path in sorted([*(root / "harness").rglob("*.py"), *(root / "reports").rglob("*.py")]):
        importer = module_name(path, root)
        own = REPORTS_STAGE if importer.split(".")[0] == "reports" else stage_of(importer)
        if own is None:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for line, imported in imported_modules(tree, importer, path.name == "__init__.py"):
            theirs = stage_of(imported) if imported.startswith("harness.") else None
            if theirs is not None and theirs > own:
                found.append(f"{path.relative_to(root)}:{line}: {importer} (stage {own}) imports "
                             f"{imported} (stage {theirs})")
    return found


def test_every_harness_module_has_a_stage():
    unplaced = [module_name(p) for p in (ROOT / "harness").rglob("*.py") if stage_of(module_name(p)) is None
                and module_name(p) != "harness"]
    assert not unplaced, f"add these modules to a stage in {__file__}: {unplaced}"


def test_imports_point_from_later_stages_to_earlier_ones():
    backwards = backward_imports(ROOT)
    assert not backwards, "imports against the flow:\n" + "\n".join(backwards)


@pytest.mark.parametrize("planted, source, caught", [
    # an absolute import of the store from a stage-1 module
    ("harness/scenarios/planted.py", "from harness.runs.store import RunStore\n", True),
    # the same through a relative import
    ("harness/scenarios/planted.py", "from ..runs import store\n", True),
    # a report importing replay
    ("reports/planted.py", "from harness.replay.runner import replay\n", True),
    # allowed: the same stage, an earlier stage, and an annotation-only import
    ("harness/runs/planted.py", "from . import store\nfrom harness.analysis import verdicts\n", False),
    ("harness/kv_paths/planted.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from harness.replay.runner import replay\n", False),
])
def test_the_checker_catches_a_planted_import(tmp_path, planted, source, caught):
    """The rule is not vacuous: a file planted in a copy of the tree is scanned and judged."""
    for folder in ("harness", "reports"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__", "weights"))
    (tmp_path / planted).write_text(source)
    found = [line for line in backward_imports(tmp_path) if line.startswith(planted)]
    assert bool(found) == caught, found


def test_kernels_import_without_harness():
    code = ("import sys, importlib, pkgutil, kernels\n"
            "for m in pkgutil.iter_modules(kernels.__path__):\n"
            "    importlib.import_module('kernels.' + m.name)\n"
            "bad = [m for m in sys.modules if m == 'harness' or m.startswith('harness.')]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
