"""Keep the tutorial notebooks clean, and run them.

    python notebooks/nbtool.py strip              # drop outputs and execution counts (before a commit)
    python notebooks/nbtool.py check              # fail if any notebook has outputs
    python notebooks/nbtool.py run [NB ...]       # execute into notebooks/executed/ (gitignored), with outputs

The notebooks in git carry no outputs: every number in them is measured when they run.
``run`` executes each one in a fresh kernel with ``notebooks/executed/`` as working directory
(so exports and the run store land there) and writes the executed copy beside them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent


def notebooks() -> list[Path]:
    return sorted(HERE.glob("[0-9][0-9]_*.ipynb"))


def strip(nb: nbformat.NotebookNode) -> bool:
    """Remove outputs, execution counts and widget state in place; True if anything changed."""
    changed = False
    for cell in nb.cells:
        if cell.cell_type == "code":
            if cell.outputs or cell.execution_count is not None:
                changed = True
            cell.outputs, cell.execution_count = [], None
        for key in ("execution", "collapsed", "scrolled"):
            changed |= cell.metadata.pop(key, None) is not None
    changed |= nb.metadata.pop("widgets", None) is not None
    return changed


def execute(path: Path, cwd: Path, timeout_s: int = 600, env: dict | None = None) -> nbformat.NotebookNode:
    """Run a notebook top to bottom in a fresh python3 kernel; returns it with outputs.
    Raises nbclient's CellExecutionError on the first failing cell."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    cwd.mkdir(parents=True, exist_ok=True)
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        NotebookClient(nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(cwd)}},
                       store_widget_state=True).execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    return nb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["strip", "check", "run"])
    p.add_argument("paths", nargs="*", type=Path, help="notebooks (default: every numbered notebook)")
    p.add_argument("--out", type=Path, default=HERE / "executed", help="folder for executed copies (run)")
    args = p.parse_args(argv)
    paths = args.paths or notebooks()
    if args.command in ("strip", "check"):
        dirty = []
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            if strip(nb):
                dirty.append(path)
                if args.command == "strip":
                    nbformat.write(nb, path)
        verb = "stripped" if args.command == "strip" else "has outputs"
        for path in dirty:
            print(f"{path.name}: {verb}")
        return 1 if (dirty and args.command == "check") else 0
    for path in paths:
        t0 = time.perf_counter()
        nb = execute(path, args.out, env={"TPKIT_RUNS": str(args.out / "tpkit_runs")})
        nbformat.write(nb, args.out / path.name)
        print(f"{path.name}: ran in {time.perf_counter() - t0:.0f} s -> {args.out / path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
