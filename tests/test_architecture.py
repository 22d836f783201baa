"""The layer rules of docs/ARCHITECTURE.md, checked on the source: imports flow one way, no
module imports another in a cycle, one vocabulary, one error family."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tpkit
from tpkit.errors import TpkitError

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tpkit"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(path: Path) -> set[str]:
    """tpkit modules ``path`` imports anywhere (function bodies included), except under
    ``if TYPE_CHECKING:``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names if a.name.startswith("tpkit"))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                if mod.startswith("tpkit"):
                    out.add(mod)
                    out.update(f"{mod}.{a.name}" for a in child.names)  # `from . import x` names a module
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def module_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        graph[name] = {m for m in imports_of(path) if m in files and m != name and m != "tpkit"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycle_anywhere_function_level_imports_included():
    graph = module_graph()
    assert len(graph) > 40  # the walk found the package
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_capture_and_analysis_never_meet():
    graph = module_graph()
    for mod, deps in graph.items():
        if mod.startswith(("tpkit.capture", "tpkit.data", "tpkit.offload")):
            assert not {d for d in deps if d.startswith(("tpkit.analysis", "tpkit.charts", "tpkit.views"))}, mod
        if mod.startswith(("tpkit.analysis", "tpkit.charts")):
            bad = {d for d in deps if d.startswith(("tpkit.capture", "tpkit.data", "tpkit.offload"))}
            assert not bad, mod


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root,
                          capture_output=True, text=True, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


@pytest.mark.slow
def test_import_contract_holds_and_fails_on_an_upward_import(tmp_path):
    if not Path(sys.executable).with_name("lint-imports").exists():
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    assert _lint_imports(ROOT).returncode == 0
    copy = tmp_path / "repo"
    shutil.copytree(PKG, copy / "tpkit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    rec = copy / "tpkit" / "capture" / "recorder.py"
    rec.write_text(rec.read_text() + "\nfrom ..views import html  # an upward import\n")
    out = _lint_imports(copy)
    assert out.returncode != 0
    assert "tpkit.capture.recorder -> tpkit.views.html" in out.stdout


def test_one_vocabulary_the_memory_categories_and_units_live_in_schema_alone():
    literal = re.compile(r'"parameters",\s*"gradients",\s*"optimizer_state"')
    mib = re.compile(r"^MIB\s*=", re.M)
    for path in list(PKG.rglob("*.py")) + list((ROOT / "datasets").rglob("*.py")):
        if path.name == "schema.py":
            continue
        text = path.read_text()
        assert not literal.search(text), f"{path} spells the memory categories again: use tpkit.schema"
        assert not mib.search(text), f"{path} defines MIB again: use tpkit.schema.MIB"


def test_every_tpkit_exception_is_a_tpkit_error():
    seen = []
    for info in pkgutil.walk_packages(tpkit.__path__, "tpkit."):
        if info.name.endswith("__main__"):
            continue
        try:
            mod = importlib.import_module(info.name)
        except ImportError:
            continue
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ == info.name and issubclass(cls, BaseException):
                seen.append(cls)
                if cls.__name__ == "StopSlice":  # control flow, not an error: never reaches the user
                    continue
                assert issubclass(cls, TpkitError), f"{info.name}.{cls.__name__} is not a TpkitError"
    assert len(seen) >= 5
