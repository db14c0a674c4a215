"""The node agent: registers its node and heartbeats, takes assignments for its node, reserves
ports and reports each task's endpoint, starts each task once the attempt's cluster spec has
arrived (the rendezvous barrier), streams its output, and reports how it ended.

Orders come from the MUSTER_COMMANDS work queue through this node's durable consumer, so an
order sent while the agent is down waits for it. Handling is idempotent: a task already known
is not started again."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NoKeysError, NotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge

from services.agent import environment
from services.agent.inventory import PortPool
from services.agent.runtime import (
    LABEL_ATTEMPT,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_NODE,
    LABEL_PORTS,
    LABEL_ROLE,
    FoundTask,
    LaunchError,
    Mount,
    RegistryAuth,
    RunningTask,
    Runtime,
    TaskLaunch,
)
from shared import bus, subjects
from shared.messages import (
    Assignment,
    AttemptRecord,
    ClusterSpec,
    Endpoint,
    EndpointReported,
    GpuDevice,
    JobRecord,
    KillOrder,
    NodeInfo,
    TaskEvent,
    TaskEventKind,
    TaskSpec,
    TaskState,
    TaskStatus,
    now,
)
from shared.subjects import Headers

log = structlog.get_logger(service="agent")

TASKS_LIVE = Gauge("muster_agent_tasks", "Tasks this agent is running", ["node"])
TASKS_ENDED = Counter("muster_agent_tasks_ended_total", "Tasks ended on this agent", ["node", "outcome"])
LAST_LINES = 30
# Exit code reported for a task that never started (launch failure, killed before the barrier).
NOT_STARTED = -1


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
        return f"muster-{a.job_id}-{a.attempt}-{self.spec.role}-{self.spec.index}"


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
        self.kv_attempts = buckets[subjects.ATTEMPTS_BUCKET]
        self.kv_jobs = buckets[subjects.JOBS_BUCKET]
        self.ports = PortPool(options.port_low, options.port_high)
        self.tasks: dict[tuple[str, int, str, int], LocalTask] = {}
        # Tasks that ended here, so a late or repeated order never runs one again.
        self._background: set[asyncio.Task[None]] = set()
        self.finished: collections.OrderedDict[tuple[str, int, str, int], None] = collections.OrderedDict()
        self.agent_id = uuid.uuid4().hex[:12]
        self.started_at = now()
        self.log = log.bind(node=options.node)

    @classmethod
    def builder(cls, options: AgentOptions, runtime: Runtime):
        async def build(nc: NATS) -> Agent:
            js, buckets = await bus.ensure_jetstream(nc)
            return cls(nc, js, buckets, options, runtime)

        return build

    # ------------------------------------------------------------ lifecycle

    def info(self) -> NodeInfo:
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
        )

    async def run(self, stop: asyncio.Event) -> None:
        # Reconcile before the node record is (re)written, so nothing new is placed here meanwhile.
        await self.reconcile_at_start()
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
            await self._stop_all("agent shutting down")
            await self.runtime.close()

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
        handle = bus.acked(self._order, self.log)
        failures = 0
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
                await handle(msg)

    async def _order(self, msg: Msg) -> None:
        if msg.subject.endswith(".assign"):
            await self.assign(Assignment.from_bytes(msg.data))
        elif msg.subject.endswith(".kill"):
            await self.kill(KillOrder.from_bytes(msg.data))

    # ------------------------------------------------------------ reconciliation

    async def _live_here(self) -> dict[tuple[str, int, str, int], tuple[AttemptRecord, TaskStatus]]:
        """Tasks the bus says run on this node: in attempts not ended, not ended themselves."""
        out: dict[tuple[str, int, str, int], tuple[AttemptRecord, TaskStatus]] = {}
        try:
            keys = await self.kv_attempts.keys()
        except NoKeysError:
            return out
        for key in keys:
            try:
                attempt = AttemptRecord.from_bytes((await self.kv_attempts.get(key)).value)
            except KeyNotFoundError:
                continue
            if attempt.ended:
                continue
            for t in attempt.tasks:
                if t.node == self.opts.node and not t.state.ended:
                    out[(attempt.job_id, attempt.attempt, t.role, t.index)] = (attempt, t)
        return out

    async def reconcile_at_start(self) -> None:
        """Before taking new work: adopt the tasks of live attempts this runtime can take over,
        reap every other leftover (obsolete attempts, or a runtime that cannot adopt), and report
        the live tasks that are gone as lost, so their attempt ends and is retried."""
        live = await self._live_here()
        adopted: set[tuple[str, int, str, int]] = set()
        for found in await self.runtime.find({LABEL_NODE: self.opts.node}):
            lb = found.labels
            try:
                key = (lb[LABEL_JOB], int(lb[LABEL_ATTEMPT]), lb[LABEL_ROLE], int(lb[LABEL_INDEX]))
            except (KeyError, ValueError):
                continue
            if key in live and found.running and self.runtime.can_adopt:
                try:
                    await self._adopt(key, found, *live[key])
                    adopted.add(key)
                    continue
                except Exception as exc:
                    self.log.warning("agent.adopt_failed", task=found.name, error=str(exc))
            self.log.info("agent.reap", task=found.name, live=key in live)
            await self.runtime.reap(found)
        for key, (attempt, t) in live.items():
            if key not in adopted and await self._was_taken(key, t):
                spec = TaskSpec(role=t.role, role_no=t.role_no, index=t.index, node=t.node, gpus=t.gpus)
                reason = "platform: task lost: its agent restarted"
                await self._report_exit(attempt, spec, NOT_STARTED, reason, [])
                self.finished[key] = None

    async def _was_taken(self, key: tuple[str, int, str, int], t: TaskStatus) -> bool:
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

    async def _adopt(
        self, key: tuple[str, int, str, int], found: FoundTask, attempt: AttemptRecord, t: TaskStatus
    ) -> None:
        job = JobRecord.from_bytes((await self.kv_jobs.get(attempt.job_id)).value)
        gang = [
            TaskSpec(role=x.role, role_no=x.role_no, index=x.index, node=x.node, gpus=x.gpus)
            for x in attempt.tasks
        ]
        order = Assignment(
            job_id=attempt.job_id,
            attempt=attempt.attempt,
            user=job.user,
            config=job.config,
            gang=gang,
            node=self.opts.node,
        )
        spec = next(g for g in gang if g.role == t.role and g.index == t.index)
        ports = [int(p) for p in found.labels.get(LABEL_PORTS, "").split(",") if p]
        self.ports.take_exact(ports)
        endpoint = Endpoint(
            role=t.role,
            role_no=t.role_no,
            index=t.index,
            node=self.opts.node,
            host=self.opts.address,
            port=ports[0] if ports else 0,
        )
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
            if task.handle is None:
                continue
            job_id, attempt, role, index = key
            try:
                record = AttemptRecord.from_bytes((await self.kv_attempts.get(f"{job_id}.{attempt}")).value)
            except KeyNotFoundError:
                continue
            if record.ended or record.task(role, index).state.ended:
                self.log.warning("agent.obsolete_task", task=task.name)
                stopping = asyncio.create_task(self._stop_task(task, "obsolete attempt", 0))
                self._background.add(stopping)
                stopping.add_done_callback(self._background.discard)
                stops.append(stopping)
        if wait and stops:
            await asyncio.wait(stops)

    # ------------------------------------------------------------ orders

    async def assign(self, a: Assignment) -> None:
        for spec in a.mine:
            key = (a.job_id, a.attempt, spec.role, spec.index)
            if key in self.tasks or key in self.finished:
                continue  # a redelivered or repeated order
            role = a.config.role(spec.role)
            try:
                ports, named = self._reserve_ports(role.portList)
            except RuntimeError as exc:
                await self._report_exit(a, spec, NOT_STARTED, f"platform: {exc}", [])
                continue
            endpoint = Endpoint(
                role=spec.role,
                role_no=spec.role_no,
                index=spec.index,
                node=self.opts.node,
                host=self.opts.address,
                port=ports[0],
                ports=named,
            )
            task = LocalTask(assignment=a, spec=spec, endpoint=endpoint, ports=ports)
            self.tasks[key] = task
            TASKS_LIVE.labels(self.opts.node).set(len(self.tasks))
            await self.js.publish(
                subjects.task_event(a.job_id, a.attempt, spec.role, spec.index, "endpoint"),
                EndpointReported(
                    job_id=a.job_id, attempt=a.attempt, gang_size=len(a.gang), endpoint=endpoint
                ).to_bytes(),
                headers={Headers.MSG_ID: f"endpoint:{a.job_id}.{a.attempt}.{spec.key}"},
            )
            task.runner = asyncio.create_task(self._run_task(key, task))
        self.log.info("agent.assigned", job_id=a.job_id, attempt=a.attempt, tasks=[t.key for t in a.mine])

    def _reserve_ports(self, port_list) -> tuple[list[int], dict[str, list[int]]]:
        taken: list[int] = []
        try:
            taken += self.ports.take(1)
            named: dict[str, list[int]] = {}
            for p in port_list:
                got = (
                    self.ports.take_range(p.beginAt, p.portNumber)
                    if p.beginAt
                    else self.ports.take(p.portNumber)
                )
                taken += got
                named[p.label] = got
            return taken, named
        except RuntimeError:
            self.ports.release(taken)
            raise

    async def kill(self, order: KillOrder) -> None:
        victims = [
            t
            for (job, attempt, _, _), t in self.tasks.items()
            if job == order.job_id and attempt == order.attempt
        ]
        self.log.info("agent.kill", job_id=order.job_id, attempt=order.attempt, tasks=len(victims))
        await asyncio.gather(*(self._stop_task(t, order.reason, order.grace) for t in victims))

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

    async def _stop_all(self, reason: str) -> None:
        await asyncio.gather(
            *(self._stop_task(t, reason, self.opts.stop_grace) for t in list(self.tasks.values()))
        )

    # ------------------------------------------------------------ one task

    async def _run_task(self, key: tuple[str, int, str, int], task: LocalTask) -> None:
        a = task.assignment
        try:
            cluster = await self._wait_spec(a.job_id, a.attempt)
            if await self._obsolete(key):
                raise asyncio.CancelledError
            launch = self._launch(task, cluster)
            task.starting = True
            task.handle = await self.runtime.start(launch, lambda line: self._output(task, line))
            if task.kill_reason is not None:  # killed while it was being started
                await task.handle.stop(task.kill_grace)
        except asyncio.CancelledError:
            why = task.kill_reason or "its attempt ended"
            await self._finish(key, task, NOT_STARTED, f"killed before start: {why}")
            return
        except LaunchError as exc:
            await self._finish(key, task, NOT_STARTED, f"platform: {exc}")
            return
        except Exception as exc:
            self.log.error("agent.task_error", task=task.name, exc_info=True)
            await self._finish(key, task, NOT_STARTED, f"platform: {type(exc).__name__}: {exc}")
            return
        await self._publish_task(a, task.spec, TaskEventKind.RUNNING)
        self.log.info("agent.task_started", task=task.name)
        await self._watch(key, task)

    async def _watch(self, key: tuple[str, int, str, int], task: LocalTask) -> None:
        """Wait for a started (or adopted) task to end and report it."""
        assert task.handle is not None
        try:
            code = await task.handle.wait()
            if task.kill_reason:
                reason = f"killed: {task.kill_reason}"
            elif getattr(task.handle, "oom_killed", False):
                reason = f"out of memory (limit {task.assignment.config.role(task.spec.role).memoryMB} MB)"
            else:
                reason = ""
        except Exception as exc:
            code, reason = NOT_STARTED, f"platform: lost track of the task: {exc}"
        await self._finish(key, task, code, reason)

    async def _obsolete(self, key: tuple[str, int, str, int]) -> bool:
        job_id, attempt, role, index = key
        try:
            record = AttemptRecord.from_bytes((await self.kv_attempts.get(f"{job_id}.{attempt}")).value)
        except KeyNotFoundError:
            return False
        return record.ended or record.task(role, index).state.ended

    async def _finish(self, key: tuple[str, int, str, int], task: LocalTask, code: int, reason: str) -> None:
        self.ports.release(task.ports)
        self.tasks.pop(key, None)
        self.finished[key] = None
        while len(self.finished) > 10_000:
            self.finished.popitem(last=False)
        TASKS_LIVE.labels(self.opts.node).set(len(self.tasks))
        outcome = "succeeded" if code == 0 and not reason else "failed"
        TASKS_ENDED.labels(self.opts.node, outcome).inc()
        self.log.info("agent.task_ended", task=task.name, exit_code=code, reason=reason)
        await self._report_exit(task.assignment, task.spec, code, reason, list(task.lines))
        remove = getattr(task.handle, "remove", None)
        if remove is not None:
            with contextlib.suppress(Exception):
                await remove()

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

    def _launch(self, task: LocalTask, cluster: ClusterSpec) -> TaskLaunch:
        a, spec = task.assignment, task.spec
        config, role = a.config, a.config.role(spec.role)
        attempt_dir = Path(self.opts.work_root) / a.job_id / str(a.attempt)
        task_dir = attempt_dir / f"{spec.role}-{spec.index}"
        task_dir.mkdir(parents=True, exist_ok=True)
        hostfile = attempt_dir / "hostfile"
        hostfile.write_text(environment.render_hostfile(cluster, config))
        ctx = environment.TaskContext(
            job_id=a.job_id,
            attempt=a.attempt,
            user=a.user,
            config=config,
            spec=cluster,
            role=spec.role,
            index=spec.index,
            gpus=spec.gpus,
            output_root=self.opts.output_root,
            default_fs_uri=self.opts.default_fs_uri,
            hostfile_path=str(hostfile),
        )
        env = environment.render_env(ctx)
        dirs = environment.resolve_dirs(config, a.user, self.opts.default_fs_uri, self.opts.output_root)
        mounts = [Mount(str(attempt_dir), str(attempt_dir), read_only=False)]
        workdir = str(task_dir)
        for path, is_code in ((dirs.data, False), (dirs.code, True), (dirs.output, False)):
            local = local_path(path)
            if local:
                mounts.append(Mount(local, local))
                if is_code:
                    workdir = local
        return TaskLaunch(
            name=task.name,
            image=config.image,
            command=role.command,
            env=env,
            cpus=role.cpuNumber,
            memory_mb=role.memoryMB,
            shm_mb=role.shmMB,
            gpus=spec.gpus if self.opts.gpu_devices else [],
            mounts=mounts,
            workdir=workdir,
            auth=read_auth_file(config.authFile),
            labels={
                LABEL_JOB: a.job_id,
                LABEL_ATTEMPT: str(a.attempt),
                LABEL_ROLE: spec.role,
                LABEL_INDEX: str(spec.index),
                LABEL_NODE: self.opts.node,
                LABEL_PORTS: ",".join(map(str, task.ports)),
            },
        )

    def _output(self, task: LocalTask, line: str) -> None:
        task.lines.append(line)
        a, spec = task.assignment, task.spec
        subject = subjects.task_logs(a.job_id, a.attempt, spec.role, spec.index)
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().create_task(self.nc.publish(subject, line.encode()))

    async def _publish_task(
        self, a: Assignment | AttemptRecord, spec: TaskSpec, kind: TaskEventKind, **fields
    ) -> None:
        event = TaskEvent(
            job_id=a.job_id,
            attempt=a.attempt,
            role=spec.role,
            index=spec.index,
            node=self.opts.node,
            kind=kind,
            **fields,
        )
        await self.js.publish(
            subjects.task_event(a.job_id, a.attempt, spec.role, spec.index, kind),
            event.to_bytes(),
            headers={Headers.MSG_ID: f"{kind}:{a.job_id}.{a.attempt}.{spec.key}"},
        )

    async def _report_exit(
        self, a: Assignment | AttemptRecord, spec: TaskSpec, code: int, reason: str, lines: list[str]
    ) -> None:
        for delay in (0, 0.5, 1, 2, 5, 10):
            await asyncio.sleep(delay)
            try:
                await self._publish_task(
                    a, spec, TaskEventKind.EXITED, exit_code=code, reason=reason, last_lines=lines
                )
                return
            except Exception as exc:
                self.log.warning("agent.report_failed", error=str(exc) or type(exc).__name__)
        self.log.error("agent.report_lost", job_id=a.job_id, attempt=a.attempt, task=spec.key)


def local_path(path: str | None) -> str | None:
    """A dir field usable on this machine: an absolute path or a file:// URI."""
    if not path:
        return None
    if path.startswith("file://"):
        path = path[len("file://") :]
    return path if path.startswith("/") else None


def read_auth_file(path: str | None) -> RegistryAuth | None:
    """authFile: three lines — registry server, user name, password. Errors never show the contents."""
    local = local_path(path)
    if not local:
        return None
    try:
        lines = Path(local).read_text().splitlines()
    except OSError as exc:
        raise LaunchError(f"cannot read authFile {local}: {exc.strerror}") from None
    if len(lines) < 3:
        raise LaunchError(f"authFile {local}: expected 3 lines (server, user, password)")
    return RegistryAuth(server=lines[0].strip(), username=lines[1].strip(), password=lines[2].rstrip("\r\n"))


def default_node_name() -> str:
    name = re.sub(r"[^A-Za-z0-9_-]", "-", os.uname().nodename.split(".")[0]).strip("-")
    return name or "node"
