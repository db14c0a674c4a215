"""Shared fixtures: a real nats-server with JetStream on a free port, and Muster services run as
real processes (so tests can SIGKILL them)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from muster.shared.natsserver import NatsServer

ROOT = Path(__file__).resolve().parents[1]
# OpenPAI's example job configs, kept in the repo (tests/data/openpai-v1/README.md).
CORPUS = ROOT / "tests" / "data" / "openpai-v1"


BASE_IMAGE = os.environ.get("MUSTER_BASE_IMAGE", "muster/base:bookworm")
# Jobs of the tests mount the repo's examples and their own temporary directories.
os.environ.setdefault("MUSTER_DATA_ROOTS", f"{ROOT},{tempfile.gettempdir()}")


@pytest.fixture(scope="session")
def base_image() -> str:
    """The local base image (deploy/build-base-image.sh); skips when there is no Docker engine."""
    from muster.services.agent.docker_runtime import DockerRuntime

    if not DockerRuntime.available():
        pytest.skip("no Docker engine answers a ping (start dockerd)")
    proc = subprocess.run(
        [str(ROOT / "deploy" / "build-base-image.sh")], capture_output=True, text=True, timeout=600
    )
    if proc.returncode == 2:
        pytest.skip(f"cannot build {BASE_IMAGE}: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, f"build-base-image.sh failed:\n{proc.stderr}"
    return BASE_IMAGE


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
        # Tasks of the process runtime find this environment's python3 (and torch) first.
        path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        return {**os.environ, "MUSTER_NATS_URL": self.url, "PYTHONUNBUFFERED": "1", "PATH": path}

    def start(self, module: str, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
        log_path = self.log_dir / f"{module.rsplit('.', 1)[-1]}-{len(self.procs)}.log"
        log = open(log_path, "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", module, *args],
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        proc.log_path = log_path  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def cli(
        self, *args: str, timeout: float = 60, input: bytes | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "muster.services.cli.main", *args],
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


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> Callable[[], int]:
    """Count the calls of `owner`'s async method `name` (still made); returns how many so far."""
    real, calls = getattr(owner, name), [0]

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return await real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return lambda: calls[0]


async def lagging(js: Any, *buckets: str) -> dict[str, Any]:
    """Handles on `buckets` whose direct reads find nothing, as from a replica of a replicated
    bucket that has not applied the newest writes (the seam for a lag no test can make on
    demand); their writes, and reads through the stream's leader, go to the real server."""
    from nats.js.errors import KeyNotFoundError

    async def behind(key: str, *args: object, **kwargs: object) -> object:
        raise KeyNotFoundError

    handles = {}
    for name in buckets:
        handles[name] = await js.key_value(name)
        handles[name].get = behind
    return handles


async def stored(js: Any, subject: str, stream: str = "MUSTER_EVENTS", wait: float = 10.0) -> list[Any]:
    """Every message `stream` holds on `subject` (a filter) now, in order: as many as the stream
    says it holds, each given `wait` seconds. Not "until none comes for a moment": a loaded
    machine's first delivery can take longer than any such gap (an empty history, a failed test)."""
    info = await js.stream_info(stream, subjects_filter=subject)
    count = sum((info.state.subjects or {}).values())
    if not count:
        return []
    sub = await js.subscribe(subject, ordered_consumer=True)
    try:
        return [await sub.next_msg(timeout=wait) for _ in range(count)]
    finally:
        await sub.unsubscribe()


@pytest.fixture
def procs(nats_url: str, tmp_path: Path) -> Iterator[Procs]:
    p = Procs(nats_url, tmp_path)
    yield p
    p.stop_all()


CORE = (
    "muster.services.validator",
    "muster.services.scheduler",
    "muster.services.registry",
    "muster.services.supervisor",
    "muster.services.gateway",
)


class Cluster(Procs):
    """The control plane as separate processes plus agents, each killable on its own."""

    def core(self) -> Cluster:
        for module in CORE:
            self.start(module)
        return self

    def agent(self, node: str, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
        work = self.log_dir / "work"
        return self.start(
            "muster.services.agent",
            "--node",
            node,
            "--runtime",
            "process",
            "--work-root",
            str(work / node),
            "--output-root",
            str(self.log_dir / "output"),
            *args,
            prefix=prefix,
        )

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.log_dir.glob("*.log")))


@pytest.fixture
def cluster(nats_url: str, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(nats_url, tmp_path)
    yield c
    c.stop_all()


# ------------------------------------------------------------------ hosts of their own

NET = "198.18.0"  # a test network of our own (RFC 2544's benchmarking range)


def sh(*cmd: str, check: bool = True) -> None:
    subprocess.run(cmd, check=check, capture_output=True)


@pytest.fixture
def hosts():
    """Three hosts on one machine: network namespaces (ip netns) with addresses NET.1-3 on a
    bridge of their own (NET.254, where a test's NATS server listens). Needs root and iproute2."""
    tag = f"m{os.getpid() % 10000}"
    bridge = f"{tag}br"
    names = [f"{tag}h{i}" for i in (1, 2, 3)]
    sh("ip", "link", "add", bridge, "type", "bridge")
    sh("ip", "addr", "add", f"{NET}.254/24", "dev", bridge)
    sh("ip", "link", "set", bridge, "up")
    # Docker's FORWARD policy would drop bridged traffic when br_netfilter is loaded.
    if shutil.which("iptables"):
        sh("iptables", "-I", "FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT", check=False)
    for i, ns in enumerate(names, start=1):
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", f"{tag}v{i}", "type", "veth", "peer", "name", f"{tag}p{i}")
        sh("ip", "link", "set", f"{tag}v{i}", "master", bridge, "up")
        sh("ip", "link", "set", f"{tag}p{i}", "netns", ns)
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{NET}.{i}/24", "dev", f"{tag}p{i}")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", f"{tag}p{i}", "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
    try:
        yield [(ns, f"{NET}.{i}") for i, ns in enumerate(names, start=1)]
    finally:
        for i, ns in enumerate(names, start=1):
            sh("ip", "netns", "del", ns, check=False)
            sh("ip", "link", "del", f"{tag}v{i}", check=False)
        if shutil.which("iptables"):
            sh("iptables", "-D", "FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT", check=False)
        sh("ip", "link", "del", bridge, check=False)


# ------------------------------------------------------------------ running in parallel

# What needs the one Docker engine: run one at a time, in one worker (`pytest -n`, pytest-xdist's
# `--dist loadgroup`). Agents act on containers by their node labels, and the chaos test removes
# every task container; the rest (each with its own NATS server, ports and directories) is spread.
ENGINE_FIXTURES = frozenset({"base_image", "engine", "compose", "muster_image", "mpi_image", "torch_image"})


# Ports: each worker picks from its own slice (shared/natsserver.py `free_port`), and so does what
# it starts: two workers picked the same "free" port for two agents' metrics in CI.
_worker, _workers = (
    os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw"),
    os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"),
)
if _worker.isdigit():
    os.environ.setdefault("MUSTER_PORT_SLICE", f"{_worker}/{_workers}")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the node ids (--dist loadgroup)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("docker") or ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("docker"))
