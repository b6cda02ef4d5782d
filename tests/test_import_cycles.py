"""No runtime import cycles inside `harness/`: the module import graph (every `import` / `from ... import` in a
module, those inside functions included, `if TYPE_CHECKING:` blocks left out: they are annotations) has no cycle.

A cycle closed by an import inside a function works only while that function runs late enough; it says that a
shared piece lives in the wrong module. Move the piece to the module that owns it instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from test_layout import ROOT, imported_modules, module_name


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """Module -> {harness module it imports: the line}. `from harness.a import b` imports harness.a (its package
    runs first) and harness.a.b when that is a module."""
    paths = {module_name(path, root): path for path in sorted((root / "harness").rglob("*.py"))}
    graph = {}
    for importer, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: dict[str, int] = {}
        for line, imported in imported_modules(tree, importer, path.name == "__init__.py"):
            if imported in paths and imported != importer:
                edges.setdefault(imported, line)
        graph[importer] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated last) through each strongly connected component of more
    than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(set(component))
    return [cycle_through(graph, component) for component in components]


def cycle_through(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A shortest cycle from the component's first module back to itself, inside the component (breadth first)."""
    start = min(component)
    came_from = {start: None}
    queue = [start]
    for node in queue:
        for child in sorted(graph[node]):
            if child == start:
                path = [node]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if child in component and child not in came_from:
                came_from[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start} in its component")


def described(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_harness_has_no_import_cycles():
    graph = import_graph()
    found = [described(graph, cycle) for cycle in cycles(graph)]
    assert not found, f"{len(found)} import cycle(s) in harness/:\n" + "\n".join(found)


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}, [["a", "b", "c", "a"]]),
    ({"a": {"b": 1}, "b": {"c": 1}, "c": {}}, []),
    ({"a": {"b": 1}, "b": {"a": 1}, "c": {"d": 1}, "d": {"c": 1}}, [["a", "b", "a"], ["c", "d", "c"]]),
])
def test_the_cycle_finder_finds_planted_cycles(edges, expected):
    assert sorted(cycles(edges)) == expected


def test_an_import_inside_a_function_is_an_edge(tmp_path):
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "__init__.py").write_text("")
    (tmp_path / "harness" / "a.py").write_text("from harness import b\n")
    (tmp_path / "harness" / "b.py").write_text("def late():\n    from harness.a import x\n")
    graph = import_graph(tmp_path)
    assert [described(graph, c) for c in cycles(graph)] == [
        "harness.a (line 1) -> harness.b (line 2) -> harness.a"]
