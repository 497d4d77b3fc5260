"""Run a benchmark on this checkout and on another commit, alternately, in one run: the machine's
noise then falls on both alike. Each side runs its own copy of the benchmark script with its own
`src/` first on the path (child processes, `kafila host` among them, inherit it), so the other
commit's code runs whole. Prints each run's output under its side's name.

    python scripts/bench_against.py --times 2 ec08103 -- scripts/bench_serve.py --members --rounds 1
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def run(tree: Path, command: list[str]) -> str:
    environment = {**os.environ, "PYTHONPATH": str(tree / "src")}
    done = subprocess.run(
        [sys.executable, *command], cwd=tree, env=environment, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed in {tree} ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("base", help="the commit to compare with")
    parser.add_argument("--times", type=int, default=2, help="runs of each side, alternating")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the benchmark script and its arguments")
    args = parser.parse_args()
    command = [part for part in args.command if part != "--"]
    if not command:
        parser.error("name the benchmark after --")
    with tempfile.TemporaryDirectory(prefix="kafila-base-") as scratch:
        base = Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=HERE, check=True)
        try:
            for time in range(args.times):
                for name, tree in ((f"base {args.base}", base), ("this checkout", HERE)):
                    print(f"\n## {name}, run {time + 1} of {args.times}\n", flush=True)
                    print(run(tree, command), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=HERE, check=False)


if __name__ == "__main__":
    main()
