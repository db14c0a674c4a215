"""A Muster cluster for benchmarks: an authenticated nats-server, each service as its own process
(as compose runs them, one identity each) and one process of simulated nodes (the sim runtime:
tasks "run" `extras.sim.seconds` and exit, nothing is started), or one real agent on the Docker
or the process runtime. Used by `bench.bus`, `bench.idle`, `bench.launch` and `bench.logflood`;
logs and data stay in the work directory for a look after a run.

CPU per process is read from /proc (utime + stime), so a figure is what that process burned,
whatever else runs on the machine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from nats.aio.client import Client as NATS

from muster.services.agent import sim
from muster.shared import auth, bus, subjects
from muster.shared.natsserver import NatsServer, die_with_parent, free_port

SERVICES = ("validator", "scheduler", "registry", "supervisor", "gateway")
DOCKER_NODE = "bench-docker"  # the one real agent of a `docker=True` mesh
PROCESS_NODE = "bench-process"  # the one real agent of a `process=True` mesh
BENCH_USER = "bench"  # an admin identity: it submits, and makes the floor's scratch stream
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a live process has used, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


class Mesh:
    """`with Mesh(workdir, nodes=1000) as mesh:` — started, then everything killed on exit.
    `docker=True`: one real agent (node `DOCKER_NODE`, Docker runtime) instead of the sim nodes;
    `process=True`: one on the process runtime (node `PROCESS_NODE`)."""

    def __init__(
        self,
        workdir: Path,
        nodes: int,
        gpus: str = "8xV100",
        cpus: int = 64,
        memory_mb: int = 262144,
        env: dict[str, str] | None = None,
        docker: bool = False,
        process: bool = False,
        sim_processes: int = 1,
        services: tuple[str, ...] = SERVICES,
        agents: bool = True,
    ) -> None:
        self.workdir, self.nodes, self.docker = workdir, 1 if docker or process else nodes, docker
        self.runtime = "docker" if docker else "process" if process else "sim"
        self.node = DOCKER_NODE if docker else PROCESS_NODE
        self.gpus, self.cpus, self.memory_mb = gpus, cpus, memory_mb
        self.extra_env = env or {}
        self.sim_processes = max(1, min(sim_processes, self.nodes))
        # `agents=False`: no agent process; the bench stands in for the nodes itself.
        self.services, self.agents = services, agents
        self.keys = auth.AuthDir(workdir / "auth")
        self.server: NatsServer | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # The sim nodes stand in for agents on other machines: their per-task files (orders, task
        # dirs, outbox) go to memory when it can, not to this machine's disk beside the services.
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else workdir
        self.scratch = Path(tempfile.mkdtemp(prefix="muster-bench-sim-", dir=base))

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def credentials(self, name: str = BENCH_USER) -> auth.Credentials:
        return auth.load_credentials(self.keys.creds(name))

    def __enter__(self) -> Mesh:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _env(self, identity: str) -> dict[str, str]:
        # Sim nodes beat as real agents do (every 2 s), so the node timeout is the default one.
        beat = sim.heartbeat_for(self.nodes, None)
        return {
            **os.environ,
            "MUSTER_NATS_URL": self.url,
            "MUSTER_CREDENTIALS": str(self.keys.creds(identity)),
            "MUSTER_DATA_DIR": str(self.workdir / "data"),
            "MUSTER_NODE_TIMEOUT": str(sim.node_timeout_for(beat)),
            "MUSTER_LOG_LEVEL": os.environ.get("MUSTER_LOG_LEVEL", "warning"),
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
        }

    def _spawn(self, name: str, identity: str, *args: str) -> None:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 (the child keeps it)
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", *args],
            env=self._env(identity),
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,  # a bench killed by a timeout leaves no service behind
        )

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.keys.ensure_services()
        self.keys.ensure(BENCH_USER, "admin")
        agent = auth.agent_name(self.node) if self.runtime != "sim" else auth.SIM_IDENTITY
        if self.runtime != "sim":
            self.keys.ensure(agent, "agent", self.node)
        else:
            self.keys.ensure(agent, "sim")
        self.server = NatsServer(
            self.workdir / "nats", auth_config=self.keys.server_config, monitor_port=free_port()
        ).start()
        for name in self.services:
            self._spawn(name, name, f"muster.services.{name}")
        if not self.agents:
            return
        if self.runtime != "sim":
            self._spawn(
                "agent",
                agent,
                "muster.services.agent",
                f"--runtime={self.runtime}",
                f"--node={self.node}",
                "--address=127.0.0.1",
                f"--cpus={self.cpus}",
                f"--memory-mb={self.memory_mb}",
                f"--work-root={self.scratch}",
            )
            return
        # The sim nodes in `sim_processes` processes (sim, sim2, ...), as many nodes each, give or
        # take one; beyond the first, each process's node names start with its own name.
        k = self.sim_processes
        for i in range(k):
            share = self.nodes // k + (1 if i < self.nodes % k else 0)
            name = "sim" if i == 0 else f"sim{i + 1}"
            prefix = [] if i == 0 else [f"--node={name}"]
            self._spawn(
                name,
                agent,
                "muster.services.agent",
                "--runtime=sim",
                f"--sim-nodes={share}",
                *prefix,
                f"--gpus={self.gpus}",
                f"--cpus={self.cpus}",
                f"--memory-mb={self.memory_mb}",
                f"--work-root={self.scratch / name if i else self.scratch}",
            )

    def check(self) -> None:
        """Raise if a process of the mesh has died (its log's tail in the message)."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far by each process of the mesh, nats-server included."""
        pids = {name: p.pid for name, p in self.procs.items()}
        if self.server is not None and self.server.proc is not None:
            pids["nats-server"] = self.server.proc.pid
        out = {}
        for name, pid in pids.items():
            with contextlib.suppress(OSError):
                out[name] = cpu_seconds(pid)
        return out

    def messages(self) -> dict[str, int]:
        """Messages each client has sent and received so far, by connection name (the server's
        /connz: requests, replies, acks and publishes alike), summed over a name's connections."""
        assert self.server is not None and self.server.monitor_port
        url = f"http://{self.server.host}:{self.server.monitor_port}/connz?limit=100000"
        with urllib.request.urlopen(url, timeout=10) as reply:
            connz = json.load(reply)
        out: dict[str, int] = {}
        for c in connz.get("connections", []):
            name = c.get("name") or "?"
            out[name] = out.get(name, 0) + c.get("in_msgs", 0) + c.get("out_msgs", 0)
        return out

    def server_messages(self) -> tuple[int, int]:
        """Messages the server has taken in (published, by anyone: clients and JetStream's own
        internal messages alike) and sent out (deliveries) so far, from its /varz."""
        assert self.server is not None and self.server.monitor_port
        url = f"http://{self.server.host}:{self.server.monitor_port}/varz"
        with urllib.request.urlopen(url, timeout=10) as reply:
            varz = json.load(reply)
        return int(varz.get("in_msgs", 0)), int(varz.get("out_msgs", 0))

    async def connect(self) -> NATS:
        return await bus.connect("bench", self.url, credentials=self.credentials())

    async def wait_ready(self, timeout: float = 300.0) -> float:
        """Declare Muster's streams and buckets (as `muster admin init` does), then wait until
        every node is registered; seconds taken."""
        start = time.monotonic()
        nc = await self.connect()
        try:
            await bus.ensure_jetstream(nc)
            js = nc.jetstream()
            while True:
                self.check()
                with contextlib.suppress(Exception):
                    kv = await js.key_value(subjects.NODES_BUCKET)
                    if (await kv.status()).values >= self.nodes:
                        return time.monotonic() - start
                if time.monotonic() - start > timeout:
                    raise TimeoutError(f"{self.nodes} nodes not all registered in {timeout:g}s")
                await asyncio.sleep(0.5)
        finally:
            await nc.close()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.scratch, ignore_errors=True)
