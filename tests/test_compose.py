"""End to end: the services image (deploy/build-image.sh) and docker-compose.yml.

Builds muster/muster, brings up the compose project without the agent (3 NATS servers with
authentication on, two replicas of every service), submits as the stack's admin through nats-1's
published port, checks the job waits for
nodes, then kills a validator and submits again; and scales the demo agent to 3 (one host network)
and sees 3 distinct nodes alive, also with nats-1 stopped. Needs a Docker engine and Compose (v2's
`docker compose` or Debian's `docker-compose`); skipped without them."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.js.errors import KeyNotFoundError

from muster.shared import auth, bus, client, liveness, subjects
from muster.shared.messages import JobRecord, JobState, KillRequest, NodeInfo, Verdict
from muster.shared.natsserver import free_port

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
# Everything but the agent (host network, Docker socket): replicas expected of each.
EXPECTED = {"nats-1": 1, "nats-2": 1, "nats-3": 1}
EXPECTED.update(validator=2, scheduler=2, registry=2, supervisor=2, gateway=2, portal=2)

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


def test_a_second_build_of_the_image_waits_for_the_first(muster_image: str, tmp_path: Path) -> None:
    """Two builds at once broke one another (the first one's prune of its dangling install stage
    removed the layer the second was building on): a build waits while another holds the lock,
    then finds the image built."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the lock, and nothing else, is this test's own
    with (tmp_path / "muster-build-image.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        build = subprocess.Popen(
            [str(ROOT / "deploy" / "build-image.sh")], env=env, stderr=subprocess.PIPE, text=True
        )
        with contextlib.suppress(subprocess.TimeoutExpired):
            build.wait(timeout=10)  # up to date, it would be done in a second or two
        assert build.returncode is None, "it ran while another build held the lock"
    _, err = build.communicate(timeout=300)
    assert build.returncode == 0 and "is up to date" in err, err


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

    def logs(self, tail: int = 25) -> str:
        """The last lines of each service, one service at a time: the NATS servers' first (their
        route chatter says least), the agents' last and longest (a report cut short keeps its
        end, and a job that does not start is most often told of there)."""
        names = {c["Config"]["Labels"]["com.docker.compose.service"] for c in self.containers()}

        def rank(name: str) -> tuple[int, str]:
            return (0 if re.fullmatch(r"nats-\d+", name) else 2 if name == "agent" else 1, name)

        parts = []
        for name in sorted(names, key=rank):
            lines, chars = (3 * tail, 8000) if name == "agent" else (tail, 1500)
            out = self.run("logs", "--no-color", "--tail", str(lines), name, timeout=60)
            parts.append((out.stdout + out.stderr)[-chars:])
        return "\n".join(parts)[-24000:]

    def wait_healthy(self, timeout: float, expected: dict[str, int] | None = None) -> None:
        deadline = time.monotonic() + timeout
        while True:
            healthy: dict[str, int] = {}
            states = []
            for c in self.containers():
                service = c["Config"]["Labels"]["com.docker.compose.service"]
                health = (c["State"].get("Health") or {}).get("Status", c["State"]["Status"])
                states.append(f"{c['Name'].lstrip('/')}: {health}")
                healthy[service] = healthy.get(service, 0) + (health == "healthy")
            if all(healthy.get(s, 0) >= n for s, n in (expected or EXPECTED).items()):
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


