"""Many simulated nodes in one process, on one NATS connection: `--runtime sim --sim-nodes N`,
for benchmarks and scale tests of the control plane (1,000-10,000 nodes on one machine).

Each node is the real `Agent` with the sim runtime (services/agent/sim_runtime.py): its node
record and heartbeats, orders, endpoints, task events and logs go through the code a real
agent runs. What 10,000 of them would each do on their own is done once for all:

- one connection, as one identity (`sim-agents`, role sim in shared/auth.py: an agent on every
  node), and one /healthz and /metrics endpoint;
- the attempts are read once at start, for every node's reconciliation; while running, an
  attempt record or cluster spec that many of its nodes need at once is read once
  (services/agent/sharing.py: an 800-task gang's are ~100 KB each, 80 MB if read per task);
- orders come through one durable consumer per CHUNK nodes, filtered on exactly their order
  subjects (a multi-filter consumer), each order handed to its node's agent by the node token
  of its subject. A consumer per node would be 10,000 consumers and fetch loops; one on
  `muster.node.>` would lock every other agent out of the bus (a work-queue stream lets one
  consumer have a subject). The server checks filters for overlap at creation, which grows
  with the square of the node count: about 5 s at 10,000 nodes, once at start;
- heartbeats: one ring beats each node once a period, spread evenly over it, never all at
  once. The period is --heartbeat, else a real agent's 2 s, whatever N: 10,000 nodes send the
  5,000 beats a second 10,000 agents would (each a core-NATS message; a node's record is
  rewritten only when due, shared/liveness.py). Nodes are lost after MUSTER_NODE_TIMEOUT
  without one, which must be longer than the period: `muster up` raises it to
  `node_timeout_for(period)`; a sim process joining another bus warns;
- whether a node is still there (the supervisor asks a quiet node's agent): one subscription
  answers for every node of the process.

Per-node logs below MUSTER_SIM_LOG_LEVEL (warning) are dropped: 10,000 nodes would each log
their registration and every task. No GPU discovery, Docker check, fence or port file: sim
nodes declare --gpus (8xV100), --cpus (64) and --memory-mb (262144) and use nothing.
A sim process hosts no real work and shares no node name with a real agent."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.kv import KeyValue
from prometheus_client import Gauge

from muster.services.agent.inventory import machine_address, parse_gpus, parse_port_range
from muster.services.agent.reconcile import placed_by_node
from muster.services.agent.runtime import Runtime
from muster.services.agent.service import Agent, AgentOptions, pull_orders
from muster.services.agent.sharing import Shared
from muster.services.agent.sim_runtime import SimRuntime
from muster.shared import bus, subjects

log = structlog.get_logger(service="sim")
NODES = Gauge("muster_sim_nodes", "Simulated nodes this process has registered")

DEFAULT_GPUS, DEFAULT_CPUS, DEFAULT_MEMORY_MB = "8xV100", 64, 262144
HEARTBEAT = 2.0  # seconds: a real agent's period, each sim node's unless --heartbeat says
CHUNK = 500  # nodes per order consumer
CONSUMER_IDLE = 600.0  # seconds: the server drops a sim consumer nobody pulls from (a past run's)
STARTING = 200  # nodes registering at once
TICK = 0.05  # seconds between heartbeat rounds
BATCH = 64  # orders fetched at once (an order carries its node's tasks and the job's config)


@dataclass(frozen=True)
class SimSetup:
    """A sim process's nodes and their heartbeat period, from its flags."""

    prefix: str
    options: list[AgentOptions]
    heartbeat: float

    def describe(self) -> str:
        first, n = self.options[0], len(self.options)
        last = self.options[-1].node
        models = collections.Counter(g.model for g in first.gpus)
        gpus = ",".join(f"{count}x{model}" for model, count in models.items()) or "no GPUs"
        return (
            f"{n} sim node{'s' if n > 1 else ''} {first.node}{'..' + last if n > 1 else ''}: "
            f"{first.cpus} CPUs, {first.memory_mb} MB, {gpus} each; heartbeat every {self.heartbeat:g}s"
        )

    def builder(self, runtime: Runtime | None = None) -> Callable[[NATS], Awaitable[SimFleet]]:
        async def build(nc: NATS) -> SimFleet:
            js, buckets = await bus.setup(nc)
            fleet_runtime = runtime or SimRuntime()
            return SimFleet(nc, js, buckets, self.prefix, self.options, fleet_runtime, self.heartbeat)

        return build


