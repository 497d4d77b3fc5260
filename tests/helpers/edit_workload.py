"""bench_wan.py's edit workload: a 200-line source file in the prompt, asked back with one
identifier renamed, the text drafts are accepted on (issue 37). Shared by the benchmarks in
scripts/ and the tests that check speculation on it."""

from __future__ import annotations

from pathlib import Path

EDIT_FILE = Path(__file__).resolve().parents[2] / "scripts" / "bench_data" / "inventory.py.txt"


def edit_prompt(lines: int | None) -> str:
    """The edit request over the file's first `lines` lines (all with None)."""
    source = "".join(EDIT_FILE.read_text().splitlines(keepends=True)[:lines])
    return (
        f"inventory.py:\n\n```python\n{source}```\n\nThe same file, with the variable `warehouse` renamed to "
        "`store` everywhere:\n\n```python\n"
    )
