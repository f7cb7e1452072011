"""No module of the package imports itself back, through any chain of imports.

import-linter (pyproject) checks that layers import only downward; within one layer, or one
package, two modules could still import each other, which a lazy import inside a function hides
until it breaks. Here every ``import`` statement of every module counts, at module level or inside
a function (those under ``if TYPE_CHECKING:`` too: they are the same dependency), and the graph of
the package's modules must have no cycle.

Worked example (``find_cycle``): edges ``a -> b -> c -> a`` and ``c -> d`` give the cycle
``[a, b, c, a]``; without ``c -> a`` there is none.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

import mixtral_infer

ROOT = Path(mixtral_infer.__file__).resolve().parent
PACKAGE = "mixtral_infer"


def module_names() -> Dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join([PACKAGE, *parts])] = path
    return names


def imported(path: Path, name: str, modules: Set[str]) -> Set[str]:
    """The package's modules that the module ``name`` at ``path`` imports (``from p import m`` counts
    module ``p.m`` where it is one, else ``p``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)
    return {m for m in found if m in modules and m != name}


def find_cycle(edges: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One cycle of the graph as ``[a, b, ..., a]``, or None (depth-first search, colouring nodes)."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_find_cycle_worked_example():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    edges["c"] = {"d"}
    assert find_cycle(edges) is None


def test_relative_and_from_imports_resolve_to_modules(tmp_path):
    modules = {"mixtral_infer.p", "mixtral_infer.p.m", "mixtral_infer.p.n", "mixtral_infer.q"}
    source = tmp_path / "n.py"
    source.write_text("from . import m\nfrom mixtral_infer.q import thing\nimport os\n")
    assert imported(source, "mixtral_infer.p.n", modules) == {"mixtral_infer.p.m", "mixtral_infer.q"}


def test_no_module_imports_itself_back():
    modules = module_names()
    names = set(modules)
    edges = {name: imported(path, name, names) for name, path in modules.items()}
    edges.pop(PACKAGE)  # the package's own lazy exports (``mixtral_infer.__getattr__``) import the API on demand
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
