"""Shared fixtures: a real nats-server with JetStream on a free port, and Muster services run as
real processes (so tests can SIGKILL them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.natsserver import NatsServer

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "conformance" / "openpai-v1"


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    with NatsServer(tmp_path / "nats") as server:
        yield server


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


class Procs:
    """Muster service processes started by a test; all killed at teardown."""

    def __init__(self, url: str, log_dir: Path):
        self.url, self.log_dir, self.procs = url, log_dir, []

    def env(self) -> dict[str, str]:
        return {**os.environ, "MUSTER_NATS_URL": self.url, "PYTHONUNBUFFERED": "1"}

    def start(self, module: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{module.rsplit('.', 1)[-1]}-{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], env=self.env(), stdout=log, stderr=subprocess.STDOUT
        )
        self.procs.append(proc)
        return proc

    def cli(
        self, *args: str, timeout: float = 60, input: bytes | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "services.cli.main", *args],
            env=self.env(),
            capture_output=True,
            text=input is None,
            input=input,
            timeout=timeout,
        )

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(10)


@pytest.fixture
def procs(nats_url: str, tmp_path: Path) -> Iterator[Procs]:
    p = Procs(nats_url, tmp_path)
    yield p
    p.stop_all()
