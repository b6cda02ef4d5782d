"""The folders of `harness/` are stages of one flow; a module may import its own and earlier stages only.

The order is the one `docs/ARCHITECTURE.md` draws. Imports under `if TYPE_CHECKING:` are annotations, not
dependencies, and are skipped. `kernels/` must import without `harness`.
"""

from __future__ import annotations

import ast
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
    "harness.scenarios": 1,
    "harness.canary": 2,
    "harness.kv_paths": 3,
    "harness.analysis": 4,
    "harness.replay": 5,
    "harness.judges": 6,
    "harness.runs": 7,
}
ENTRY = 99
ENTRY_MODULES = ("harness.cli", "harness.job", "harness.run_inputs", "harness.serve", "harness.bench",
                 "harness.pytest_plugin", "harness.nightly", "harness.zoo", "harness.canary.train",
                 "harness.canary.retrain", "harness.canary.record_accuracy", "harness.canary.make_scenarios",
                 "harness.canary.check_variant", "harness.attention_cli")


def stage_of(module: str) -> int | None:
    if any(module == m or module.startswith(m + ".") for m in ENTRY_MODULES):
        return ENTRY
    matches = [p for p in STAGES if module == p or module.startswith(p + ".")]
    return STAGES[max(matches, key=len)] if matches else None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
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
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def test_every_harness_module_has_a_stage():
    unplaced = [module_name(p) for p in (ROOT / "harness").rglob("*.py") if stage_of(module_name(p)) is None
                and module_name(p) != "harness"]
    assert not unplaced, f"add these modules to a stage in {__file__}: {unplaced}"


def test_imports_point_from_later_stages_to_earlier_ones():
    backwards = []
    for path in sorted((ROOT / "harness").rglob("*.py")):
        importer = module_name(path)
        own = stage_of(importer)
        if own is None:
            continue
        for line, imported in imported_modules(ast.parse(path.read_text(), str(path))):
            theirs = stage_of(imported) if imported.startswith("harness.") else None
            if theirs is not None and theirs > own:
                backwards.append(f"{path.relative_to(ROOT)}:{line}: {importer} (stage {own}) imports "
                                 f"{imported} (stage {theirs})")
    assert not backwards, "imports against the flow:\n" + "\n".join(backwards)


@pytest.mark.parametrize("source", [
    "import harness.scenarios.load\nfrom harness.runs.store import RunStore\n",
])
def test_the_checker_sees_a_backward_import(source):
    """The rule above is not vacuous: a stage-1 module importing the store is caught."""
    imports = imported_modules(ast.parse(source))
    assert any(stage_of(m) == STAGES["harness.runs"] for _, m in imports)
    assert stage_of("harness.scenarios.load") < stage_of("harness.runs.store")


def test_kernels_import_without_harness():
    code = ("import sys, importlib, pkgutil, kernels\n"
            "for m in pkgutil.iter_modules(kernels.__path__):\n"
            "    importlib.import_module('kernels.' + m.name)\n"
            "bad = [m for m in sys.modules if m == 'harness' or m.startswith('harness.')]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
