"""The installed distribution owns one import name, `muster` (issue 25).

Muster's wheel, built here from a copy of the sources, and a wheel of another project that ships
its own top-level `shared` and `services` packages are installed into a fresh virtualenv in both
orders: each project imports its own modules, and uninstalling the other one leaves Muster whole.
The fresh venv has no pip and downloads nothing: this venv's pip installs into it (`--python`),
`--no-deps`, and a .pth line lends it this venv's site-packages for Muster's dependencies (nats,
pydantic, ...), which holds no `muster` files (the editable install here is an import hook that a
plain .pth line does not run).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]

OTHER_PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "other-shared-services"
version = "1.0"

[tool.setuptools]
packages = ["shared", "services", "services.validator"]
"""


def env() -> dict[str, str]:
    """The environment without anything that would put the checkout on a child's sys.path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def run(argv: list[str | Path], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout
    )


def pip(*args: str | Path, cwd: Path) -> None:
    r = run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], cwd)
    assert r.returncode == 0, r.stdout + r.stderr


def build_wheel(source: Path, out: Path) -> Path:
    """A wheel of `source`, built with this venv's setuptools (no build isolation: nothing fetched)."""
    pip("wheel", "--no-deps", "--no-build-isolation", source, "-w", out, cwd=source)
    (wheel,) = [w for w in out.glob("*.whl") if w.name.split("-")[0] == source.name.replace("-", "_")]
    return wheel


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("wheels")
    out = base / "dist"
    # Muster from a copy of what its wheel is made of, so that setuptools leaves nothing in the checkout.
    src = base / "muster"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("shared", "services"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    # The other project: top-level `shared` and `services`, a `shared.jobconfig` of its own.
    other = base / "other-shared-services"
    (other / "services" / "validator").mkdir(parents=True)
    (other / "shared").mkdir()
    (other / "pyproject.toml").write_text(OTHER_PYPROJECT)
    (other / "shared" / "__init__.py").write_text("")
    (other / "shared" / "jobconfig.py").write_text('OWNER = "other"\n')
    (other / "services" / "__init__.py").write_text("")
    (other / "services" / "validator" / "__init__.py").write_text('OWNER = "other"\n')
    return {"muster": build_wheel(src, out), "other": build_wheel(other, out)}


def fresh_venv(where: Path) -> Path:
    """A virtualenv with no pip that sees, after its own site-packages, the site-packages this
    interpreter imports from (Muster's dependencies; those a .pth lends this venv too)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=60)
    python = where / "bin" / "python"
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], where)
    sites = {"site-packages", "dist-packages"}
    outer = [p for p in sys.path if sites & set(Path(p).parts) and Path(p).is_dir()]
    Path(site.stdout.strip(), "outer.pth").write_text("".join(f"{p}\n" for p in outer))
    return python


MUSTER_WORKS = (
    "import muster.shared.jobconfig as j, muster.services.validator.service as v, sys; "
    "assert j.__file__.startswith(sys.prefix), j.__file__; "
    "assert v.__file__.startswith(sys.prefix), v.__file__; "
    "import importlib.metadata as m; print('muster', m.version('muster'))"
)
OTHER_WORKS = (
    "import shared.jobconfig, services.validator; "
    "assert shared.jobconfig.OWNER == services.validator.OWNER == 'other'; print('other ok')"
)


def test_the_wheel_owns_only_muster(wheels: dict[str, Path]) -> None:
    """Every file of Muster's wheel lies under muster/ or its .dist-info: no top-level
    `shared`/`services` to overwrite another project's (or to be deleted with it)."""
    import zipfile

    with zipfile.ZipFile(wheels["muster"]) as wheel:
        tops = {name.split("/")[0] for name in wheel.namelist()}
    assert tops == {"muster", f"muster-{VERSION}.dist-info"}, tops
    with zipfile.ZipFile(wheels["muster"]) as wheel:
        assert "muster/services/agent/muster_rsh.py" in wheel.namelist()  # read beside rsh.py
        assert "muster/__init__.py" not in wheel.namelist()  # a namespace: no file to collide on


@pytest.mark.parametrize("first", ["muster", "other"])
def test_muster_and_a_package_with_top_level_shared_services(
    tmp_path: Path, wheels: dict[str, Path], first: str
) -> None:
    python = fresh_venv(tmp_path / "venv")
    order = [first, "other" if first == "muster" else "muster"]
    for name in order:
        pip("--python", python, "install", "--no-deps", "--no-index", wheels[name], cwd=tmp_path)

    r = run([python, "-c", MUSTER_WORKS], tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"muster {VERSION}", r.stderr
    r = run([python, "-c", OTHER_WORKS], tmp_path)
    assert r.returncode == 0, r.stderr
    r = run([tmp_path / "venv" / "bin" / "muster", "--version"], tmp_path)
    assert (r.returncode, r.stdout) == (0, f"muster {VERSION}\n"), r.stderr

    # Uninstalling the other project takes its files only.
    pip("--python", python, "uninstall", "-y", "other-shared-services", cwd=tmp_path)
    r = run([python, "-c", MUSTER_WORKS], tmp_path)
    assert r.returncode == 0, r.stderr
    r = run([python, "-c", "import shared"], tmp_path)
    assert r.returncode != 0 and "No module named 'shared'" in r.stderr, r.stderr


@pytest.mark.parametrize("install", ["editable", "wheel"])
def test_a_service_starts_from_a_directory_with_its_own_shared(
    tmp_path: Path, wheels: dict[str, Path], install: str
) -> None:
    """`python -m muster.services.validator --help` where the working directory (first on
    sys.path with -m) has a `shared/` and a `services/` of its own that cannot be imported."""
    work = tmp_path / "project"
    for name in ("shared", "services"):
        (work / name).mkdir(parents=True)
        (work / name / "__init__.py").write_text(f"raise ImportError('the project\\'s own {name}')\n")
    if install == "editable":
        python = Path(sys.executable)  # this venv: Muster installed editable from the checkout
    else:
        python = fresh_venv(tmp_path / "venv")
        pip("--python", python, "install", "--no-deps", "--no-index", wheels["muster"], cwd=tmp_path)
    r = run([python, "-m", "muster.services.validator", "--help"], work)
    assert r.returncode == 0, r.stderr
    assert "Muster validator" in r.stdout


def test_every_package_is_listed() -> None:
    """pyproject's explicit package list names every folder of shared/ and services/ that has an
    __init__.py (a new service's folder would otherwise be left out of the wheel)."""
    found = {
        "muster." + ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("shared", "services")
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]) == found
