"""The node agent: registers its node and heartbeats, takes assignments for its node, reserves
ports and reports each task's endpoint, starts each task once the attempt's cluster spec has
arrived (the rendezvous barrier), streams its output, and reports how it ended.

Orders come from the MUSTER_COMMANDS work queue through this node's durable consumer, so an
order sent while the agent is down waits for it. Handling is idempotent: a task already known
is not started again. Every task of every attempt placed here reaches a final, reported state:
the ones it runs when they end, the ones it never started when their attempt ends (a kill order
or a late assignment), and the ones an earlier run of the agent left when it starts
(`reconcile`). Reports go through an outbox on disk (`reporting`), so none is lost while the bus
is away. What a task is started with is `launch`.

Stopping: on SIGTERM an agent whose runtime can adopt tasks (docker) leaves them running, says
its node is restarting (the supervisor then waits MUSTER_RESTART_GRACE seconds, not the node
timeout, before declaring it lost) and the next agent adopts them; the process runtime cannot
adopt, so there the agent stops its tasks and reports them first."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge

from services.agent.inventory import PortPool
from services.agent.launch import Where, build_launch, task_name
from services.agent.reporting import Reporter
from services.agent.runtime import (
    LABEL_ATTEMPT,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_NODE,
    LABEL_PORTS,
    LABEL_ROLE,
    FoundTask,
    LaunchError,
    RunningTask,
    Runtime,
)
from shared import bus, subjects
from shared.messages import (
    Assignment,
    AttemptRecord,
    ClusterSpec,
    DrainOrder,
    Endpoint,
    EndpointReported,
    GpuDevice,
    JobRecord,
    KillOrder,
    NodeInfo,
    TaskCause,
    TaskEvent,
    TaskEventKind,
    TaskSpec,
    TaskState,
    TaskStatus,
    attempt_key,
    now,
)
from shared.store import Store
from shared.subjects import Headers

log = structlog.get_logger(service="agent")

TASKS_LIVE = Gauge("muster_agent_tasks", "Tasks this agent is running", ["node"])
TASKS_ENDED = Counter("muster_agent_tasks_ended_total", "Tasks ended on this agent", ["node", "outcome"])
LAST_LINES = 30
# Exit code reported for a task that never started (launch failure, killed before the barrier).
NOT_STARTED = -1
TaskKey = tuple[str, int, str, int]  # job id, attempt, role, index


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
    restart_grace: float = float(os.environ.get("MUSTER_RESTART_GRACE", "60"))

    def __post_init__(self) -> None:
        # Mount sources must be absolute for Docker; a relative --data-dir works from anywhere.
        self.work_root = os.path.abspath(self.work_root)
        self.output_root = os.path.abspath(self.output_root)


@dataclass
class LocalTask:
    assignment: Assignment
    spec: TaskSpec
    endpoint: Endpoint
    ports: list[int]
    lines: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=LAST_LINES))
    handle: RunningTask | None = None
    runner: asyncio.Task[None] | None = None
    kill_reason: str | None = None
    kill_grace: float = 0.0
    starting: bool = False  # the runtime is starting it: it must not be cancelled then

    @property
    def name(self) -> str:
        a = self.assignment
        return task_name(a.job_id, a.attempt, self.spec.role, self.spec.index)


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
    ):
        self.nc, self.js, self.opts, self.runtime = nc, js, options, runtime
        self.nodes = buckets[subjects.NODES_BUCKET]
        self.attempts = Store(buckets[subjects.ATTEMPTS_BUCKET], AttemptRecord)
        self.jobs = Store(buckets[subjects.JOBS_BUCKET], JobRecord)
        self.ports = PortPool(options.port_low, options.port_high)
        self.tasks: dict[TaskKey, LocalTask] = {}
        # Tasks that ended here (or were reported as never started), so a late or repeated
        # order never runs one again.
        self.finished: collections.OrderedDict[TaskKey, None] = collections.OrderedDict()
        self._background: set[asyncio.Task[None]] = set()
        self.reporter = Reporter(js, Path(options.work_root) / "outbox")
        self.where = Where(
            node=options.node,
            work_root=options.work_root,
            output_root=options.output_root,
            default_fs_uri=options.default_fs_uri,
            gpu_devices=options.gpu_devices,
        )
        self.agent_id = uuid.uuid4().hex[:12]
        self.started_at = now()
        self.detaching = False  # stopping for a restart: tasks keep running, nothing is reported
        self.drained = False  # an operator drained the node: no new work until undone
        self.log = log.bind(node=options.node)

    @classmethod
    def builder(cls, options: AgentOptions, runtime: Runtime):
        async def build(nc: NATS) -> Agent:
            await check_declaration(options, runtime)
            js, buckets = await bus.ensure_jetstream(nc)
            return cls(nc, js, buckets, options, runtime)

        return build

    # ------------------------------------------------------------ lifecycle

    def info(self, restarting_until=None) -> NodeInfo:
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
        )

    async def run(self, stop: asyncio.Event) -> None:
        # Reconcile before the node record is (re)written, so nothing new is placed here meanwhile.
        pidfile = Path(self.opts.work_root) / "agent.pid"
        pidfile.parent.mkdir(parents=True, exist_ok=True)
        pidfile.write_text(str(os.getpid()))
        await self.reconcile_at_start()
        # From here on, tasks do not outlive this agent unless it detaches on purpose.
        self.runtime.start_fence(self.opts.work_root, str(pidfile), 0.6 * bus.node_timeout())
        self.reporter.start()
        await self.nodes.put(self.opts.node, self.info().to_bytes())
        await self.js.publish(subjects.node_event(self.opts.node, "registered"), self.info().to_bytes())
        self.log.info(
            "agent.registered",
            address=self.opts.address,
            cpus=self.opts.cpus,
            memory_mb=self.opts.memory_mb,
            gpus=[f"{g.index}:{g.model}" for g in self.opts.gpus],
            runtime=self.runtime.name,
        )
        beat = asyncio.create_task(self._heartbeat(stop))
        try:
            await self._consume(stop)
        finally:
            beat.cancel()
            if self.runtime.can_adopt:
                await self._detach()
            else:
                await self._stop_all("agent shutting down")
                await self.reporter.flush(10)
            await self.reporter.close()
            await self.runtime.close()

    async def _detach(self) -> None:
        """Stop for a restart: say so, so the node is not declared lost before the restart grace
        has passed, and leave every task running for the next agent to adopt."""
        self.detaching = True
        self.runtime.detach()
        until = now() + timedelta(seconds=self.opts.restart_grace)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nodes.put(self.opts.node, self.info(until).to_bytes()), 5)
        for task in list(self.tasks.values()):
            if task.runner is not None:
                task.runner.cancel()
        await self.reporter.flush(5)
        self.log.info("agent.detached", tasks=len(self.tasks), restart_grace=self.opts.restart_grace)

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        """Rewrite the node record every beat. If the bus lost its state (a new server, a purged
        bucket), set JetStream up again: the node registers again by itself."""
        failing = False
        loop = asyncio.get_running_loop()
        last_beat = loop.time()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.opts.heartbeat)
            if stop.is_set():
                return
            try:
                if loop.time() - last_beat > bus.node_timeout():
                    # Silent for longer than a node may be (frozen, cut off): the attempts of our
                    # tasks may have been failed and placed elsewhere. Stop what is no longer ours
                    # before the node looks alive again and gets new work.
                    self.log.warning("agent.back_after_silence", seconds=round(loop.time() - last_beat, 1))
                    await self.stop_obsolete(wait=True)
                await self.nodes.put(self.opts.node, self.info().to_bytes())
                last_beat = loop.time()
                if failing:
                    self.log.info("agent.heartbeat_restored")
                failing = False
                await self.stop_obsolete()
            except Exception as exc:
                if not failing:
                    self.log.warning("agent.heartbeat_failed", error=str(exc) or type(exc).__name__)
                failing = True
                if self.nc.is_connected:  # connected but failing: the stream may be gone
                    with contextlib.suppress(Exception):
                        _, buckets = await bus.ensure_jetstream(self.nc)
                        self.nodes = buckets[subjects.NODES_BUCKET]

    async def _subscribe(self):
        return await bus.durable(
            self.js,
            subjects.node_commands(self.opts.node),
            subjects.agent_consumer(self.opts.node),
            subjects.COMMANDS_STREAM,
        )

    async def _consume(self, stop: asyncio.Event) -> None:
        sub = await self._subscribe()
        # Orders of one attempt are handled in the order they came; other attempts' meanwhile.
        handling = bus.Handling(
            subjects.agent_consumer(self.opts.node), _order, self._on_order, self.log, key=lambda o: o.key
        )
        failures = 0
        try:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(16, timeout=1)
                    failures = 0
                except (nats.errors.TimeoutError, TimeoutError):
                    continue
                except Exception as exc:
                    failures += 1
                    if failures == 1:
                        self.log.warning("agent.fetch_failed", error=str(exc) or type(exc).__name__)
                    await asyncio.sleep(0.5)
                    if failures % 4 == 0 and self.nc.is_connected:
                        # The consumer (or its stream) is gone: the bus lost its state. Set it up again.
                        with contextlib.suppress(Exception):
                            await bus.ensure_jetstream(self.nc)
                            sub = await self._subscribe()
                    continue
                for msg in msgs:
                    await handling.take(msg)
        finally:
            await handling.drain()

    async def _on_order(self, order: Assignment | KillOrder | DrainOrder) -> None:
        if isinstance(order, Assignment):
            await self.assign(order)
        elif isinstance(order, KillOrder):
            await self.kill(order)
        else:
            await self.drain(order)

    # ------------------------------------------------------------ reconciliation

    async def _placed_here(self) -> dict[TaskKey, tuple[AttemptRecord, TaskStatus]]:
        """Tasks the bus places on this node and does not count as ended, in any attempt: live
        ones, and the leftovers of attempts that ended while this agent was away."""
        out: dict[TaskKey, tuple[AttemptRecord, TaskStatus]] = {}
        async for _, attempt in self.attempts.items():
            for t in attempt.tasks:
                if t.node == self.opts.node and not t.state.ended:
                    out[(attempt.job_id, attempt.attempt, t.role, t.index)] = (attempt, t)
        return out

    async def reconcile_at_start(self) -> None:
        """Before taking new work: adopt the tasks of live attempts this runtime can take over,
        reap every other leftover, and report every task the bus still counts as placed here
        that is not adopted: with its real exit code when it ended while no agent watched, as
        lost when it was taken on and is gone, as stopped when its attempt has ended."""
        placed = await self._placed_here()
        settled: set[TaskKey] = set()
        for found in await self.runtime.find({LABEL_NODE: self.opts.node}):
            key = _key_of(found)
            if key is None:
                continue
            entry = placed.get(key)
            live = entry is not None and not entry[0].ended
            if live and found.running and self.runtime.can_adopt:
                try:
                    await self._adopt(key, found, *entry)  # type: ignore[misc]
                    settled.add(key)
                    continue
                except Exception as exc:
                    self.log.warning("agent.adopt_failed", task=found.name, error=str(exc))
            self.log.info("agent.reap", task=found.name, live=live)
            await self.runtime.reap(found)
            if entry is None:
                continue
            attempt, t = entry
            if not live:
                self._report_ended(attempt, t.spec(), TaskCause.KILLED, NOT_STARTED, "its attempt ended")
            elif found.exit_code is not None and not found.running:
                why = "ended while its agent was away"
                self._report_ended(attempt, t.spec(), TaskCause.EXITED, found.exit_code, why)
            else:
                why = "task lost: its agent restarted"
                self._report_ended(attempt, t.spec(), TaskCause.PLATFORM, NOT_STARTED, why)
            settled.add(key)
        for key, (attempt, t) in placed.items():
            if key in settled:
                continue
            if attempt.ended:
                self._report_ended(
                    attempt, t.spec(), TaskCause.KILLED, NOT_STARTED, "never started: attempt ended"
                )
            elif await self._was_taken(key, t):
                why = "task lost: its agent restarted"
                self._report_ended(attempt, t.spec(), TaskCause.PLATFORM, NOT_STARTED, why)

    async def _was_taken(self, key: TaskKey, t: TaskStatus) -> bool:
        """Whether an earlier run of this agent took the task on: it started it, or it reported
        the task's endpoint (which it does before acknowledging the order). A task whose order
        is still waiting in the queue is neither, and will be run when the order is read."""
        if t.state != TaskState.PLACED:
            return True
        job_id, attempt, role, index = key
        try:
            await self.js.get_last_msg(
                subjects.EVENTS_STREAM, subjects.task_event(job_id, attempt, role, index, "endpoint")
            )
            return True
        except NotFoundError:
            return False

    async def _adopt(self, key: TaskKey, found: FoundTask, attempt: AttemptRecord, t: TaskStatus) -> None:
        job = await self.jobs.get(attempt.job_id)
        if job is None:
            raise LaunchError(f"no record of job {attempt.job_id}")
        order = Assignment.of(job, attempt, self.opts.node)
        spec = t.spec()
        ports = [int(p) for p in found.labels.get(LABEL_PORTS, "").split(",") if p]
        self.ports.take_exact(ports)
        endpoint = Endpoint.of(spec, self.opts.address, ports, job.config.role(t.role).portList)
        task = LocalTask(assignment=order, spec=spec, endpoint=endpoint, ports=ports)
        task.handle = await self.runtime.attach(found.name, lambda line: self._output(task, line))
        self.tasks[key] = task
        task.runner = asyncio.create_task(self._watch(key, task))
        self.log.info("agent.adopted", task=found.name)

    async def stop_obsolete(self, wait: bool = False) -> None:
        """Stop local tasks the bus no longer counts as live (their attempt ended, or they were
        declared lost while this agent was cut off). With `wait`, return once they are gone."""
        stops = []
        for key, task in list(self.tasks.items()):
            if task.handle is None or not await self._obsolete(key):
                continue
            self.log.warning("agent.obsolete_task", task=task.name)
            stopping = asyncio.create_task(self._stop_task(task, "obsolete attempt", 0))
            self._background.add(stopping)
            stopping.add_done_callback(self._background.discard)
            stops.append(stopping)
        if wait and stops:
            await asyncio.wait(stops)

    async def _obsolete(self, key: TaskKey) -> bool:
        job_id, n, role, index = key
        record = await self.attempts.get(attempt_key(job_id, n))
        if record is None:
            return False
        return record.ended or record.task(role, index).state.ended

    # ------------------------------------------------------------ orders

    async def assign(self, a: Assignment) -> None:
        record = await self.attempts.get(a.key)
        for spec in a.mine:
            key = (a.job_id, a.attempt, spec.role, spec.index)
            if key in self.tasks or key in self.finished:
                continue  # a redelivered or repeated order
            status = next((t for t in record.tasks if t.key == spec.key), None) if record else None
            if record is not None and (record.ended or (status is not None and status.state.ended)):
                # Its attempt ended before the order was read: never start it, but say so.
                if status is not None and not status.state.ended:
                    self._report_ended(a, spec, TaskCause.KILLED, NOT_STARTED, "never started: attempt ended")
                self._remember(key)
                continue
            if self.drained:  # placed before the drain was known: it runs elsewhere
                self._report_ended(
                    a, spec, TaskCause.PLATFORM, NOT_STARTED, f"node {self.opts.node} is drained"
                )
                self._remember(key)
                continue
            role = a.config.role(spec.role)
            try:
                ports = self._reserve_ports(role.portList)
            except RuntimeError as exc:
                self._report_ended(a, spec, TaskCause.PLATFORM, NOT_STARTED, str(exc))
                self._remember(key)
                continue
            endpoint = Endpoint.of(spec, self.opts.address, ports, role.portList)
            try:
                await self.js.publish(
                    subjects.task_event(a.job_id, a.attempt, spec.role, spec.index, "endpoint"),
                    EndpointReported(
                        job_id=a.job_id, attempt=a.attempt, gang_size=len(a.gang), endpoint=endpoint
                    ).to_bytes(),
                    headers={Headers.MSG_ID: f"endpoint:{a.job_id}.{a.attempt}.{spec.key}"},
                )
            except Exception:
                self.ports.release(ports)
                raise  # the order is redelivered
            task = LocalTask(assignment=a, spec=spec, endpoint=endpoint, ports=ports)
            self.tasks[key] = task
            TASKS_LIVE.labels(self.opts.node).set(len(self.tasks))
            task.runner = asyncio.create_task(self._run_task(key, task))
        self.log.info("agent.assigned", job_id=a.job_id, attempt=a.attempt, tasks=[t.key for t in a.mine])

    def _reserve_ports(self, port_list: list[Any]) -> list[int]:
        """The task's default port, then each portList entry's ports, in config order."""
        taken: list[int] = []
        try:
            taken += self.ports.take(1)
            for p in port_list:
                taken += (
                    self.ports.take_range(p.beginAt, p.portNumber)
                    if p.beginAt
                    else self.ports.take(p.portNumber)
                )
            return taken
        except RuntimeError:
            self.ports.release(taken)
            raise

    async def kill(self, order: KillOrder) -> None:
        """Stop the attempt's tasks this agent runs, and report the ones placed here that it
        never started (their order lost with an earlier run of the agent, or not read yet)."""
        victims = [
            t for (job, n, _, _), t in self.tasks.items() if job == order.job_id and n == order.attempt
        ]
        record = await self.attempts.get(attempt_key(order.job_id, order.attempt))
        for t in record.tasks if record else []:
            key = (order.job_id, order.attempt, t.role, t.index)
            if (
                t.node == self.opts.node
                and not t.state.ended
                and key not in self.tasks
                and key not in self.finished
            ):
                self._report_ended(
                    record, t.spec(), TaskCause.KILLED, NOT_STARTED, f"never started: {order.reason}"
                )
                self._remember(key)
        self.log.info("agent.kill", job_id=order.job_id, attempt=order.attempt, tasks=len(victims))
        await asyncio.gather(*(self._stop_task(t, order.reason, order.grace) for t in victims))

    async def drain(self, order: DrainOrder) -> None:
        """Stop every task here on purpose and take no new work (or, with `undo`, take it again).
        The node record says so at once, so the scheduler places nothing here meanwhile."""
        self.drained = not order.undo
        await self.nodes.put(self.opts.node, self.info().to_bytes())
        self.log.warning("agent.drain", undo=order.undo, by=order.by, tasks=len(self.tasks))
        if self.drained:
            await self._stop_all(f"node {self.opts.node} drained by {order.by}", order.grace)

    async def _stop_task(self, task: LocalTask, reason: str, grace: float) -> None:
        if task.kill_reason is None:
            task.kill_reason = reason
        task.kill_grace = grace
        if task.handle is not None:
            await task.handle.stop(grace)
        elif task.runner is not None and not task.starting:
            task.runner.cancel()  # still waiting for the cluster spec: it never starts
        # While the runtime is starting it, cancelling could orphan the new process or
        # container: `_run_task` sees kill_reason once start returns and stops it.
        if task.runner is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task.runner

    async def _stop_all(self, reason: str, grace: float | None = None) -> None:
        grace = self.opts.stop_grace if grace is None else grace
        await asyncio.gather(*(self._stop_task(t, reason, grace) for t in list(self.tasks.values())))

    # ------------------------------------------------------------ one task

    async def _run_task(self, key: TaskKey, task: LocalTask) -> None:
        a = task.assignment
        try:
            cluster = await self._wait_spec(a.job_id, a.attempt)
            if await self._obsolete(key):
                raise asyncio.CancelledError
            launch = build_launch(a, task.spec, task.ports, cluster, self.where)
            task.starting = True
            task.handle = await self.runtime.start(launch, lambda line: self._output(task, line))
            if task.kill_reason is not None:  # killed while it was being started
                await task.handle.stop(task.kill_grace)
        except asyncio.CancelledError:
            if self.detaching:
                raise
            why = task.kill_reason or "its attempt ended"
            await self._finish(key, task, TaskCause.KILLED, NOT_STARTED, f"killed before start: {why}")
            return
        except LaunchError as exc:
            await self._finish(key, task, exc.cause, NOT_STARTED, str(exc))
            return
        except Exception as exc:
            self.log.error("agent.task_error", task=task.name, exc_info=True)
            await self._finish(key, task, TaskCause.PLATFORM, NOT_STARTED, f"{type(exc).__name__}: {exc}")
            return
        self._report(a, task.spec, TaskEventKind.RUNNING)
        self.log.info("agent.task_started", task=task.name)
        await self._watch(key, task)

    async def _watch(self, key: TaskKey, task: LocalTask) -> None:
        """Wait for a started (or adopted) task to end and report it."""
        assert task.handle is not None
        try:
            code = await task.handle.wait()
            if task.kill_reason:
                cause, reason = TaskCause.KILLED, f"killed: {task.kill_reason}"
            elif getattr(task.handle, "oom_killed", False):
                limit = task.assignment.config.role(task.spec.role).memoryMB
                cause, reason = TaskCause.OOM, f"out of memory (limit {limit} MB)"
            else:
                cause, reason = TaskCause.EXITED, ""
        except asyncio.CancelledError:
            raise  # detaching: the task goes on, the next agent adopts it
        except Exception as exc:
            code, cause, reason = NOT_STARTED, TaskCause.PLATFORM, f"lost track of the task: {exc}"
        await self._finish(key, task, cause, code, reason)

    async def _finish(self, key: TaskKey, task: LocalTask, cause: TaskCause, code: int, reason: str) -> None:
        self.ports.release(task.ports)
        self.tasks.pop(key, None)
        self._remember(key)
        TASKS_LIVE.labels(self.opts.node).set(len(self.tasks))
        outcome = "succeeded" if cause == TaskCause.EXITED and code == 0 else "failed"
        TASKS_ENDED.labels(self.opts.node, outcome).inc()
        self.log.info("agent.task_ended", task=task.name, exit_code=code, cause=cause, reason=reason)
        self._report_ended(task.assignment, task.spec, cause, code, reason, list(task.lines))
        remove = getattr(task.handle, "remove", None)
        if remove is not None:
            with contextlib.suppress(Exception):
                await remove()

    def _remember(self, key: TaskKey) -> None:
        self.finished[key] = None
        while len(self.finished) > 10_000:
            self.finished.popitem(last=False)

    async def _wait_spec(self, job_id: str, attempt: int) -> ClusterSpec:
        subject = subjects.cluster_spec(job_id, attempt)
        sub = await self.nc.subscribe(subject)
        try:
            while True:
                try:
                    stored = await self.js.get_last_msg(subjects.EVENTS_STREAM, subject)
                    return ClusterSpec.from_bytes(stored.data)
                except NotFoundError:
                    pass
                except Exception:
                    await asyncio.sleep(0.5)
                with contextlib.suppress(nats.errors.TimeoutError):
                    return ClusterSpec.from_bytes((await sub.next_msg(timeout=5)).data)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _output(self, task: LocalTask, line: str) -> None:
        task.lines.append(line)
        a, spec = task.assignment, task.spec
        subject = subjects.task_logs(a.job_id, a.attempt, spec.role, spec.index)
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().create_task(self.nc.publish(subject, line.encode()))

    # ------------------------------------------------------------ reports

    def _report(
        self, a: Assignment | AttemptRecord, spec: TaskSpec, kind: TaskEventKind, **fields: Any
    ) -> None:
        self.reporter.report(
            TaskEvent(
                job_id=a.job_id,
                attempt=a.attempt,
                role=spec.role,
                index=spec.index,
                node=self.opts.node,
                kind=kind,
                **fields,
            )
        )

    def _report_ended(
        self,
        a: Assignment | AttemptRecord,
        spec: TaskSpec,
        cause: TaskCause,
        code: int,
        reason: str,
        lines: list[str] | None = None,
    ) -> None:
        self._report(
            a, spec, TaskEventKind.EXITED, cause=cause, exit_code=code, reason=reason, last_lines=lines or []
        )


def _key_of(found: FoundTask) -> TaskKey | None:
    lb = found.labels
    try:
        return (lb[LABEL_JOB], int(lb[LABEL_ATTEMPT]), lb[LABEL_ROLE], int(lb[LABEL_INDEX]))
    except (KeyError, ValueError):
        return None


async def check_declaration(options: AgentOptions, runtime: Runtime) -> None:
    """Refuse, at start, a declaration the runtime cannot honour: every task sized to it would
    fail to start."""
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
