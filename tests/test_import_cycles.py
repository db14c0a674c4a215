"""No import circle among Muster's own modules (shared/ and services/).

A circle hidden behind an import inside a function works in one import order and breaks in
another, and ties modules that should stand apart. Every import that runs counts, at module
level or inside a function; imports under `if TYPE_CHECKING:` do not (they never run: a module
may name a type of a module above it in an annotation). A seam between two modules is declared
by the lower one (a Protocol it defines and the upper one meets), not by a deferred import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("shared", "services")


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            # The installed name: shared/x.py is muster.shared.x (pyproject's package-dir).
            name = ".".join(("muster", *path.relative_to(root).with_suffix("").parts)).removesuffix(
                ".__init__"
            )
            found[name] = path
    return found


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `name` imports when it runs (at any depth)."""
    found: set[str] = set()
    pending: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while pending:
        node = pending.pop()
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child):
                pending.extend(child.orelse)  # the `else:` branch runs
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                for alias in child.names:  # `from muster.shared import mpi` imports muster.shared.mpi
                    full = f"{child.module}.{alias.name}"
                    found.add(full if full in known else child.module)
            pending.append(child)
    return {m for m in found if m in known and m != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_import_circle() -> None:
    graph = import_graph(ROOT)
    assert len(graph) > 50  # it found the modules
    assert "muster.shared.subjects" in graph["muster.shared.bus"]  # and their imports, by the installed names
    assert circles(graph) == []


def test_circles_finds_a_circle_and_ignores_type_only_imports(tmp_path: Path) -> None:
    """The check itself: a circle through a function-level import is one; a type-only one is not."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "shared" / "low.py").write_text("def f():\n    from muster.shared import high\n")
    (tmp_path / "shared" / "high.py").write_text("from muster.shared.low import f\n")
    (tmp_path / "shared" / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from muster.services import user\n"
    )
    (tmp_path / "services" / "user.py").write_text("import muster.shared.typed\n")
    assert circles(import_graph(tmp_path)) == [["muster.shared.high", "muster.shared.low"]]