@contextmanager
def bring_up(
    compose: list[str],
    muster_image: str,
    tmp_path: Path,
    extra: dict[str, int] | None = None,
    env: dict[str, str] | None = None,
    profiles: tuple[str, ...] = (),
    also: tuple[str, ...] = (),
) -> Iterator[Stack]:
    """A compose project of its own with EXPECTED (and `extra`) services healthy, and `also`
    (services without a healthcheck) started; taken down after."""
    project = f"musterdeploytest{uuid.uuid4().hex[:8]}"
    ports = [free_port() for _ in range(3)]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    # The demo agents' node names, unique (agents act on task containers labelled with them),
    # known before `keys` makes their identities.
    environ.update(MUSTER_IMAGE=muster_image, MUSTER_AUTH_DIR=str(tmp_path / "auth"))
    environ.update(MUSTER_AGENT_NODE=f"mdt{uuid.uuid4().hex[:6]}")
    environ.update(
        MUSTER_NATS_PORT=str(ports[0]), MUSTER_NATS_PORT_2=str(ports[1]), MUSTER_NATS_PORT_3=str(ports[2])
    )
    environ.update(MUSTER_PORTAL_PORT=str(free_port()))
    environ.update(env or {})
    urls = [f"nats://127.0.0.1:{p}" for p in ports]
    s = Stack(compose, project, environ, urls[0], ",".join(urls), tmp_path / "auth")
    expected = {**EXPECTED, **(extra or {})}
    chosen = [arg for p in profiles for arg in ("--profile", p)]
    try:
        up = s.run(*chosen, "up", "-d", *expected, *also, timeout=600)
        assert up.returncode == 0, f"compose up failed:\n{up.stderr[-4000:]}\n{s.logs()}"
        s.wait_healthy(120, expected)
        yield s
    finally:
        # Under load Docker (20.10) may keep a removed container's endpoint on the project's
        # network for a while, or for good: `down` then fails at the very end, every container
        # gone. Asked again; an empty network left behind is not this test's failure.
        for _ in range(3):
            down = s.run(*chosen, "down", "-v", "--remove-orphans", "-t", "5", timeout=120)
            stale = "has active endpoints" in down.stderr and not s.containers()
            if down.returncode == 0 or not stale:
                break
            time.sleep(2)
        # Task containers outlive their agents (by design: an agent restarts and adopts them),
        # so the ones this stack's agents started go with it (a failed test left a 10-minute one).
        node = environ["MUSTER_AGENT_NODE"]
        shown = '{{.ID}} {{.Label "muster.node"}}'
        listed = ["docker", "ps", "-a", "--filter", "label=muster.node", "--format", shown]
        for line in _run(listed).stdout.splitlines():
            c, _, found = line.partition(" ")
            if found == node or found.startswith(f"{node}-"):
                _run(["docker", "rm", "-f", c])
        assert down.returncode == 0 or stale, f"compose down failed:\n{down.stderr[-4000:]}"


@pytest.fixture
def stack(compose: list[str], muster_image: str, tmp_path: Path) -> Iterator[Stack]:
    with bring_up(compose, muster_image, tmp_path) as s:
        yield s


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
    record = None
    while True:
        with contextlib.suppress(KeyNotFoundError):  # a replica that has not the write yet
            record = JobRecord.from_bytes((await kv.get(job_id)).value)
        if (record and "no nodes" in record.reason) or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.3)
    assert record is not None, f"no record of {job_id}\n{stack.logs()}"
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
    await portal_serves_a_user(stack)


async def portal_serves_a_user(stack: Stack) -> None:
    """The portal's two replicas on the one documented port: a user added with `muster admin
    user add` signs in with the login secret it printed, submits, and sees only their own jobs;
    a request without a session gets nothing."""
    import httpx

    port = stack.env["MUSTER_PORTAL_PORT"]
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    added = _run(
        [
            sys.executable,
            "-m",
            "muster.services.cli.main",
            "admin",
            "user",
            "add",
            "carol",
            "--auth-dir",
            str(stack.auth),
        ],
        env=env,
    )
    assert added.returncode == 0, added.stderr
    secret = re.search(r"login secret \(shown once\): (\S+)", added.stdout)[1]
    reload = stack.run("kill", "-s", "HUP", "nats-1", "nats-2", "nats-3")
    assert reload.returncode == 0, reload.stderr
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        assert (await http.get("/api/jobs")).status_code == 401
        assert (await http.get("/login")).status_code == 200
        r = await http.post("/login", data={"name": "carol", "secret": secret})
        assert r.status_code == 303, r.text[-500:]
        token = (await http.get("/api/whoami")).json()["form_token"]
        deadline = time.monotonic() + 60
        while True:  # the servers reload the identities: carol's key is known once they have
            r = await http.post(
                "/api/submit",
                content=job_config("portal"),
                headers={"X-Muster-Form": token, "Content-Type": "application/json"},
            )
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        assert r.status_code == 200 and r.json()["accepted"], (
            f"{r.status_code} {r.text[-1000:]}\n{stack.logs()}"
        )
        # The gateway lists from its mirror of the jobs bucket, which hears of the record a moment
        # after the validator's verdict (three clustered servers here): listed once it has.
        deadline = time.monotonic() + 30
        while not (listed := (await http.get("/api/jobs")).json()["jobs"]) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert [j["job_id"] for j in listed] == [r.json()["job_id"]]  # carol's only, not compose-test's


