"""The node agent: registers its node and heartbeats, takes assignments for its node, reserves
ports and reports each task's endpoint, starts each task once the attempt's cluster spec has
arrived (the rendezvous barrier), streams its output, and reports how it ended.

Orders come from the MUSTER_COMMANDS work queue through this node's durable consumer, so an
order sent while the agent is down waits for it. Handling is idempotent: a task already known
is not started again. Every task of every attempt placed here reaches a final, reported state:
the ones it runs when they end, the ones it never started when their attempt ends (a kill order
or a late assignment), and the ones an earlier run of the agent left when it starts
(`reconcile`). Reports go through an outbox on disk (`reporting`), so none is lost while the bus
is away. A task's own lifecycle is `tasks`; what it is started with is `launch`. This module is
the agent itself: its node record and heartbeat, its orders, and how it stops.

Stopping: on SIGTERM an agent whose runtime can adopt tasks (docker) leaves them running, says
its node is restarting (the supervisor then waits MUSTER_RESTART_GRACE seconds, not the node
timeout, before declaring it lost) and the next agent adopts them; the process runtime cannot
adopt, so there the agent stops its tasks and reports them first."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import os
import random
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter

from muster.services.agent.gpushare import mps_available
from muster.services.agent.inventory import PortPool
from muster.services.agent.launch import Where
from muster.services.agent.reconcile import Assignments, Placed, Reconciler
from muster.services.agent.reporting import OUTBOX, Reporter
from muster.services.agent.rsh import Rsh
from muster.services.agent.runtime import (
    Runtime,
)
from muster.services.agent.sharing import Attempts, Placement, Shared
from muster.services.agent.tasks import NOT_STARTED, LocalTask, Tasks
from muster.shared import bus, consume, hostpaths, settings, subjects
from muster.shared.messages import (
    Assignment,
    DrainOrder,
    Endpoint,
    EndpointReported,
    GpuDevice,
    GpuSharing,
    KillOrder,
    NodeInfo,
    TaskCause,
    attempt_key,
    now,
)
from muster.shared.store import Store

HEARTBEATS_MISSED = Counter(
    "muster_agent_heartbeats_missed_total", "Heartbeats this agent could not send to the bus", ["node"]
)
# Seconds between rewrites of a node record that has not changed (see shared/liveness.py): its
# heartbeat_at is never older than that, for a service that has not heard a beat yet.
REFRESH = settings.seconds("MUSTER_NODE_REFRESH", 60.0, low=0.1)
TOLD_KEPT = 256  # see Agent._told
DRAIN_WAIT = 3.0  # seconds a stopping agent gives the orders it is handling (Agent.finish)
OBSOLETE_EVERY = 10.0  # seconds between checks that the live tasks' attempts have not ended

log = structlog.get_logger(service="agent")


@dataclass
class AgentOptions:
    node: str
    address: str
    cpus: int
    memory_mb: int
    gpus: list[GpuDevice]
    port_low: int = 5000
    port_high: int = 10000
    work_root: str = "/tmp/muster"
    output_root: str = "/tmp/muster/output"
    default_fs_uri: str = ""
    heartbeat: float = 2.0
    # Ask the runtime for the GPU devices (Docker device requests). Off when GPUs are only
    # declared: there is no device to hand over, only the indexes the scheduler accounts for.
    gpu_devices: bool = True
    stop_grace: float = 10.0
    overcommit: bool = False  # offer more CPUs/memory than the runtime has (tasks share them)
    restart_grace: float = settings.seconds("MUSTER_RESTART_GRACE", 60.0)
    # Where jobs' dir fields and authFile may point ({user}: the submitter); see shared/hostpaths.py.
    # Empty: MUSTER_DATA_ROOTS, else <work root's parent>/users/{user}.
    data_roots: list[str] = field(default_factory=list)
    task_user: str = "auto"  # Docker: the image's non-root USER, else DEFAULT_TASK_USER; "root" opts out
    pids_limit: int = 4096  # processes per task container (a fork bomb stops there)
    metrics_port: int | None = None  # where /metrics is served, told in the node record
    # How tasks holding part of one GPU share it: time-sliced, or isolated by NVIDIA MPS.
    gpu_sharing: GpuSharing = GpuSharing.TIMESLICE

    def __post_init__(self) -> None:
        # Mount sources must be absolute for Docker; a relative --data-dir works from anywhere.
        self.work_root = os.path.abspath(self.work_root)
        self.output_root = os.path.abspath(self.output_root)
        if not self.data_roots:
            configured = hostpaths.parse_roots(os.environ.get("MUSTER_DATA_ROOTS", ""))
            self.data_roots = configured or [os.path.join(os.path.dirname(self.work_root), "users", "{user}")]


def private(work_root: str) -> None:
    """The work root is the agent's alone (0700): attempt directories hold the MPI rsh socket
    (through it the agent execs in a job's tasks), code and hostfiles, and no other user of the
    host may reach them. Tasks do not need it: Docker mounts an attempt's directory by itself,
    and process tasks run as the agent's user. A root another user owns is left as it is."""
    os.makedirs(work_root, mode=0o700, exist_ok=True)
    info = os.stat(work_root)
    if info.st_uid == os.geteuid() and info.st_mode & 0o077:
        os.chmod(work_root, 0o700)
    elif info.st_mode & 0o077:
        mode = oct(info.st_mode & 0o777)
        log.warning("agent.work_root_shared", work_root=work_root, owner=info.st_uid, mode=mode)


STOPPED_READING = "stopped-reading"  # when the last agent (detached) stopped reading output
READ_THROUGH = "read-through"  # rewritten every heartbeat: output before this time was read
READ_SLACK = 2.0  # seconds before a heartbeat whose output may still be on its way to the agent


def stopped_reading(work_root: str) -> float | None:
    """When the agent before this one stopped reading its tasks' output (wall-clock seconds),
    taken once: exactly, when it detached for a restart; after a crash, from a little before
    its last heartbeat (at least once: lines of those seconds may be read twice, none lost);
    None at a first start."""
    found = None
    for name in (STOPPED_READING, READ_THROUGH):
        path = Path(work_root) / name
        try:
            at = float(path.read_text())
        except (OSError, ValueError):
            continue
        finally:
            path.unlink(missing_ok=True)
        if found is None and 0 < at <= time.time():
            found = at
    return found


def begin_reading(work_root: str, note: bool = True) -> float | None:
    """At start: where the agent before this one stopped reading its tasks' output
    (`stopped_reading`), and a note for a successor should this agent crash before its first
    heartbeat notes more: to read on from where this one began (a task adopted from an earlier
    point is read again from there), never from when the successor starts, which would lose what
    the tasks wrote meanwhile (seen: an MPI launcher's whole output, when the agent was killed
    within its first heartbeat period and the job ended before the next agent came)."""
    at = stopped_reading(work_root)
    if note:  # a runtime whose tasks a successor can adopt
        _note_read_through(work_root, at)
    return at


def _note_read_through(work_root: str, at: float | None = None) -> None:
    """Every heartbeat: what the output read so far covers, for a successor after a crash."""
    path = Path(work_root) / READ_THROUGH
    tmp = path.with_name(f".{READ_THROUGH}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(f"{time.time() - READ_SLACK if at is None else at:.6f}")
        os.replace(tmp, path)


def _bus_url(nc: NATS) -> str:
    """The servers this agent's connection knows (its fence reports there)."""
    return ",".join(server.geturl() for server in getattr(nc, "servers", []))


def _order(msg: Msg) -> Assignment | KillOrder | DrainOrder:
    if msg.subject.endswith(".assign"):
        return Assignment.from_bytes(msg.data)
    if msg.subject.endswith(".kill"):
        return KillOrder.from_bytes(msg.data)
    if msg.subject.endswith(".drain"):
        return DrainOrder.from_bytes(msg.data)
    raise ValueError(f"no such order: {msg.subject}")


class Agent:
    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        buckets: dict[str, KeyValue],
        options: AgentOptions,
        runtime: Runtime,
        shared: Shared | None = None,
    ):
        """`shared`: what this agent shares with the others of its process (sim.py), if any."""
        self.nc, self.js, self.opts, self.runtime = nc, js, options, runtime
        self.nodes = buckets[subjects.NODES_BUCKET]
        # Attempt records: concurrent reads of one (its tasks here, checked together) share it.
        self.attempts = shared.attempts if shared else Attempts(buckets[subjects.ATTEMPTS_BUCKET])
        # Free ports are probed here only when the tasks share this network namespace.
        probe = getattr(runtime, "tasks_in_agent_network", True)
        ports = PortPool(options.port_low, options.port_high, probe=probe)
        # Tasks that ended here (or were reported as never started), so a late or repeated
        # order never runs one again.
        self.reporter = Reporter(js, Path(options.work_root) / OUTBOX)
        where = Where(
            node=options.node,
            work_root=options.work_root,
            output_root=options.output_root,
            default_fs_uri=options.default_fs_uri,
            gpu_devices=options.gpu_devices,
            data_roots=tuple(options.data_roots),
            containers=getattr(runtime, "containers", True),
            gpu_sharing=options.gpu_sharing,
            gpu_memory_mb={g.index: g.memory_mb for g in options.gpus},
        )
        self.tasks = Tasks(
            nc, js, runtime, self.reporter, self.attempts, ports, where, shared.specs if shared else None
        )
        self.rsh = Rsh(nc, options.node, self.tasks)
        self.tasks.rsh = self.rsh
        self.assignments = Assignments(Path(options.work_root) / "assignments")
        self.reconciler = Reconciler(self.tasks, self.assignments, js, options.address)
        self.agent_id = uuid.uuid4().hex[:12]
        self.started_at = now()
        self.drained = False  # an operator drained the node: no new work until undone
        self.log = log.bind(node=options.node)
        # Orders of one attempt are handled in the order they came; other attempts' meanwhile.
        self.handling = consume.Handling(
            subjects.agent_consumer(options.node),
            _order,
            self._on_order,
            self.log,
            key=lambda o: o.key,
            given_up=self._order_given_up,
        )
        self._last_beat = 0.0  # loop time of the last beat sent
        # Ports of a gang task whose endpoint report failed (the order comes again): a report
        # that timed out may have been stored, and its copy is deduplicated, so the task must
        # listen where that one said. The newest TOLD_KEPT; an order never seen again leaks none.
        self._told: collections.OrderedDict[tuple[str, int, str, int], list[int]] = collections.OrderedDict()
        self._written = (-math.inf, -1)  # loop time and reconnect count of the last record written
        self._failing = False  # the last beat failed (logged once per outage)
        self._checked = 0.0  # loop time of the last check for obsolete tasks

    @classmethod
    def builder(cls, options: AgentOptions, runtime: Runtime):
        async def build(nc: NATS) -> Agent:
            await check_declaration(options, runtime)
            js, buckets = await bus.setup(nc)
            return cls(nc, js, buckets, options, runtime)

        return build

    # ------------------------------------------------------------ lifecycle

    def info(self, restarting_until: datetime | None = None) -> NodeInfo:
        o = self.opts
        return NodeInfo(
            node=o.node,
            address=o.address,
            cpus=o.cpus,
            memory_mb=o.memory_mb,
            gpus=o.gpus,
            runtime=self.runtime.name,
            agent_id=self.agent_id,
            started_at=self.started_at,
            restarting_until=restarting_until,
            drained=self.drained,
            metrics_port=o.metrics_port,
            gpu_sharing=o.gpu_sharing,
        )

    async def _was_drained(self) -> bool:
        """Whether the node's record says an operator drained it: a drain holds across the
        agent's restarts (restarted, it took new work at once, and the drain order, cut off
        unacknowledged, came back 30 s later), until `muster drain --undo`."""
        try:
            entry = await self.nodes.get(self.opts.node)
            return entry.value is not None and NodeInfo.from_bytes(entry.value).drained
        except KeyNotFoundError:
            return False
        except Exception as exc:  # not readable: as if not drained (said)
            self.log.warning("agent.node_record_unread", error=str(exc) or type(exc).__name__)
            return False

    async def _write_node(self, restarting_until: datetime | None = None) -> None:
        """(Re)write the node record: registration, drain, restart announcement, refresh."""
        await self.nodes.put(self.opts.node, self.info(restarting_until).to_bytes())
        self._written = (asyncio.get_running_loop().time(), self.nc.stats["reconnects"])

    async def answer_alive(self) -> None:
        """Answer the supervisor asking whether this node is still there (its beats are late):
        the subscription lives as long as the connection, so a node whose connection is gone
        gets "no responders" at once (see services/supervisor/service.py, check_nodes)."""

        async def answer(msg: Msg) -> None:
            with contextlib.suppress(Exception):
                await msg.respond(b"")

        await self.nc.subscribe(subjects.alive(self.opts.node), cb=answer)

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        await self.answer_alive()
        beat = asyncio.create_task(self._heartbeat(stop))
        try:
            await self._consume(stop)
        finally:
            beat.cancel()
            await self.finish()

    async def start(self, placed: Placed | None = None) -> None:
        """Reconcile what an earlier run left, then register. `placed`: the tasks the bus places
        here, when the caller has already read them (a sim process reads the attempts once for
        all its nodes); else they are read here."""
        # Reconcile before the node record is (re)written, so nothing new is placed here meanwhile.
        private(self.opts.work_root)
        pidfile = Path(self.opts.work_root) / "agent.pid"
        try:  # whole or not at all: a dead agent's fence reads it to know a new one has come
            tmp = pidfile.with_name("agent.pid.tmp")
            tmp.write_text(str(os.getpid()))
            tmp.replace(pidfile)
        except OSError as exc:  # a full disk: start all the same (raising, the agent restarted
            # again and again, its tasks unwatched, until the node was declared lost)
            self.log.warning("agent.pid_not_written", error=str(exc))
        # First what an earlier run (or its fence) left unsent, then how every task it left
        # ended, as each is found: before the node timeout, should this start be slow.
        self.reporter.start()
        if self.runtime.name != "sim":  # simulated tasks run no MPI daemons
            await self.rsh.start()  # before adopting: an adopted launcher may call at once
        self.reconciler.read_from = begin_reading(self.opts.work_root, note=self.runtime.can_adopt)
        await self.reconciler.at_start(placed)
        if self.tasks.mps is not None:  # MPS daemons an earlier run left that nothing adopted uses
            for gpu in await self.tasks.mps.sweep():
                self.log.info("agent.mps_daemon_left_quit", gpu=gpu)
        self.tasks.workdirs.start()  # what nothing adopted uses may go (services/agent/workdirs.py)
        # From here on, tasks do not outlive this agent unless it detaches on purpose.
        self.runtime.start_fence(
            self.opts.work_root, str(pidfile), 0.6 * bus.node_timeout(), bus_url=_bus_url(self.nc)
        )
        if self.runtime.name != "sim":  # (a sim process's thousands of nodes keep nothing)
            self.drained = await self._was_drained()
        await self._write_node()
        # The first refresh comes at a random point of the first period, not a whole period
        # after registering: agents that register together (a fleet restarted at once, a sim
        # process of thousands) do not all rewrite their records in the same second of every
        # period after.
        written_at, reconnects = self._written
        self._written = (written_at - random.uniform(0, REFRESH), reconnects)
        self._last_beat = asyncio.get_running_loop().time()
        await self.js.publish(subjects.node_event(self.opts.node, "registered"), self.info().to_bytes())
        self.log.info(
            "agent.registered",
            address=self.opts.address,
            cpus=self.opts.cpus,
            memory_mb=self.opts.memory_mb,
            gpus=[f"{g.index}:{g.model}" for g in self.opts.gpus],
            runtime=self.runtime.name,
        )

    async def finish(self) -> None:
        """Stop: leave the tasks for the next agent when the runtime can adopt them, else stop
        them and report how they ended. The orders still being handled get `DRAIN_WAIT` seconds,
        after the tasks were left to the next agent where it adopts them: a kill waiting out a
        long grace, or an image pull, held the stop past its timeout (compose's, systemd's),
        and the agent was killed before it had detached. What was cut comes again, to the next
        agent."""
        if self.runtime.can_adopt:
            await self._detach()
            await self.handling.drain(DRAIN_WAIT)
        else:
            await self.handling.drain(DRAIN_WAIT)
            await self.tasks.stop_all("agent shutting down", self.opts.stop_grace)
            await self.reporter.flush(10)
            if self.tasks.mps is not None:  # its tasks are gone: so are their MPS daemons
                await self.tasks.mps.close()
        await self.rsh.close()
        await self.tasks.workdirs.close()
        await self.reporter.close()
        await self.runtime.close()
        if self.runtime.can_adopt:  # the next agent reads the tasks' output on from here
            with contextlib.suppress(OSError):
                (Path(self.opts.work_root) / STOPPED_READING).write_text(f"{time.time():.6f}")

    async def _detach(self) -> None:
        """Stop for a restart: say so, so the node is not declared lost before the restart grace
        has passed, and leave every task running for the next agent to adopt."""
        self.runtime.detach()
        self.tasks.detach()
        await self.rsh.detach()  # MPI daemons started through this node go on, too
        until = now() + timedelta(seconds=self.opts.restart_grace)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._write_node(until), 5)
        await self.reporter.flush(5)
        self.log.info("agent.detached", tasks=len(self.tasks.live), restart_grace=self.opts.restart_grace)

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        """A beat every `heartbeat` seconds until `stop`."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.opts.heartbeat)
            if stop.is_set():
                return
            await self.beat()

    async def beat(self) -> None:
        """A beat on the node's liveness subject (core NATS: shared/liveness.py), and the node
        record rewritten when due: after a reconnect, and every REFRESH seconds. If the bus lost
        its state (a new server, a purged bucket), set JetStream up again: the node registers
        again by itself. Never raises."""
        loop = asyncio.get_running_loop()
        try:
            if not self.nc.is_connected:  # a beat now would only wait in the client's buffer
                raise ConnectionError("not connected to the bus")
            if loop.time() - self._last_beat > bus.node_timeout():
                # Silent for longer than a node may be (frozen, cut off): the attempts of our
                # tasks may have been failed and placed elsewhere. Stop what is no longer ours
                # before the node looks alive again and gets new work.
                self.log.warning("agent.back_after_silence", seconds=round(loop.time() - self._last_beat, 1))
                await self.reconciler.stop_obsolete(wait=True)
            written_at, reconnects = self._written
            if loop.time() - written_at >= REFRESH or reconnects != self.nc.stats["reconnects"]:
                await self._write_node()
            await self.nc.publish(subjects.beat(self.opts.node), b"")
            self._last_beat = loop.time()
            if self.runtime.can_adopt:
                _note_read_through(self.opts.work_root)
            if self._failing:
                self.log.info("agent.heartbeat_restored")
            self._failing = False
            if loop.time() - self._checked >= OBSOLETE_EVERY:
                # A backstop for a kill order never received: each check reads the attempt record
                # of every live task (O(gang) each), so not every 2 s beat, and a big gang's
                # less often still (Reconciler.stop_obsolete).
                self._checked = loop.time()
                await self.reconciler.stop_obsolete(routine=True)
        except Exception as exc:
            HEARTBEATS_MISSED.labels(self.opts.node).inc()
            if not self._failing:
                self.log.warning("agent.heartbeat_failed", error=str(exc) or type(exc).__name__)
            self._failing = True
            if self.nc.is_connected:  # connected but failing: the stream may be gone
                with contextlib.suppress(Exception):
                    _, buckets = await bus.setup(self.nc, wait=0)
                    self.nodes = buckets[subjects.NODES_BUCKET]

    async def _subscribe(self):
        return await bus.durable(
            self.js,
            subjects.node_commands(self.opts.node),
            subjects.agent_consumer(self.opts.node),
            subjects.COMMANDS_STREAM,
        )

    async def _consume(self, stop: asyncio.Event) -> None:
        await pull_orders(self._subscribe, self.handling.take, stop, self.nc, self.log)

    async def _on_order(self, order: Assignment | KillOrder | DrainOrder) -> None:
        if isinstance(order, Assignment):
            await self.assign(order)
        elif isinstance(order, KillOrder):
            await self.kill(order)
        else:
            await self.drain(order)

    async def _order_given_up(self, order: Assignment | KillOrder | DrainOrder, why: str) -> None:
        """An order this node failed to take every time it came (its disk full, say): its tasks
        are told not started, the platform's failure, so their gang runs again elsewhere now,
        not after the start deadline (10 minutes) with nothing said."""
        if not isinstance(order, Assignment) or order.node != self.opts.node:
            return
        reason = f"node {self.opts.node} could not take its order: {why}"
        for spec in order.mine:
            key = (order.job_id, order.attempt, spec.role, spec.index)
            if not self.tasks.known(key):
                self.tasks.ports.release(self._told.pop(key, []))
                self.tasks.report_ended(order, spec, TaskCause.PLATFORM, NOT_STARTED, reason)
                self.tasks.remember(key)

    # ------------------------------------------------------------ orders

    async def assign(self, a: Assignment) -> None:
        if a.node != self.opts.node:  # one node's order published on another's subject
            consume.REFUSED.labels("assignment").inc()
            self.log.warning("agent.order_refused", attempt=a.key, why=f"an order for node {a.node}")
            return
        placement = await self.attempts.placement(a.key)
        if placement is None:
            stored = await Store.get(self.attempts, a.key, confirm=True)  # not the shared read
            if stored is None:
                # The scheduler writes an attempt's record before its orders: with none, the
                # order is forged or outlived its attempt (a node away past the job retention
                # finds its old orders still queued). Run nothing of it.
                consume.REFUSED.labels("assignment").inc()
                self.log.warning("agent.order_refused", attempt=a.key, why="no such attempt")
                for spec in a.mine:
                    self.tasks.remember((a.job_id, a.attempt, spec.role, spec.index))
                return
            placement = Placement.of(stored)
        record = placement.record
        kept = False
        for spec in a.mine:
            key = (a.job_id, a.attempt, spec.role, spec.index)
            if self.tasks.known(key):
                continue  # a redelivered or repeated order
            status = placement.by_key.get(spec.key)
            if record.ended or (status is not None and status.state.ended):
                self.tasks.ports.release(self._told.pop(key, []))  # see _told
                # Its attempt ended before the order was read: never start it, but say so.
                if status is not None and not status.state.ended:
                    self.tasks.report_ended(
                        a, spec, TaskCause.KILLED, NOT_STARTED, "never started: attempt ended"
                    )
                self.tasks.remember(key)
                continue
            if self.drained:  # placed before the drain was known: it runs elsewhere
                self.tasks.ports.release(self._told.pop(key, []))  # see _told
                self.tasks.report_ended(
                    a, spec, TaskCause.PLATFORM, NOT_STARTED, f"node {self.opts.node} is drained"
                )
                self.tasks.remember(key)
                continue
            if not kept:
                # Kept before anything is held or told for it: a save that fails (a full disk)
                # leaks no port, and the order comes again to the same state. Kept after the
                # endpoint went out, a failure took other ports on the order's next delivery
                # than the endpoint the gang was told (deduplicated: the first one stands).
                self.assignments.save(a)
                kept = True
            role = a.config.role(spec.role)
            try:
                ports = self._told.pop(key, None) or self._reserve_ports(role.portList)
            except RuntimeError as exc:
                self.tasks.report_ended(a, spec, TaskCause.PLATFORM, NOT_STARTED, str(exc))
                self.tasks.remember(key)
                continue
            endpoint = Endpoint.of(spec, self.opts.address, ports, role.portList)
            cluster = a.own_spec(endpoint)  # a solo task's: no rendezvous to wait behind
            try:
                if cluster is None:  # a gang's task: its endpoint goes to the registry
                    await self.tasks.specs.expect(a.job_id, a.attempt)  # before the endpoint goes out
                    await bus.publish_once(
                        self.js,
                        subjects.task_event(
                            a.job_id, a.attempt, spec.role, spec.index, "endpoint", self.opts.node
                        ),
                        EndpointReported(
                            job_id=a.job_id,
                            attempt=a.attempt,
                            gang_size=a.config.total_tasks,
                            endpoint=endpoint,
                        ).to_bytes(),
                        f"endpoint:{a.job_id}.{a.attempt}.{spec.key}",
                    )
            except Exception:
                self._told[key] = ports  # for its next delivery (see _told)
                while len(self._told) > TOLD_KEPT:
                    self.tasks.ports.release(self._told.popitem(last=False)[1])
                await self.tasks.specs.forget(a.job_id, a.attempt)
                raise  # the order is redelivered
            task = LocalTask(assignment=a, spec=spec, endpoint=endpoint, ports=ports, cluster=cluster)
            self.tasks.take(key, task)
        self.log.info("agent.assigned", job_id=a.job_id, attempt=a.attempt, tasks=[t.key for t in a.mine])

    def _reserve_ports(self, port_list: list[Any]) -> list[int]:
        """The task's default port, then each portList entry's ports, in config order."""
        taken: list[int] = []
        try:
            taken += self.tasks.ports.take(1)
            for p in port_list:
                taken += (
                    self.tasks.ports.take_range(p.beginAt, p.portNumber)
                    if p.beginAt
                    else self.tasks.ports.take(p.portNumber)
                )
            return taken
        except RuntimeError:
            self.tasks.ports.release(taken)
            raise

    async def kill(self, order: KillOrder) -> None:
        """Stop the attempt's tasks this agent runs, and report the ones placed here that it
        never started (their order lost with an earlier run of the agent, or not read yet)."""
        only = set(order.tasks)  # an elastic role shrinking: just these; else every one
        victims = [
            t for t in self.tasks.of_attempt(order.job_id, order.attempt) if not only or t.spec.key in only
        ]
        placement = await self.attempts.placement(attempt_key(order.job_id, order.attempt))
        record = placement.record if placement is not None else None
        # This node's tasks of it, from the record's index: not a pass over the whole gang
        # (every node of a gang gets a kill order when it ends).
        for t in placement.by_node.get(self.opts.node, []) if placement is not None else []:
            key = (order.job_id, order.attempt, t.role, t.index)
            if only and t.key not in only:
                continue
            if not t.state.ended and not self.tasks.known(key):
                assert record is not None
                why = f"never started: {order.reason}"
                self.tasks.report_ended(record, t.spec(), TaskCause.KILLED, NOT_STARTED, why)
                self.tasks.remember(key)
        self.log.info("agent.kill", job_id=order.job_id, attempt=order.attempt, tasks=len(victims))
        await asyncio.gather(*(self.tasks.stop(t, order.reason, order.grace) for t in victims))

    async def drain(self, order: DrainOrder) -> None:
        """Stop every task here on purpose and take no new work (or, with `undo`, take it again).
        The node record says so at once, so the scheduler places nothing here meanwhile. An
        order naming another node is refused: it is not this node's."""
        if order.node != self.opts.node:
            consume.REFUSED.labels("drain").inc()
            self.log.warning("agent.drain_refused", names=order.node, by=order.by)
            return
        self.drained = not order.undo
        await self._write_node()
        self.log.warning("agent.drain", undo=order.undo, by=order.by, tasks=len(self.tasks.live))
        if self.drained:
            await self.tasks.stop_all(f"node {self.opts.node} drained by {order.by}", order.grace)


