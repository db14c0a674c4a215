"""Services meet only on the bus (issue 25): no module under one service's folder imports another
service's folder, and nothing under shared/ imports a service. Every import is read from the
source with `ast`: top-level and function-level, `import x` and `from x import y`, relative ones
resolved, and `importlib.import_module("...")` with a literal name. The CLI (services/cli/) is a
client of every service and is exempt. Pure: no bus."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXEMPT = {"cli"}  # a client of everything: it starts, asks and renders every service


def _module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path, root: Path = ROOT) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth, relative ones made absolute."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_of(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if base in ("services", "muster.services"):  # `from muster.services import scheduler`: a package
                for alias in node.names:
                    yield node.lineno, f"{base}.{alias.name}"
            else:
                yield node.lineno, base
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def crossings(root: Path = ROOT) -> list[str]:
    """`file:line: what it imports (why not)` for every import across a boundary."""
    out = []
    services = root / "services"
    for folder in sorted(p for p in services.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        if folder.name in EXEMPT:
            continue
        for path in sorted(folder.rglob("*.py")):
            for line, module in imported(path, root):
                parts = module.removeprefix("muster.").split(".")  # the installed name of services/
                if len(parts) >= 2 and parts[0] == "services" and parts[1] != folder.name:
                    rel = path.relative_to(root)
                    out.append(
                        f"{rel}:{line}: imports {module} "
                        f"(services/{folder.name}/ may not import services/{parts[1]}/)"
                    )
    for path in sorted((root / "shared").rglob("*.py")):
        for line, module in imported(path, root):
            if module.removeprefix("muster.").split(".")[0] == "services":
                out.append(
                    f"{path.relative_to(root)}:{line}: imports {module} (shared/ may not import a service)"
                )
    return out


def test_no_service_imports_another_services_folder() -> None:
    found = crossings()
    assert not found, (
        "imports across service boundaries (move the rule to shared/, or ask over the bus):\n"
        + "\n".join(found)
    )


CASES = [
    # (file under services/, its source, whether it crosses a boundary)
    ("gateway/a.py", "from muster.services.scheduler import quota\n", True),
    ("gateway/a.py", "import muster.services.scheduler.quota\n", True),
    ("gateway/a.py", "def f():\n    from muster.services.supervisor.policy import decide\n", True),
    ("gateway/a.py", "from muster.services import scheduler\n", True),
    ("gateway/a.py", "from ..scheduler import quota\n", True),
    ("gateway/a.py", "import importlib\nimportlib.import_module('muster.services.registry.service')\n", True),
    ("gateway/a.py", "from muster.services.gateway.listing import Listing\n", False),
    ("gateway/a.py", "from .listing import Listing\n", False),
    ("gateway/a.py", "from muster.shared import vcquota\n", False),
    ("cli/a.py", "from muster.services.scheduler import quota\n", False),
    ("agent/sim.py", "from muster.services.agent.service import Agent\n", False),
]


@pytest.mark.parametrize(("where", "source", "crosses"), CASES)
def test_the_check_sees_every_kind_of_import(tmp_path: Path, where: str, source: str, crosses: bool) -> None:
    for svc in ("gateway", "scheduler", "cli", "agent", "supervisor", "registry"):
        (tmp_path / "services" / svc).mkdir(parents=True)
        (tmp_path / "services" / svc / "__init__.py").write_text("")
    (tmp_path / "shared").mkdir()
    (tmp_path / "services" / where).write_text(source)
    found = crossings(tmp_path)
    assert bool(found) == crosses, found
    if crosses:
        assert found[0].startswith(f"services/{where}:"), found


def test_shared_may_not_import_a_service(tmp_path: Path) -> None:
    (tmp_path / "services").mkdir()
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "x.py").write_text("def f():\n    import muster.services.scheduler.placement\n")
    assert crossings(tmp_path) == [
        "shared/x.py:2: imports muster.services.scheduler.placement (shared/ may not import a service)"
    ]