def node_names(prefix: str, n: int) -> list[str]:
    """`prefix-00000` .. : zero-padded so they sort in order (at least 5 digits)."""
    width = max(5, len(str(n - 1)))
    return [f"{prefix}-{i:0{width}d}" for i in range(n)]


def heartbeat_for(n: int, given: float | None) -> float:
    """The heartbeat period of a process of `n` sim nodes: `given`, else a real agent's,
    whatever `n` (each node beats as an agent of its own would)."""
    return given if given is not None else HEARTBEAT


def node_timeout_for(heartbeat: float) -> float:
    """A MUSTER_NODE_TIMEOUT that a node beating every `heartbeat` seconds never outlives by
    a late beat (the default 5 s is 2.5 of a real agent's 2 s beats)."""
    return max(5.0, 2.5 * heartbeat)


def setup_from_args(args: argparse.Namespace, data_dir: str) -> SimSetup:
    """The sim nodes the agent flags describe; SystemExit naming a bad flag."""
    n = args.sim_nodes if args.sim_nodes is not None else 1
    if n < 1:
        raise SystemExit(f"--sim-nodes {n}: must be at least 1")
    prefix = args.node or "sim"
    names = node_names(prefix, n)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", names[-1]):
        raise SystemExit(f"--node {prefix!r}: a sim prefix of letters, digits, '_' and '-', at most 57")
    try:
        gpus = parse_gpus(args.gpus if args.gpus is not None else DEFAULT_GPUS)
    except ValueError as exc:
        raise SystemExit(f"--gpus {args.gpus!r}: {exc}") from None
    low, high = parse_port_range(args.ports)
    heartbeat = heartbeat_for(n, args.heartbeat)
    if heartbeat <= 0:
        raise SystemExit(f"--heartbeat {heartbeat}: must be > 0")
    work_root = args.work_root or os.path.join(data_dir, "work")
    output_root = args.output_root or os.path.join(data_dir, "output")
    address = args.address or machine_address()
    from muster.services.agent.config import data_roots

    roots = data_roots(args.data_roots, data_dir)
    options = [
        AgentOptions(
            node=node,
            address=address,
            cpus=args.cpus or DEFAULT_CPUS,
            memory_mb=args.memory_mb or DEFAULT_MEMORY_MB,
            gpus=gpus,
            gpu_devices=False,
            port_low=low,
            port_high=high,
            work_root=os.path.join(work_root, node),
            output_root=output_root,
            default_fs_uri=args.default_fs_uri,
            heartbeat=heartbeat,
            data_roots=roots,
        )
        for node in names
    ]
    return SimSetup(prefix, options, heartbeat)


def order_node(subject: str) -> str:
    """The node an order is for: `muster.node.<node>.<verb>`."""
    return subject.split(".")[2] if subject.count(".") >= 3 else ""


def beats_due(elapsed: float, period: float, n: int) -> int:
    """How many beats of the ring are due `elapsed` seconds after it began: beat k goes to node
    k mod n at k·period/n, so each node beats once a period and the beats are evenly spread."""
    return int(elapsed * n / period) if elapsed > 0 else 0


def _forget(beating: dict[int, asyncio.Task[None]], i: int, _: asyncio.Task[None]) -> None:
    beating.pop(i, None)


def quiet_logger(level: str | None = None, **bound: Any) -> Any:
    """A logger that drops what is below `level` (MUSTER_SIM_LOG_LEVEL, default warning)."""
    name = (level or os.environ.get("MUSTER_SIM_LOG_LEVEL", "warning")).upper()
    wrapper = structlog.make_filtering_bound_logger(getattr(logging, name, logging.WARNING))
    return structlog.wrap_logger(None, wrapper_class=wrapper, service="agent", **bound)


