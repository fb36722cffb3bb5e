"""The package's shape: no module over 400 lines, no import circle among minisrv's modules, no `global` statement.

A long module usually holds two concepts, and a circle means two modules are one concept split badly (or that a
floor is crossed upwards); both make the code harder to read in one sitting. The checks read the source with `ast`
and never import minisrv, so a circle or a broken module cannot hide the failure.

Imports are collected everywhere in a module, inside functions and under `if TYPE_CHECKING:` too: an import moved
into a function, or into a type-only block, to dodge a circle at import time is still a circle in the design.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minisrv"
MAX_LINES = 400


def module_name(path: Path) -> str:
    """minisrv/engine/setup.py -> minisrv.engine.setup; a package's __init__.py is the package itself."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_files() -> Dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _import_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every Import / ImportFrom under node, at any depth (type-only imports and function-level ones included)."""
    return (n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))


def _resolve(node: ast.ImportFrom, importer: str, is_package: bool) -> Optional[str]:
    """The absolute module an ImportFrom names (before its imported names are looked at)."""
    if node.level == 0:
        return node.module
    base = importer.split(".")
    if not is_package:
        base = base[:-1]  # a module's relative imports start from its package
    if node.level > 1:
        base = base[:-(node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str, modules: Set[str]) -> Optional[str]:
    """The longest prefix of a dotted name that is one of minisrv's modules (`minisrv.x.y.func` -> `minisrv.x.y`)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in modules:
            return cand
    return None


def import_graph(files: Dict[str, Path]) -> Dict[str, Set[str]]:
    """module -> the minisrv modules it imports. `from pkg import sub` counts as importing the module pkg.sub when
    there is one, else pkg itself (a name its __init__ defines or re-exports)."""
    modules = set(files)
    graph: Dict[str, Set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        deps: Set[str] = set()
        for node in _import_nodes(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(node, name, is_package)
                if base is None:
                    continue
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for t in targets:
                hit = _known(t, modules)
                if hit is not None and hit != name:
                    deps.add(hit)
        graph[name] = deps
    return graph


def find_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a sorted list: every import
    circle lies inside one of them, and each component is reported once however many circles it holds."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def one_circle(graph: Dict[str, Set[str]], component: List[str]) -> List[str]:
    """A shortest circle through the component's first module, as a path [a, b, ..., a] (breadth first)."""
    members = set(component)
    start = component[0]
    paths: Dict[str, List[str]] = {}
    frontier = [[start]]
    while frontier:
        nxt = []
        for path in frontier:
            for w in sorted(graph[path[-1]] & members):
                if w == start:
                    return path + [start]
                if w not in paths:
                    paths[w] = path + [w]
                    nxt.append(paths[w])
        frontier = nxt
    return component + [start]


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in package_files().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concept):\n" + \
        "\n".join(f"  {path}: {n} lines" for path, n in sorted(long.items()))


def test_no_import_circle():
    graph = import_graph(package_files())
    cycles = find_cycles(graph)
    assert not cycles, "import circles inside minisrv/ (function-level and type-only imports count):\n" + "\n".join(
        f"  modules {', '.join(c)}\n    e.g. {' -> '.join(one_circle(graph, c))}" for c in cycles)


def test_no_global_statement():
    hits = [f"  {p.relative_to(ROOT)}:{node.lineno}: global {', '.join(node.names)}"
            for p in package_files().values()
            for node in ast.walk(ast.parse(p.read_text(), filename=str(p))) if isinstance(node, ast.Global)]
    assert not hits, "`global` statements in minisrv/ (pass state explicitly or keep it on an object):\n" + \
        "\n".join(hits)


# ---------------------------------------------------------------------------------------------------------------
# the checker itself, on small made-up packages: a circle it must see, and imports that are not circles


def _write(tmp_path: Path, files: Dict[str, str]) -> Dict[str, Path]:
    out = {}
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for rel in files:
        p = tmp_path / rel
        parts = list(p.relative_to(tmp_path).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


@pytest.mark.parametrize("b_text", [
    "from . import a\n",                                   # module level, relative
    "def f():\n    from minisrv.eng.a import X\n",         # dodged inside a function, absolute
    "import minisrv.eng.a as a\n",
    "if TYPE_CHECKING:\n    pass\nelse:\n    from .a import X\n",  # the else branch runs
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\n",  # type-only: a circle too
])
def test_checker_sees_circle(tmp_path, b_text):
    files = _write(tmp_path, {"minisrv/__init__.py": "", "minisrv/eng/__init__.py": "",
                              "minisrv/eng/a.py": "from .b import Y\n", "minisrv/eng/b.py": b_text})
    graph = import_graph(files)
    assert find_cycles(graph) == [["minisrv.eng.a", "minisrv.eng.b"]]
    assert one_circle(graph, ["minisrv.eng.a", "minisrv.eng.b"]) == ["minisrv.eng.a", "minisrv.eng.b", "minisrv.eng.a"]


def test_checker_passes_what_is_no_circle(tmp_path):
    files = _write(tmp_path, {
        "minisrv/__init__.py": "from .eng.a import X\n",      # a package re-exporting its submodule
        "minisrv/eng/__init__.py": "",
        "minisrv/eng/a.py": "from minisrv.eng import b\nfrom ..util import h\n",
        "minisrv/eng/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..util import h\n",
        "minisrv/util.py": "import os\n",
    })
    graph = import_graph(files)
    assert graph["minisrv.eng.a"] == {"minisrv.eng.b", "minisrv.util"}
    assert graph["minisrv.eng.b"] == {"minisrv.util"}
    assert find_cycles(graph) == []
