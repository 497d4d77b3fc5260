"""Draw the package graph of `src/kafila` from its imports, for docs/architecture.md: the packages
by layer (each imports only layers below it) and every arrow with its count of import
statements. Fails if the graph has a cycle.

    python scripts/package_graph.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))

from package_graph import cycles, imports, layers


def main() -> None:
    edges = imports()
    found = cycles(edges)
    if found:
        raise SystemExit(f"the package graph has cycles: {found}")
    stack = layers(edges)
    print("| layer | packages | imports (count of statements) |")
    print("|---|---|---|")
    for height in reversed(range(len(stack))):
        for package in stack[height]:
            below = sorted((b, n) for (a, b), n in edges.items() if a == package)
            arrows = ", ".join(f"{b} {n}" for b, n in below) or "–"
            print(f"| {height} | `{package}` | {arrows} |")


if __name__ == "__main__":
    main()
