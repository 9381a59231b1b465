"""guestd's modules import one another without a cycle, type-only imports included: every
``import`` counts, at the top, under ``if TYPE_CHECKING:`` or inside a function (a lazy import
that dodges a cycle at run time is still two modules that each need the other). Only an
``if __name__ == "__main__":`` block is left out: run as a script, the module is ``__main__``.
A cycle is reported with one path around it, so the edge to cut is named."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

from guestd.testing import REPO

PACKAGE = "guestd"


def _modules() -> dict[str, str]:
    """Dotted module name -> its file, for every module of the package."""
    found: dict[str, str] = {}
    top = os.path.join(REPO, PACKAGE)
    for folder, dirs, files in os.walk(top):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def _is_main_block(node: ast.stmt) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def _imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    stack: list[ast.AST] = [n for n in tree.body if not _is_main_block(n)]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """Each module -> the package's modules it imports (``from a import b`` names module
    ``a.b`` when there is one, else ``a``)."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    anchor = ".".join(parts[: len(parts) - node.level + 1])
                    base = f"{anchor}.{base}" if base else anchor
                names = [f"{base}.{alias.name}" for alias in node.names]
            for name in names:
                if name == PACKAGE or name.startswith(PACKAGE + "."):
                    target = owner(name)
                    if target is not None and target != module:
                        targets.add(target)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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
                        found.append(sorted(component))
    return found


def _path_around(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest cycle through the component's first module, start and end included."""
    members = set(component)
    start = component[0]
    parents: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for target in sorted(graph[node] & members):
                if target == start:
                    path = [node]
                    while (parent := parents[path[-1]]) is not None:
                        path.append(parent)
                    return [*reversed(path), start]
                if target not in parents:
                    parents[target] = node
                    following.append(target)
        frontier = following
    return component


def test_guestd_has_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 100  # the walk found the package
    found = cycles(graph)
    assert found == [], "import cycles:\n" + "\n".join(" -> ".join(_path_around(graph, c)) for c in found)


def test_the_cycle_finder_finds_a_type_only_cycle() -> None:
    """The finder itself, on a made-up graph: a -> b -> c -> a (one edge type-only in real code
    would look the same here: every import is an edge), beside an acyclic d -> a."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert _path_around(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