async def alive_nodes(nc, names: set[str], timeout: float) -> dict[str, NodeInfo]:
    """The node records of `names` once each is registered and has beaten since the call. Beats
    are core NATS messages every 2 s; a record is rewritten only on a change, after a
    reconnect and every MUSTER_NODE_REFRESH (a minute), so waiting for a rewrite took up to that."""
    heard: set[str] = set()
    await liveness.listen(nc, lambda node, _: heard.add(node))
    kv = None
    latest: dict[str, NodeInfo] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if kv is None:
            # With a server just gone the cluster elects its leaders anew: the bucket's stream
            # info may not answer for a while (a 10 s timeout once, on a loaded CI machine).
            with contextlib.suppress(Exception):
                kv = await nc.jetstream(timeout=10).key_value(subjects.NODES_BUCKET)
        # An agent registers before it beats: its record is the current one.
        if kv is not None and names <= heard:
            for name in names - latest.keys():
                try:
                    latest[name] = NodeInfo.from_bytes((await kv.get(name)).value)
                except Exception:  # the bus is electing a leader
                    continue
            if set(latest) == names:
                return latest
        await asyncio.sleep(0.5)
    beating = sorted(heard & names)
    raise AssertionError(f"registered: {sorted(latest)}, beating: {beating}, expected {sorted(names)}")


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


