"""End to end: the services image (deploy/build-image.sh) and docker-compose.yml.

Builds muster/muster, brings up the compose project without the agent (3 NATS servers with
authentication on, two replicas of every service), submits as the stack's admin through nats-1's
published port, checks the job waits for
nodes, then kills a validator and submits again; and scales the demo agent to 3 (one host network)
and sees 3 distinct nodes alive, also with nats-1 stopped. Needs a Docker engine and Compose (v2's
`docker compose` or Debian's `docker-compose`); skipped without them."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shared import auth, bus, client, subjects
from shared.messages import JobRecord, JobState, NodeInfo, Verdict

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
# Everything but the agent (host network, Docker socket): replicas expected of each.
EXPECTED = {"nats-1": 1, "nats-2": 1, "nats-3": 1}
EXPECTED.update(validator=2, scheduler=2, registry=2, supervisor=2, gateway=2)

pytestmark = pytest.mark.docker


def _run(cmd: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def compose_command() -> list[str] | None:
    """`docker compose` (v2) if the plugin is there, else `docker-compose` (v1), else None."""
    try:
        if _run(["docker", "compose", "version"], timeout=20).returncode == 0:
            return ["docker", "compose"]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return ["docker-compose"] if shutil.which("docker-compose") else None


@pytest.fixture(scope="session")
def compose() -> list[str]:
    if not shutil.which("docker"):
        pytest.skip("no docker CLI")
    try:
        engine = _run(["docker", "info"], timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        engine = False
    if not engine:
        pytest.skip("no Docker engine answers (start dockerd)")
    cmd = compose_command()
    if cmd is None:
        pytest.skip("no Compose: install Debian's docker-compose (apt-get install -y docker-compose)")
    return cmd


@pytest.fixture(scope="session")
def muster_image(compose: list[str]) -> Iterator[str]:
    """The services image, built (or found up to date) by deploy/build-image.sh, under a tag of
    this session's own so that a concurrent rebuild cannot swap it under the test."""
    proc = _run([str(ROOT / "deploy" / "build-image.sh")], timeout=540)
    if proc.returncode == 2:
        pytest.skip(f"cannot build the image: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, f"deploy/build-image.sh failed:\n{proc.stderr}"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    tag = f"musterdeploytest/muster:{uuid.uuid4().hex[:10]}"
    assert _run(["docker", "tag", f"muster/muster:{version}", tag]).returncode == 0
    yield tag
    _run(["docker", "rmi", tag])  # only the tag: the image stays


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    compose: list[str]
    project: str
    env: dict[str, str]
    url: str  # nats-1
    urls: str  # every NATS server, as a client's MUSTER_NATS_URL
    auth: Path  # the identities the `keys` service made

    async def connect(self, name: str, url: str):
        """A client as the stack's admin (the one identity this host's CLI has)."""
        creds = auth.load_credentials(self.auth / "creds" / "admin.creds")
        return await bus.connect(name, url, connect_timeout=30, quiet=True, credentials=creds)

    def run(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        cmd = [*self.compose, "-p", self.project, "-f", str(COMPOSE_FILE), *args]
        return _run(cmd, timeout=timeout, env=self.env, cwd=ROOT)

    def containers(self, service: str | None = None) -> list[dict]:
        """`docker inspect` of the project's containers (of one service), running or not."""
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        ids = _run(["docker", "ps", "-aq", *filters]).stdout.split()
        return json.loads(_run(["docker", "inspect", *ids]).stdout) if ids else []

    def logs(self) -> str:
        out = self.run("logs", "--no-color", "--tail", "25", timeout=60)
        return (out.stdout + out.stderr)[-12000:]

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            healthy: dict[str, int] = {}
            states = []
            for c in self.containers():
                service = c["Config"]["Labels"]["com.docker.compose.service"]
                health = (c["State"].get("Health") or {}).get("Status", c["State"]["Status"])
                states.append(f"{c['Name'].lstrip('/')}: {health}")
                healthy[service] = healthy.get(service, 0) + (health == "healthy")
            if all(healthy.get(s, 0) >= n for s, n in EXPECTED.items()):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"not all healthy after {timeout:g}s: {states}\n{self.logs()}")
            time.sleep(1)

    def scrape(self, container: dict, name: str) -> float | None:
        """One metric of one replica, read from inside its container."""
        code = (
            "import urllib.request as u; "
            "print(u.urlopen('http://127.0.0.1:9100/metrics', timeout=3).read().decode())"
        )
        out = _run(["docker", "exec", container["Id"], "python3", "-c", code]).stdout
        for line in out.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return None


@pytest.fixture
def stack(compose: list[str], muster_image: str, tmp_path: Path) -> Iterator[Stack]:
    project = f"musterdeploytest{uuid.uuid4().hex[:8]}"
    ports = [free_port() for _ in range(3)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    # The demo agents' node names, unique (agents act on task containers labelled with them),
    # known before `keys` makes their identities.
    env.update(MUSTER_IMAGE=muster_image, MUSTER_AUTH_DIR=str(tmp_path / "auth"))
    env.update(MUSTER_AGENT_NODE=f"mdt{uuid.uuid4().hex[:6]}")
    env.update(
        MUSTER_NATS_PORT=str(ports[0]), MUSTER_NATS_PORT_2=str(ports[1]), MUSTER_NATS_PORT_3=str(ports[2])
    )
    urls = [f"nats://127.0.0.1:{p}" for p in ports]
    s = Stack(compose, project, env, urls[0], ",".join(urls), tmp_path / "auth")
    try:
        up = s.run("up", "-d", *EXPECTED)
        assert up.returncode == 0, f"compose up failed:\n{up.stderr[-4000:]}\n{s.logs()}"
        s.wait_healthy(120)
        yield s
    finally:
        down = s.run("down", "-v", "--remove-orphans", "-t", "5", timeout=120)
        assert down.returncode == 0, f"compose down failed:\n{down.stderr[-4000:]}"


def job_config(name: str) -> bytes:
    role = dict(name="worker", taskNumber=2, cpuNumber=1, memoryMB=256, gpuNumber=0, command="true")
    config = dict(jobName=f"{name}-{uuid.uuid4().hex[:6]}", image="muster/base:bookworm", taskRoles=[role])
    return json.dumps(config).encode()


async def submit(nc, name: str, stack: Stack) -> Verdict:
    _, verdict = await client.submit(nc, job_config(name), user="compose-test", timeout=30)
    assert verdict is not None, f"no verdict within 30 s\n{stack.logs()}"
    assert verdict.accepted, verdict.errors
    return verdict


async def waiting_for_nodes(nc, job_id: str, stack: Stack) -> JobRecord:
    """The job's record once the active scheduler has given its reason (no agent runs). A stack
    just up on a loaded machine may take a while to elect and sync its scheduler: 60 s."""
    kv = await nc.jetstream(timeout=10).key_value(subjects.JOBS_BUCKET)
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        record = JobRecord.from_bytes((await kv.get(job_id)).value)
        if "no nodes" in record.reason or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.3)
    assert record.state == JobState.WAITING, record
    assert "no nodes" in record.reason, f"{record.reason!r}\n{stack.logs()}"
    return record


@pytest.mark.timeout(720)
async def test_compose_stack_accepts_jobs_and_survives_a_dead_validator(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # client.submit declares the streams: with the cluster's replica count, not a downgrade to 1.
    monkeypatch.setenv("MUSTER_JS_REPLICAS", "3")
    with pytest.raises(ConnectionError, match="Authorization"):  # no credentials, no way in
        await bus.connect("stranger", stack.url, connect_timeout=5, quiet=True)
    nc = await stack.connect("test-compose", stack.url)
    try:
        js = nc.jetstream(timeout=10)
        for stream in (subjects.SUBMISSIONS_STREAM, subjects.EVENTS_STREAM, subjects.COMMANDS_STREAM):
            info = await js.stream_info(stream)
            assert info.config.num_replicas == 3, (stream, info.config.num_replicas)

        first = await submit(nc, "compose-first", stack)
        await waiting_for_nodes(nc, first.job_id, stack)

        # Exactly one scheduler is the active leader; the other stands by.
        leaders = sorted(stack.scrape(c, "muster_scheduler_leader") for c in stack.containers("scheduler"))
        assert leaders == [0.0, 1.0], leaders

        victim, survivor = stack.containers("validator")
        assert _run(["docker", "kill", victim["Id"]]).returncode == 0
        second = await submit(nc, "compose-second", stack)
        assert second.job_id != first.job_id
        await waiting_for_nodes(nc, second.job_id, stack)
        states = {c["Id"]: c["State"]["Running"] for c in stack.containers("validator")}
        assert states == {victim["Id"]: False, survivor["Id"]: True}, states
    finally:
        await nc.close()


async def alive_nodes(nc, names: set[str], timeout: float) -> dict[str, NodeInfo]:
    """The node records of `names` once each has been rewritten (a heartbeat) since first seen."""
    kv = await nc.jetstream(timeout=10).key_value(subjects.NODES_BUCKET)
    first: dict[str, int] = {}
    latest: dict[str, NodeInfo] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in names:
            try:
                entry = await kv.get(name)
            except Exception:  # not registered yet, or the bus is electing a leader
                continue
            first.setdefault(name, entry.revision)
            if entry.revision > first[name]:
                latest[name] = NodeInfo.from_bytes(entry.value)
        if set(latest) == names:
            return latest
        await asyncio.sleep(0.5)
    raise AssertionError(f"alive: {sorted(latest)}, seen: {sorted(first)}, expected {sorted(names)}")


@pytest.mark.timeout(720)
async def test_scaled_agents_are_distinct_nodes_and_survive_a_dead_nats_server(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--scale agent=3` on one host network: three node names, three metrics ports, no restarts;
    clients and agents given every server carry on without nats-1."""
    monkeypatch.setenv("MUSTER_JS_REPLICAS", "3")
    node = stack.env["MUSTER_AGENT_NODE"]
    low = free_port()
    stack.env.update(
        MUSTER_DATA_DIR=str(tmp_path / "agents"),
        MUSTER_AGENT_METRICS_PORT=f"{low}-{min(low + 40, 65535)}",
    )
    up = stack.run("up", "-d", "--scale", "agent=3", "agent")
    assert up.returncode == 0, f"compose up failed:\n{up.stderr[-4000:]}\n{stack.logs()}"
    names = {node, f"{node}-2", f"{node}-3"}

    nc = await stack.connect("test-compose", stack.urls)
    try:
        nodes = await alive_nodes(nc, names, 90)
        assert len({n.agent_id for n in nodes.values()}) == 3

        # Healthy by their healthchecks, each on a port of its own, never restarted.
        deadline = time.monotonic() + 90
        while True:
            agents = stack.containers("agent")
            health = [(c["State"].get("Health") or {}).get("Status") for c in agents]
            if health == ["healthy"] * 3 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert health == ["healthy"] * 3, f"{health}\n{stack.logs()}"
        assert [c["RestartCount"] for c in agents] == [0, 0, 0], stack.logs()
        ports = set()
        for c in agents:
            out = _run(["docker", "exec", c["Id"], "cat", "/tmp/muster-agent-metrics-port"])
            ports.add(int(out.stdout))
        assert len(ports) == 3 and all(low <= p <= low + 40 for p in ports), ports

        # nats-1 down: the agents (given all three servers) keep beating, and a client given all
        # three connects.
        (nats1,) = stack.containers("nats-1")
        assert _run(["docker", "stop", "-t", "5", nats1["Id"]]).returncode == 0
        await nc.close()
        nc = await stack.connect("test-compose-2", stack.urls)
        assert nc.connected_url.port != int(stack.env["MUSTER_NATS_PORT"])
        await alive_nodes(nc, names, 90)
        assert [c["RestartCount"] for c in stack.containers("agent")] == [0, 0, 0], stack.logs()
    finally:
        await nc.close()