class SimFleet:
    """The sim nodes of one process (see the module's doc)."""

    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        buckets: dict[str, KeyValue],
        prefix: str,
        options: list[AgentOptions],
        runtime: Runtime,
        heartbeat: float,
    ):
        self.nc, self.js, self.prefix, self.heartbeat = nc, js, prefix, heartbeat
        shared = Shared.of(nc, js, buckets[subjects.ATTEMPTS_BUCKET])
        self.attempts = shared.attempts
        self.agents: dict[str, Agent] = {}
        for o in options:
            agent = Agent(nc, js, buckets, o, runtime, shared)
            quiet = quiet_logger(node=o.node)
            agent.log = agent.handling.log = agent.tasks.log = agent.reconciler.log = quiet
            self.agents[o.node] = agent
        names = list(self.agents)
        self.chunks = [names[i : i + CHUNK] for i in range(0, len(names), CHUNK)]

    async def run(self, stop: asyncio.Event) -> None:
        started: list[Agent] = []
        try:
            await self._start_all(started)
            await self.nc.subscribe(subjects.alive("*"), cb=self._answer_alive)
            beats = asyncio.create_task(self._beat_all(stop))
            try:
                await asyncio.gather(*(self._consume(k, names, stop) for k, names in enumerate(self.chunks)))
            finally:
                beats.cancel()
        finally:
            await asyncio.gather(*(a.finish() for a in started), return_exceptions=True)
            NODES.set(0)
            log.info("sim.stopped", nodes=len(started))

    async def _start_all(self, started: list[Agent]) -> None:
        """Reconcile and register every node, STARTING at a time, from one read of the attempts."""
        t0 = time.monotonic()
        records = [record async for _, record in self.attempts.items()]
        placed = placed_by_node(records)
        slots = asyncio.Semaphore(STARTING)

        async def start(agent: Agent) -> None:
            async with slots:
                await agent.start(placed.get(agent.opts.node, {}))
                started.append(agent)
                NODES.set(len(started))

        await asyncio.gather(*(start(a) for a in self.agents.values()))
        log.info(
            "sim.registered",
            nodes=len(started),
            first=started[0].opts.node if started else None,
            heartbeat=self.heartbeat,
            seconds=round(time.monotonic() - t0, 1),
        )

    async def _beat_all(self, stop: asyncio.Event) -> None:
        """Each node's heartbeat, in one ring (see `beats_due`); a node whose last beat has not
        returned (a slow bus) skips its turn rather than piling up."""
        agents = list(self.agents.values())
        n = len(agents)
        loop = asyncio.get_running_loop()
        began, done = loop.time(), 0
        beating: dict[int, asyncio.Task[None]] = {}
        tick = max(TICK, min(1.0, self.heartbeat / n))
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), tick)
            due = beats_due(loop.time() - began, self.heartbeat, n)
            for k in range(max(done, due - n), due):  # after a stall, each node beats once
                i = k % n
                if i not in beating:
                    beating[i] = asyncio.create_task(agents[i].beat())
                    beating[i].add_done_callback(functools.partial(_forget, beating, i))
            done = due

    async def _answer_alive(self, msg: Msg) -> None:
        """The supervisor asks whether a node is there: its agent answers, as its own would."""
        if msg.subject[len(subjects.alive("")) :] in self.agents:
            with contextlib.suppress(Exception):
                await msg.respond(b"")

    def consumer(self, k: int) -> str:
        return f"sim-{self.prefix}-{k}"

    async def _subscribe(self, k: int, names: list[str]) -> Any:
        """Chunk k's order consumer, made or brought up to this process's nodes."""
        config = ConsumerConfig(
            durable_name=self.consumer(k),
            name=self.consumer(k),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=30,
            max_deliver=-1,
            filter_subjects=[subjects.node_commands(node) for node in names],
            inactive_threshold=CONSUMER_IDLE,
        )
        await self.js.add_consumer(subjects.COMMANDS_STREAM, config, timeout=60)
        return await self.js.pull_subscribe_bind(durable=self.consumer(k), stream=subjects.COMMANDS_STREAM)

    async def _consume(self, k: int, names: list[str], stop: asyncio.Event) -> None:
        await pull_orders(lambda: self._subscribe(k, names), self._dispatch, stop, self.nc, log, batch=BATCH)

    async def _dispatch(self, msg: Msg) -> None:
        """Hand an order to its node's agent, as its own consumer would."""
        agent = self.agents.get(order_node(msg.subject))
        if agent is None:  # cannot be: each consumer filters on its own nodes' orders
            log.warning("sim.order_for_no_node", subject=msg.subject)
            with contextlib.suppress(Exception):
                await msg.term()
            return
        await agent.handling.take(msg)
