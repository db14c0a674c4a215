"""What an agent does with what it finds: at start, the tasks an earlier run of it left (adopted
when the runtime can and their attempt is live, reaped otherwise, and every task the bus still
counts as placed here reported); and while it runs, the tasks the bus no longer counts as live
(stopped before the node looks alive again after a silence)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

import structlog
from nats.js import JetStreamContext

from muster.services.agent.runtime import (
    LABEL_ATTEMPT,
    LABEL_HOME,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_NODE,
    LABEL_PORTS,
    LABEL_ROLE,
    FoundTask,
    LaunchError,
    noted_stop,
    stop_note,
)
from muster.services.agent.tasks import NOT_STARTED, LocalTask, TaskKey, Tasks
from muster.shared import subjects
from muster.shared.messages import (
    Assignment,
    AttemptRecord,
    Endpoint,
    TaskCause,
    TaskState,
    TaskStatus,
    attempt_key,
)

log = structlog.get_logger(service="agent")
LOST = "task lost: its agent restarted"
# The routine check of a live attempt: at most every ROUTINE_EVERY seconds per ROUTINE_TASKS tasks
# of its gang (a gang of 2,000: every 200 s), see Reconciler.stop_obsolete.
ROUTINE_EVERY = 10.0
ROUTINE_TASKS = 100


# The tasks the bus places on one node and does not count as ended, with their attempts.
Placed = dict[TaskKey, tuple[AttemptRecord, TaskStatus]]


def placed_by_node(attempts: Iterable[AttemptRecord]) -> dict[str, Placed]:
    """Every task not yet ended, by the node it is placed on: what each agent reconciles at
    start. One pass over the attempts serves any number of nodes (a sim process has thousands)."""
    out: dict[str, Placed] = {}
    for attempt in attempts:
        for t in attempt.tasks:
            if not t.state.ended:
                out.setdefault(t.node, {})[(attempt.job_id, attempt.attempt, t.role, t.index)] = (attempt, t)
    return out


class Assignments:
    """The orders this agent took, kept on its disk (mode 0600, outside every task's mounts): what
    a restarted agent needs to adopt a task, so no agent ever reads job records (other users'
    jobs) from the bus."""

    def __init__(self, root: Path):
        self.root = root

    def path(self, job_id: str, attempt: int) -> Path:
        return self.root / f"{attempt_key(job_id, attempt)}.json"

    def save(self, a: Assignment) -> None:
        path = self.path(a.job_id, a.attempt)
        tmp = path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        except FileNotFoundError:  # the first order (or the directory was removed): make it
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(a.to_bytes())
        tmp.replace(path)

    def load(self, job_id: str, attempt: int) -> Assignment | None:
        try:
            return Assignment.from_bytes(self.path(job_id, attempt).read_bytes())
        except (OSError, ValueError):
            return None

    def keep_only(self, live: set[str]) -> None:
        """Forget the orders of attempts that are no longer live here."""
        for path in self.root.glob("*.json") if self.root.exists() else []:
            if path.stem not in live:
                path.unlink(missing_ok=True)


class Reconciler:
    def __init__(self, tasks: Tasks, assignments: Assignments, js: JetStreamContext, address: str):
        self.tasks, self.assignments, self.js, self.address = tasks, assignments, js, address
        self.runtime = tasks.runtime
        self.node = tasks.node
        self.log = log.bind(node=self.node)
        self._stopping: set[asyncio.Task[None]] = set()
        self.read_from: float | None = None  # when the last agent stopped reading its tasks' output
        self._due: dict[tuple[str, int], float] = {}  # attempt -> loop time its routine check is due

    async def placed_here(self) -> Placed:
        """Tasks the bus places on this node and does not count as ended, in any attempt: live
        ones, and the leftovers of attempts that ended while this agent was away."""
        records = [attempt async for _, attempt in self.tasks.attempts.items()]
        return placed_by_node(records).get(self.node, {})

    async def at_start(self, placed: Placed | None = None) -> None:
        """Before taking new work: adopt the tasks of live attempts this runtime can take over,
        reap every other leftover, and report every task the bus still counts as placed here
        that is not adopted: with its real exit code when it ended by itself while no agent
        watched (the runtime recorded it: a container's state, a process's exit file), as lost
        when it was taken on and is gone or was stopped with its agent, as stopped when its
        attempt has ended. Each one reported is remembered, so an order for it read later (one
        the last agent had not acknowledged) never runs it again. The ends of their own come
        first, in the order they happened: they came before the agent's death, and so before
        any task of theirs was lost with it (the policy reads ends in order).
        `placed`: `placed_here()` when the caller has read it already."""
        if placed is None:
            placed = await self.placed_here()
        settled: set[TaskKey] = set()
        exits: list[tuple[float, TaskKey, AttemptRecord, TaskStatus, int]] = []
        others: list[tuple[TaskKey, AttemptRecord, TaskStatus, TaskCause, str]] = []
        # This agent installation's tasks only (its work root): another one on the same engine
        # under the same node name (a second checkout, a test beside it) keeps its own.
        mine = {LABEL_NODE: self.node, LABEL_HOME: self.tasks.where.work_root}
        for found in await self.runtime.find(mine):
            key = key_of(found)
            if key is None:
                continue
            entry = placed.get(key)
            live = entry is not None and not entry[0].ended
            # Adopted even when it ended meanwhile: its exit is then reported as any other,
            # with what it wrote while no agent ran (read on from where the last agent stopped).
            # So is one whose end the bus has already (the last agent's fence told it), for
            # that output: its end is told again, which changes nothing.
            ended = found.exit_code is not None
            adopt = (live and (found.running or ended)) or (entry is None and ended)
            if adopt and self.runtime.can_adopt:
                try:
                    await self.adopt(key, found, entry[1] if entry else None)
                    settled.add(key)
                    continue
                except Exception as exc:
                    self.log.warning("agent.adopt_failed", task=found.name, error=str(exc))
            self.log.info("agent.reap", task=found.name, live=live)
            code = await self.runtime.reap(found)  # its own exit code, if it ended by itself
            if entry is None:
                continue
            attempt, t = entry
            settled.add(key)
            note = stop_note(self.tasks.where.work_root, *key)
            stopped = noted_stop(note)
            with contextlib.suppress(OSError):
                note.unlink(missing_ok=True)
            if not live:
                others.append((key, attempt, t, TaskCause.KILLED, "its attempt ended"))
            elif code is not None and stopped is not None:  # it ended as the last agent stopped it
                others.append((key, attempt, t, *stopped))
            elif code is not None:
                exits.append((found.ended_at or time.time(), key, attempt, t, code))
            else:
                others.append((key, attempt, t, TaskCause.PLATFORM, LOST))
        for at, key, attempt, t, code in sorted(exits, key=lambda e: e[0]):
            when = datetime.fromtimestamp(at, UTC)
            reason = "ended while its agent was away"
            self.tasks.report_ended(attempt, t.spec(), TaskCause.EXITED, code, reason, at=when)
            self.tasks.remember(key)
        for key, attempt, t, cause, reason in others:
            self.tasks.report_ended(attempt, t.spec(), cause, NOT_STARTED, reason)
            self.tasks.remember(key)
        self.assignments.keep_only({a.key for a, _ in placed.values() if not a.ended})
        report = self.tasks.report_ended
        for key, (attempt, t) in placed.items():
            if key in settled:
                continue
            if attempt.ended:
                report(attempt, t.spec(), TaskCause.KILLED, NOT_STARTED, "never started: attempt ended")
                self.tasks.remember(key)
            elif await self.was_taken(key, t):
                report(attempt, t.spec(), TaskCause.PLATFORM, NOT_STARTED, LOST)
                self.tasks.remember(key)

    async def was_taken(self, key: TaskKey, t: TaskStatus) -> bool:
        """Whether an earlier run of this agent took the task on: it started it, or it reported
        the task's endpoint (which it does before acknowledging the order), or for a solo task
        (which reports no endpoint) it kept the order on this node, as it does before
        acknowledging it. A task whose order is still waiting in the queue is neither, and will
        be run when the order is read."""
        if t.state != TaskState.PLACED:
            return True
        job_id, attempt, role, index = key
        kept = self.assignments.load(job_id, attempt)
        if kept is not None and kept.solo:
            return True
        # Whether it is there, not what it says: the stream's subject count (a direct get of one's
        # own report would hand its bytes to any reply subject the asker names: docs/security.md).
        subject = subjects.task_event(job_id, attempt, role, index, "endpoint", self.node)
        info = await self.js.stream_info(subjects.EVENTS_STREAM, subjects_filter=subject)
        return bool(info.state.subjects)

    async def adopt(self, key: TaskKey, found: FoundTask, t: TaskStatus | None) -> None:
        """Watch a found task until it ends, from the order kept on this node; `t`: its status
        on the bus (None: the bus counts it as ended)."""
        job_id, n, role, index = key
        assignment = self.assignments.load(job_id, n)
        if assignment is None:
            raise LaunchError(f"no order of attempt {attempt_key(job_id, n)} kept on this node")
        mine = [s for s in assignment.mine if s.key == f"{role}.{index}"]
        spec = t.spec() if t is not None else mine[0] if mine else None
        if spec is None:
            raise LaunchError(f"no task {role}.{index} in the order of {attempt_key(job_id, n)} kept here")
        ports = [int(p) for p in found.labels.get(LABEL_PORTS, "").split(",") if p]
        self.tasks.ports.take_exact(ports)
        endpoint = Endpoint.of(spec, self.address, ports, assignment.config.role(role).portList)
        cluster = assignment.own_spec(endpoint)  # a solo task's, as it was started with
        task = LocalTask(assignment=assignment, spec=spec, endpoint=endpoint, ports=ports, cluster=cluster)
        stopped = noted_stop(stop_note(self.tasks.where.work_root, *key))
        if stopped is not None:  # the last agent was stopping it: its end is told as that stop
            task.kill_cause, task.kill_reason = stopped
        task.handle = await self.runtime.attach(
            found.name, lambda line: self.tasks.output(task, line), since=self.read_from
        )
        self.tasks.watch(key, task)
        self.log.info("agent.adopted", task=found.name)

    async def stop_obsolete(self, wait: bool = False, routine: bool = False) -> None:
        """Stop local tasks the bus no longer counts as live (their attempt ended, or they were
        declared lost while this agent was cut off). With `wait`, return once they are gone.

        `routine`: the heartbeat's backstop for a kill order never received, which reads each
        attempt's whole record (O(gang)). Every node of a gang of N reads it, so checking each
        attempt every ROUTINE_EVERY seconds would cost the cluster O(N²) a period; an attempt is
        checked at most every ROUTINE_EVERY seconds per ROUTINE_TASKS tasks of its gang
        instead: O(1) a second per node, O(N) for the cluster, whatever the gang's size."""
        stops = []
        started = {key: task for key, task in self.tasks.live.items() if task.handle is not None}
        if routine:
            at = asyncio.get_running_loop().time()
            live = {(key[0], key[1]) for key in started}
            self._due = {a: t for a, t in self._due.items() if a in live}
            due = {a for a in live if at >= self._due.get(a, -math.inf)}
            started = {key: task for key, task in started.items() if (key[0], key[1]) in due}
            for key, task in started.items():
                gang = task.assignment.config.total_tasks
                self._due[(key[0], key[1])] = at + ROUTINE_EVERY * max(1.0, gang / ROUTINE_TASKS)
        obsolete = await self.tasks.obsolete(started)  # one read per attempt, not per task
        for key, task in started.items():
            if key not in obsolete or self.tasks.live.get(key) is not task:
                continue
            self.log.warning("agent.obsolete_task", task=task.name)
            stopping = asyncio.create_task(self.tasks.stop(task, "obsolete attempt", 0))
            self._stopping.add(stopping)
            stopping.add_done_callback(self._stopping.discard)
            stops.append(stopping)
        if wait and stops:
            await asyncio.wait(stops)


def key_of(found: FoundTask) -> TaskKey | None:
    lb = found.labels
    try:
        return (lb[LABEL_JOB], int(lb[LABEL_ATTEMPT]), lb[LABEL_ROLE], int(lb[LABEL_INDEX]))
    except (KeyError, ValueError):
        return None
