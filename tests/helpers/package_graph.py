"""The package graph of `src/kafila`, read from the source: which package imports which, and
how often. `tests/test_package_graph.py` holds it to the layering `docs/architecture.md` draws;
`scripts/package_graph.py` draws it."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "src" / "kafila"
LEAVES = ("contracts", "wire", "untrusted", "units", "validation", "portability", "event_feed", "log_repeats")


def package_of(module: str) -> str:
    """`kafila.runtime.engine.ring` → `runtime`; a leaf module is its own package."""
    parts = module.split(".")
    package = parts[1] if len(parts) > 1 else parts[0]
    return "cli" if package == "__main__" else package  # `python -m kafila` is the command line


def imports(source: Path = SOURCE) -> Counter[tuple[str, str]]:
    """(importing package, imported package) → how many import statements, across packages only;
    imports under `if TYPE_CHECKING:` count too (a cycle of types is a cycle still)."""
    edges: Counter[tuple[str, str]] = Counter()
    for path in sorted(source.rglob("*.py")):
        here = package_of(".".join(("kafila", *path.relative_to(source).with_suffix("").parts)))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                if name.startswith("kafila.") and package_of(name) != here:
                    edges[(here, package_of(name))] += 1
    return edges


def cycles(edges: Counter[tuple[str, str]]) -> list[list[str]]:
    """Every cycle's packages, found by depth-first search (empty: the graph is layered)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def layers(edges: Counter[tuple[str, str]]) -> list[list[str]]:
    """The packages by height: each layer imports only layers below it (assumes no cycle)."""
    nodes = {n for edge in edges for n in edge}
    height: dict[str, int] = {}

    def of(node: str) -> int:
        if node not in height:
            below = [b for a, b in edges if a == node]
            height[node] = 1 + max((of(b) for b in below), default=-1)
        return height[node]

    for node in nodes:
        of(node)
    return [sorted(n for n in nodes if height[n] == h) for h in range(max(height.values()) + 1)]