async def pull_orders(
    subscribe: Callable[[], Awaitable[Any]],
    take: Callable[[Msg], Awaitable[None]],
    stop: asyncio.Event,
    nc: NATS,
    logger: Any,
    batch: int = 16,
) -> None:
    """Fetch orders from the pull consumer `subscribe` makes and `take` each, until `stop`
    (`bus.consume`). A fetch that keeps failing while connected means the consumer (or its
    stream) is gone: the bus lost its state, so JetStream is set up again and the consumer made
    again."""

    first = await bus.patiently(subscribe)
    await bus.consume(first, take, stop, logger, batch, renew=bus.renewing(nc, subscribe))


async def check_declaration(options: AgentOptions, runtime: Runtime) -> None:
    """Refuse, at start, a declaration the runtime cannot honour: every task sized to it would
    fail to start."""
    if options.gpu_sharing is GpuSharing.MPS and runtime.name != "sim":
        why = mps_available()
        if why is not None:
            raise SystemExit(f"agent: --gpu-sharing mps: {why}")
    capacity = await runtime.capacity()
    if capacity is None or options.overcommit:
        return
    cpus, memory_mb = capacity
    for flag, declared, has, unit in (
        ("--cpus", options.cpus, cpus, "CPUs"),
        ("--memory-mb", options.memory_mb, memory_mb, "MB"),
    ):
        if has and declared > has:
            raise SystemExit(
                f"agent: {flag} {declared} is more than the {has} {unit} the {runtime.name} runtime has; "
                f"declare at most {has}, or add --overcommit to let tasks share them"
            )


def default_node_name() -> str:
    name = re.sub(r"[^A-Za-z0-9_-]", "-", os.uname().nodename.split(".")[0]).strip("-")
    return name or "node"
