"""No import circles among the project's modules.

A circle means two modules are one concept split in two (one reaches into the other's
state) or a shared concept has no home: give it one, rather than hiding the circle in a
function-level import. Every import statement counts, wherever it is (module level, inside
a function, under `TYPE_CHECKING`). Read from the source with `ast`: nothing is imported.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("distill_common", "teacher_server", "student_trainer", "distill_demo", "bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def imported_names(module: str, path: Path) -> set[str]:
    """The dotted names every import statement of `module` asks for (`from a import b`: a.b, then a)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """Each project module -> the project modules it imports.

    A name resolves to the longest project module it starts with: `from a.b import c` is
    a.b.c when that is a module, else a.b (c is one of its names). Importing a submodule
    also runs its packages' `__init__`, but that edge is not counted: every package's
    `__init__` imports its own submodules, and that is not a circle of concepts.
    """
    modules = project_modules()
    graph = {}
    for module, path in modules.items():
        edges = set()
        for name in imported_names(module, path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.add(name)
        graph[module] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle in `graph` once, as `[a, b, ..., a]`: the shortest one through each module."""
    cycles = {}
    for start in sorted(graph):
        # Breadth first from start: the shortest way back to it.
        parent, queue = {start: None}, deque([start])
        while queue and start not in {m for cycle in cycles for m in cycle}:
            node = queue.popleft()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    path = [node]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    cycles[frozenset(path)] = path[::-1] + [start]
                    queue.clear()
                    break
                if nxt not in parent:
                    parent[nxt] = node
                    queue.append(nxt)
    return list(cycles.values())


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "student_trainer.connection" in graph["student_trainer.client"]  # module level
    assert "student_trainer.local_teacher" in graph["student_trainer.store.dump"]  # inside a function
    assert "student_trainer.store.directory" in graph["student_trainer.store"]  # from a package's __init__
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b", "a"], ["c", "d", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, ("import circles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)
                        + "\ngive what each circle shares a module of its own (an import inside a function "
                        "still counts)")