class Prometheus:
    """The real Prometheus of a stack, asked through its HTTP API."""

    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict]:
        """The result of an instant query; fails the test on an error status (a query that does
        not parse or cannot run). Retries a refused connection (Prometheus is starting)."""
        import httpx

        for _ in range(30):
            try:
                answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
                break
            except (httpx.TransportError, ValueError):
                time.sleep(1)
        else:
            pytest.fail(f"Prometheus at {self.url} does not answer")
        assert answer.get("status") == "success", f"{expr}: {answer}"
        return answer["data"]["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait(self, expected: dict[str, float], timeout: float, stack: Stack) -> None:
        """Until each query's single value is as expected (polled: scrapes come every 2 s, but a
        loaded machine may be slower), or fail naming what differed."""
        deadline = time.monotonic() + timeout
        while True:
            got = {expr: self.value(expr) for expr in expected}
            if got == expected:
                return
            if time.monotonic() > deadline:
                wrong = {e: (got[e], want) for e, want in expected.items() if got[e] != want}
                pytest.fail(f"after {timeout:g}s, (got, expected): {wrong}\n{stack.logs()}")
            time.sleep(1)


def prometheus_config(tmp_path: Path) -> Path:
    """deploy/prometheus.yml, scraping every 2 s instead of 15 (the test's pace, not production's)."""
    text = (ROOT / "deploy" / "prometheus.yml").read_text()
    text = re.sub(
        r"(scrape_interval|evaluation_interval|refresh_interval|scrape_timeout): \d+s", r"\1: 2s", text
    )
    path = tmp_path / "prometheus.yml"
    path.write_text(text)
    return path


def gpu_job(name: str, tasks: int, gpus: int, command: str, metrics: tuple[str, ...] = ()) -> bytes:
    role = dict(name="worker", taskNumber=tasks, cpuNumber=1, memoryMB=256, gpuNumber=gpus, command=command)
    name = f"{name}-{uuid.uuid4().hex[:6]}"
    config = dict(jobName=name, image="muster/base:bookworm", taskRoles=[role], metrics=metrics)
    return json.dumps(config).encode()


@pytest.mark.timeout(900)
async def test_prometheus_sees_the_cluster(
    compose: list[str], muster_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `monitoring` profile: the real Prometheus (Debian's, built on the local base image)
    scrapes every service replica (compose DNS), the NATS exporter and 3 scaled agents (target
    file), and reads the cluster's numbers right: GPUs total/allocated/free, jobs by state. Its
    config passes `promtool check config` where it runs, and every dashboard query runs on it."""
    from tests.test_monitoring import dashboard_queries

    monkeypatch.setenv("MUSTER_JS_REPLICAS", "3")
    agents_dir = tmp_path / "prometheus-agents"
    agents_dir.mkdir()
    low, port = free_port(), free_port()
    env = dict(
        MUSTER_PROMETHEUS_PORT=str(port),
        MUSTER_PROMETHEUS_CONFIG=str(prometheus_config(tmp_path)),
        MUSTER_PROMETHEUS_AGENTS=str(agents_dir),
        MUSTER_DATA_DIR=str(tmp_path / "agents"),
        MUSTER_AGENT_METRICS_PORT=f"{low}-{min(low + 40, 65535)}",
        MUSTER_AGENT_GPUS="2xT4",  # declared: 3 agents, 6 GPUs (no device is requested for them)
    )
    with bring_up(
        compose,
        muster_image,
        tmp_path,
        extra={"nats-exporter": 1},
        env=env,
        profiles=("monitoring",),
        also=("prometheus",),
    ) as stack:
        (prom,) = stack.containers("prometheus")
        check = _run(
            ["docker", "exec", prom["Id"], "promtool", "check", "config", "/etc/prometheus/prometheus.yml"]
        )
        assert check.returncode == 0, check.stdout + check.stderr

        up = stack.run("up", "-d", "--scale", "agent=3", "agent")
        assert up.returncode == 0, f"compose up failed:\n{up.stderr[-4000:]}\n{stack.logs()}"
        node = stack.env["MUSTER_AGENT_NODE"]
        nc = await stack.connect("test-monitoring", stack.urls)
        try:
            await alive_nodes(nc, {node, f"{node}-2", f"{node}-3"}, 120)
            # No target file: Prometheus finds the agents through the supervisor's /sd/agents.
            prometheus = Prometheus(f"http://127.0.0.1:{port}")
            replicas = {
                f'count(up{{job="{s}"}} == 1)': float(n)
                for s, n in EXPECTED.items()
                if "nats" not in s and s != "portal"  # the portal: on the host's 127.0.0.1
            }
            prometheus.wait(
                {
                    **replicas,
                    'count(up{job="agent"} == 1)': 3.0,
                    f'count(up{{job="agent", node=~"{node}|{node}-2|{node}-3"}} == 1)': 3.0,
                    'count(up{job="nats"} == 1)': 1.0,
                    "sum(muster_nats_server_up)": 3.0,
                    "sum(muster_scheduler_leader)": 1.0,
                    'sum(muster_nodes{status="alive"})': 3.0,
                    "sum(muster_gpus)": 6.0,
                    'sum(muster_gpus{model="T4"})': 6.0,
                    "sum(muster_gpus_allocated)": 0.0,
                },
                180,
                stack,
            )

            # A job that holds 2 GPUs until killed, and one that succeeds.
            user = "compose-test"
            holding = gpu_job("hold", 2, 1, "echo accuracy=0.93; sleep 600", ("accuracy",))
            _, held = await client.submit(nc, holding, user=user, timeout=30)
            _, done = await client.submit(nc, gpu_job("done", 2, 0, "true"), user=user, timeout=30)
            assert held is not None and held.accepted and done is not None and done.accepted, (held, done)
            prometheus.wait(
                {
                    'sum(muster_jobs{state="RUNNING"})': 1.0,
                    'sum(muster_jobs{state="SUCCEEDED"})': 1.0,
                    'sum(muster_jobs{state="WAITING"})': 0.0,
                    "sum(muster_queue_jobs)": 0.0,
                    "sum(muster_gpus_allocated)": 2.0,
                    "sum(muster_gpus_free)": 4.0,
                    'sum(muster_validator_verdicts_total{verdict="accepted"})': 2.0,
                    # The training metric the held job printed, from its two tasks' agents.
                    'count(muster_task_metric{metric="accuracy"} == 0.93)': 2.0,
                },
                180,
                stack,
            )

            request = KillRequest(job_id=held.job_id, user=user, grace=1)
            await nc.jetstream(timeout=10).publish(subjects.kill_request(user), request.to_bytes())
            prometheus.wait(
                {
                    'sum(muster_jobs{state="RUNNING"})': 0.0,
                    'sum(muster_jobs{state="STOPPED"})': 1.0,
                    "sum(muster_gpus_allocated)": 0.0,
                    "sum(muster_gpus_free)": 6.0,
                },
                120,
                stack,
            )
        finally:
            await nc.close()

        # Every dashboard query runs on the real Prometheus; those the cluster has had data for
        # return some (the training-metric gauge went with its killed job). A rate or increase
        # needs two scrapes of a series in its window: a counter first seen at the kill may take
        # a scrape interval (15 s) or two, so each query is asked again until it has data.
        quiet = {"Training metrics", "Retries by classification", "Messages rejected", "Redeliveries"}
        has_data: dict[str, bool] = {}
        deadline = time.monotonic() + 90
        while True:
            for title, expr in dashboard_queries():
                has_data[title] = has_data.get(title, False) or bool(prometheus.query(expr))
            no_data = {title for title, data in has_data.items() if not data}
            if no_data <= quiet or time.monotonic() > deadline:
                break
            await asyncio.sleep(5)
        assert no_data <= quiet, f"panels without data: {sorted(no_data - quiet)}"
