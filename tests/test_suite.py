"""The suite's own plumbing: the README's test command (`-n 2 --dist loadgroup`) runs the tests
that use the Docker engine on one worker, one after another (tests/conftest.py). When that
grouping is lost, nothing fails at once: the engine's tests run on both workers side by side, and
one of them breaks now and then (in CI, two builds of the services image at once, one pruning
the other's layers). It was lost twice over: the conftest hook ran after pytest-xdist had read
the groups, and pytest 9.2's node ids undo xdist 3.8's grouping (pytest-dev/pytest-xdist#1386;
pyproject.toml keeps pytest below 9.2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import os
from pathlib import Path

import pytest


@pytest.mark.docker
@pytest.mark.parametrize("i", range(6))
def test_marked(i):
    (Path(os.environ["PROBE_OUT"]) / f"marked-{i}").write_text(os.environ["PYTEST_XDIST_WORKER"])


@pytest.mark.parametrize("i", range(6))
def test_engine_fixture(i, engine):
    (Path(os.environ["PROBE_OUT"]) / f"fixture-{i}").write_text(os.environ["PYTEST_XDIST_WORKER"])


@pytest.fixture
def engine():
    return None
"""


@pytest.mark.timeout(120)
def test_the_engines_tests_run_on_one_worker(tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    suite, out = tmp_path / "suite", tmp_path / "out"
    suite.mkdir()
    out.mkdir()
    hook = "from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n"
    (suite / "conftest.py").write_text(hook)
    (suite / "test_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PROBE_OUT": str(out)}
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        [*cmd, "-c", os.devnull, "--rootdir", str(suite), str(suite)],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = {p.name: p.read_text() for p in out.iterdir()}
    assert len(ran) == 12, ran
    assert len(set(ran.values())) == 1, f"the engine's tests ran on more than one worker: {ran}"
