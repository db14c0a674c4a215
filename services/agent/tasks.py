"""The lifecycle of the tasks on this node: a task taken on waits for its attempt's cluster spec
(the rendezvous barrier), is started by the runtime, watched until it ends, stopped when told,
and reported exactly once with a typed cause. Tasks that ended (or were reported as never
started) are remembered, so a late or repeated order never runs one again."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from prometheus_client import Counter, Gauge

from muster.services.agent import workdirs
from muster.services.agent.gpushare import MpsDaemons, MpsError
from muster.services.agent.inventory import PortPool
from muster.services.agent.launch import (
    Where,
    attempt_path,
    build_launch,
    gpu_share,
    resize_signal,
    spec_version,
    task_auth,
    task_env,
    task_name,
)
from muster.services.agent.output import OutputLimits, Shipper, output_path
from muster.services.agent.prepare import (
    SYNCED_MARK,
    CodeSyncs,
    Prepared,
    check_source,
    resolve_datasets,
    sync_target,
)
from muster.services.agent.progress import Progress
from muster.services.agent.reporting import Reporter
from muster.services.agent.rsh import Rsh
from muster.services.agent.runtime import LaunchError, RunningTask, Runtime, note_stop, stop_note
from muster.services.agent.sharing import Attempts, Specs
from muster.services.agent.workdirs import Workdirs
from muster.shared import mpi, subjects
from muster.shared.messages import (
    Assignment,
    AttemptRecord,
    ClusterSpec,
    Dataset,
    Endpoint,
    GpuSharing,
    TaskCause,
    TaskEvent,
    TaskEventKind,
    TaskSpec,
    attempt_key,
    dataset_refusal,
)
from muster.shared.secrets import Masker
from muster.shared.store import Store, confirmed

log = structlog.get_logger(service="agent")

TASKS_LIVE = Gauge("muster_agent_tasks", "Tasks this agent is running", ["node"])
TASKS_ENDED = Counter("muster_agent_tasks_ended_total", "Tasks ended on this agent", ["node", "outcome"])
LAST_LINES = 30
# Exit code reported for a task that never started (launch failure, killed before the barrier).
NOT_STARTED = -1
DATASET_WAIT = 10.0  # seconds to read a dataset's record
SPEC_READ_WAIT = 5.0  # seconds to read an attempt's stored spec
REMEMBERED = 10_000  # ended tasks remembered against late orders
HUNG_GRACE = 5.0  # seconds between SIGTERM and SIGKILL for a task stopped as hung
TaskKey = tuple[str, int, str, int]  # job id, attempt, role, index


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
    kill_cause: TaskCause | None = None  # how a stop is reported when not KILLED (a hang: PLATFORM)
    kill_grace: float = 0.0
    starting: bool = False  # the runtime is starting it: it must not be cancelled then
    cancelled: bool = False  # its runner was cancelled by a stop (never twice)
    masker: Masker | None = None  # its job's secret values, cut out of its output
    version: int = 0  # the spec version its environment describes (elastic attempts have many)
    # the spec it was started with (None: adopted, or not read yet); a solo task's from the start
    cluster: ClusterSpec | None = None
    shipper: Shipper | None = None  # its output: to its file and, within limits, the stream
    mps_gpu: int | None = None  # the shared GPU whose MPS daemon it uses (held until it ends)

    def stopped(self) -> tuple[TaskCause, str] | None:
        """How its end is told, if it was stopped on purpose: its cause and reason."""
        if not self.kill_reason:
            return None
        if self.kill_cause is not None:
            return self.kill_cause, self.kill_reason
        return TaskCause.KILLED, f"killed: {self.kill_reason}"

    def mask(self, text: str) -> str:
        if self.masker is None:
            self.masker = Masker.for_env(self.assignment.config.jobEnvs, self.assignment.secret_names)
        return self.masker(text)

    @property
    def name(self) -> str:
        a = self.assignment
        return task_name(a.job_id, a.attempt, self.spec.role, self.spec.index)


class Tasks:
    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        runtime: Runtime,
        reporter: Reporter,
        attempts: Attempts,
        ports: PortPool,
        where: Where,
        specs: Specs | None = None,
        limits: OutputLimits | None = None,
    ):
        self.nc, self.js, self.runtime, self.reporter = nc, js, runtime, reporter
        self.limits = limits or OutputLimits.from_env()  # what a task's output may cost (output.py)
        self.keep_output = runtime.name != "sim"  # a sim task's two lines need no file
        self.specs = specs or Specs(nc, js)  # cluster specs: one read per attempt
        self.attempts, self.ports, self.where = attempts, ports, where
        self.node = where.node
        self.live: dict[TaskKey, LocalTask] = {}
        self.finished: collections.OrderedDict[TaskKey, None] = collections.OrderedDict()
        self.detaching = False  # the agent stops for a restart: tasks go on, nothing is reported
        self._following: dict[tuple[str, int], asyncio.Task[None]] = {}  # elastic attempts' specs
        self.log = log.bind(node=self.node)
        self.code_syncs = CodeSyncs()  # codeSync: one fetch per attempt on this node
        self._datasets: Store[Dataset] | None = None
        self.progress = Progress(nc, self.node, self.hung)  # training metrics, hang detection
        self.rsh: Rsh | None = None  # MPI jobs' daemons in peer tasks (the agent sets it)
        # Attempt directories: kept while a task of theirs is live here, removed after (workdirs.py).
        self.workdirs = Workdirs(where.work_root, self._attempts_live, self.node)
        self._serving: set[asyncio.Task[None]] = set()
        # --gpu-sharing mps: the MPS daemon of each shared GPU (services/agent/gpushare.py).
        self.mps = MpsDaemons(where.work_root) if where.gpu_sharing is GpuSharing.MPS else None

    def known(self, key: TaskKey) -> bool:
        """Whether this agent runs the task, or has already reported its end."""
        return key in self.live or key in self.finished

    def remember(self, key: TaskKey) -> None:
        self.finished[key] = None
        while len(self.finished) > REMEMBERED:
            self.finished.popitem(last=False)

    def _attempts_live(self) -> set[tuple[str, int]]:
        return {(job, n) for job, n, _, _ in self.live}

    def of_attempt(self, job_id: str, attempt: int) -> list[LocalTask]:
        return [t for (job, n, _, _), t in self.live.items() if job == job_id and n == attempt]

    # ------------------------------------------------------------ starting and watching

    def take(self, key: TaskKey, task: LocalTask) -> None:
        """Run a task taken on: wait for the spec, start it, watch it, report its end."""
        self.live[key] = task
        TASKS_LIVE.labels(self.node).set(len(self.live))
        task.runner = asyncio.create_task(self._run(key, task))

    def watch(self, key: TaskKey, task: LocalTask) -> None:
        """Watch a task already running (adopted after a restart) until it ends."""
        self.live[key] = task
        TASKS_LIVE.labels(self.node).set(len(self.live))
        share = gpu_share(task.assignment, task.spec, self.where)
        if self.mps is not None and share is not None and share[1] is not None:
            task.mps_gpu = task.spec.gpus[0]  # its daemon, left running by the agent before
            self.mps.adopt(task.mps_gpu, task.name)
        if not self._hosts_ranks_only(task):
            self.progress.track(key, task.assignment.config)
        task.runner = asyncio.create_task(self._watch(key, task))
        if task.assignment.config.elastic:  # its gang changes on: from the version it was told
            task.version = spec_version(task.assignment, task.spec, self.where)
            self._follow(task.assignment.job_id, task.assignment.attempt)
        if self._is_mpi_launcher(task):  # its mpirun may start more daemons: listen again
            serving = asyncio.create_task(self._serve_adopted(task))
            self._serving.add(serving)
            serving.add_done_callback(self._serving.discard)

    def _is_mpi_launcher(self, task: LocalTask) -> bool:
        shape = mpi.shape(task.assignment.config)
        return (
            self.rsh is not None and shape is not None and shape.is_launcher(task.spec.role, task.spec.index)
        )

    @staticmethod
    def _hosts_ranks_only(task: LocalTask) -> bool:
        """An MPI worker that is not the launcher: it prints nothing of its own (its ranks'
        output goes to mpirun), so it is not watched for progress (the launcher is)."""
        shape = mpi.shape(task.assignment.config)
        return shape is not None and shape.hosts_ranks_only(task.spec.role, task.spec.index)

    async def _serve_adopted(self, task: LocalTask) -> None:
        a = task.assignment
        assert self.rsh is not None
        try:
            await self.rsh.serve(a.job_id, a.attempt, attempt_path(self.where, a))
        except OSError as exc:
            self.log.warning("agent.rsh_not_served", task=task.name, error=str(exc))

    async def _run(self, key: TaskKey, task: LocalTask) -> None:
        a = task.assignment
        try:
            cluster = task.cluster or await self.specs.wait(a.job_id, a.attempt, task.spec.key)
            handle, share = await self._start(key, task, cluster)
            self.progress.started(key)  # its silence counts from now, not from an image pull
            if task.kill_reason is not None:  # killed while it was being started
                await handle.stop(task.kill_grace)
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
        shared = {"gpu_sharing": self.where.gpu_sharing} if share is not None else {}
        self.report(a, task.spec, TaskEventKind.RUNNING, **shared)
        if a.config.elastic:
            self._follow(a.job_id, a.attempt)
        self.log.info("agent.task_started", task=task.name)
        await self._watch(key, task)

    async def _start(
        self, key: TaskKey, task: LocalTask, cluster: ClusterSpec
    ) -> tuple[RunningTask, tuple[int, Path | None] | None]:
        """Start the task from its attempt's spec: it running, and its GPU share if it holds
        part of one."""
        a = task.assignment
        if await self.obsolete([key]):
            raise asyncio.CancelledError
        prepared = await self.prepare(a)
        share = gpu_share(a, task.spec, self.where)
        if self.mps is not None and share is not None and share[1] is not None:
            await self._use_mps(task)
        # Not kept while the task runs (a local here only): its environment lists the whole gang,
        # O(N) bytes per task, ~200 MB for a sim process holding a 2,000-task gang.
        # The authFile's read is given AUTH_TIMEOUT, which a hung filesystem takes whole: in a
        # thread. Only the read: the launch writes files its attempt's tasks share (the hostfile).
        auth = await asyncio.to_thread(task_auth, a, task.spec, self.where) if a.config.authFile else None
        launch = build_launch(a, task.spec, task.ports, cluster, self.where, prepared, auth)
        task.version = cluster.version
        task.cluster = cluster
        if self.rsh is not None and self._is_mpi_launcher(task):
            await self.rsh.serve(a.job_id, a.attempt, attempt_path(self.where, a))
        task.starting = True
        if not self._hosts_ranks_only(task):  # silent by design: mpirun prints for it
            self.progress.track(key, a.config)  # before its first line can come
        task.handle = handle = await self.runtime.start(launch, lambda line: self.output(task, line))
        return handle, share

    async def _use_mps(self, task: LocalTask) -> None:
        """Its GPU's MPS daemon, started if none runs; one that cannot start refuses the task
        (a platform failure: it may start elsewhere, or here once the daemon can)."""
        assert self.mps is not None
        gpu = task.spec.gpus[0]
        try:
            await self.mps.acquire(gpu, task.name)
        except MpsError as exc:
            raise LaunchError(f"cannot start NVIDIA MPS for GPU {gpu}: {exc}", TaskCause.PLATFORM) from None
        task.mps_gpu = gpu

    async def prepare(self, a: Assignment) -> Prepared | None:
        """The job's datasets and its code, fetched once per attempt here (prepare.py)."""
        config = a.config
        if not config.data and config.codeSync is None:
            return None
        roots = list(self.where.data_roots)
        mounts, env = await resolve_datasets(config, a.user, self._dataset, roots, self.where.containers)
        code_dir = None
        if config.codeSync is not None:
            attempt_dir = attempt_path(self.where, a)
            attempt_dir.mkdir(parents=True, exist_ok=True)
            check_source(config.codeSync, a.user, roots)
            code_dir, own = sync_target(config, a.user, attempt_dir, roots)
            mark = attempt_dir / SYNCED_MARK
            shared = workdirs.job_code(self.where.work_root, a.job_id)  # fetched once per job here
            await self.code_syncs.sync(a.job_id, a.attempt, config.codeSync, code_dir, own, mark, shared)
        return Prepared(mounts=mounts, env=env, code_dir=code_dir)

    async def _dataset(self, name: str) -> Dataset | None:
        """The operators' record of dataset `name` (bounded wait; the bus away: a platform error)."""
        try:
            if self._datasets is None:
                kv = await asyncio.wait_for(self.js.key_value(subjects.DATASETS_BUCKET), DATASET_WAIT)
                self._datasets = Store(kv, Dataset, check=dataset_refusal)
            return await asyncio.wait_for(self._datasets.get(name), DATASET_WAIT)
        except (TimeoutError, nats.errors.Error) as exc:
            why = str(exc) or type(exc).__name__
            raise LaunchError(f"cannot read dataset {name!r}: {why}", TaskCause.PLATFORM) from None

    async def _watch(self, key: TaskKey, task: LocalTask) -> None:
        assert task.handle is not None
        try:
            code = await task.handle.wait()
            stopped = task.stopped()
            if stopped is not None:
                cause, reason = stopped
            elif task.handle.vanished:
                cause, reason = TaskCause.PLATFORM, "its container was removed under it (docker rm -f?)"
            elif task.handle.oom_killed:
                limit = task.assignment.config.role(task.spec.role).memoryMB
                cause, reason = TaskCause.OOM, f"out of memory (limit {limit} MB)"
            else:
                cause, reason = TaskCause.EXITED, ""
            if cause == TaskCause.EXITED and code != 0 and task.mps_gpu is not None and self.mps:
                # A neighbour's fatal fault can end every client of the GPU's MPS server.
                why = await self.mps.judge(task.mps_gpu, task.name)
                if why is not None:
                    cause, reason = TaskCause.PLATFORM, f"failed on shared GPU {task.mps_gpu}: {why}"
        except asyncio.CancelledError:
            raise  # detaching: the task goes on, the next agent adopts it
        except Exception as exc:
            code, cause, reason = NOT_STARTED, TaskCause.PLATFORM, f"lost track of the task: {exc}"
        await self._finish(key, task, cause, code, reason)

    async def _finish(self, key: TaskKey, task: LocalTask, cause: TaskCause, code: int, reason: str) -> None:
        self.ports.release(task.ports)
        if task.mps_gpu is not None and self.mps is not None:
            try:
                await self.mps.release(task.mps_gpu, task.name)
            except Exception as exc:
                self.log.warning("agent.mps_quit_failed", gpu=task.mps_gpu, error=str(exc)[:200])
        with contextlib.suppress(Exception):
            await self.progress.untrack(key)
        if self.rsh is not None and self._is_mpi_launcher(task):
            self.rsh.forget(task.assignment.job_id, task.assignment.attempt)
        self.live.pop(key, None)
        self.remember(key)
        TASKS_LIVE.labels(self.node).set(len(self.live))
        outcome = "succeeded" if cause == TaskCause.EXITED and code == 0 else "failed"
        TASKS_ENDED.labels(self.node, outcome).inc()
        reason = task.mask(reason)
        self.log.info("agent.task_ended", task=task.name, exit_code=code, cause=cause, reason=reason)
        if task.shipper is not None:  # its last lines (and what was cut) before its end is told
            await task.shipper.close()
        self.report_ended(task.assignment, task.spec, cause, code, reason, list(task.lines))
        if task.handle is not None:
            with contextlib.suppress(Exception):
                await task.handle.remove()
            with contextlib.suppress(OSError):
                self._stop_note(task).unlink(missing_ok=True)
        a = task.assignment
        if not self.of_attempt(a.job_id, a.attempt):  # its last task here: its directory may go
            self.workdirs.ended(a.job_id, a.attempt)

    async def obsolete(self, keys: Iterable[TaskKey]) -> set[TaskKey]:
        """Those of `keys` the bus no longer counts as live: their attempt or they ended, or their
        attempt has no record at all (asked of the bucket's leader too: a replica may lag). An
        order runs only once its record exists, so a record gone was pruned with its finished
        job (a node away past the retention, back with its tasks, or adopting them after a
        restart): nothing would ever stop them. One read of each attempt (shared by concurrent
        checks), each task found by its key; a record that does not decode says nothing."""
        by_attempt: dict[str, list[TaskKey]] = {}
        for key in keys:
            by_attempt.setdefault(attempt_key(key[0], key[1]), []).append(key)
        placements = await asyncio.gather(*(self.attempts.placement(k) for k in by_attempt))
        out = set()
        for name, found, tasks in zip(by_attempt, placements, by_attempt.values(), strict=True):
            if found is None and await confirmed(self.attempts.kv, name) is None:
                out.update(tasks)
            for key in tasks if found is not None else ():
                assert found is not None
                task = found.by_key.get(f"{key[2]}.{key[3]}")
                # Not in it: a record read before the task joined (an elastic role grew), live.
                # Removed from its elastic role: its kill order may have been lost with a leader.
                if found.record.ended or (task is not None and (task.state.ended or task.removed)):
                    out.add(key)
        return out

    def output(self, task: LocalTask, line: str) -> None:
        a, spec = task.assignment, task.spec
        line = task.mask(line)  # a task printing its secrets: logs and last_lines show ***
        task.lines.append(line)
        self.progress.line((a.job_id, a.attempt, spec.role, spec.index), line)
        if task.shipper is None:
            subject = subjects.task_logs(a.job_id, a.attempt, spec.role, spec.index, self.node)
            path = output_path(self.where.work_root, a.job_id, a.attempt, spec.role, spec.index)
            task.shipper = Shipper(
                self.nc.publish, subject, self.node, path if self.keep_output else None, self.limits
            )
        task.shipper.line(line)

    # ------------------------------------------------------------ elastic attempts: new gangs

    def _follow(self, job_id: str, attempt: int) -> None:
        """While this node runs tasks of an elastic attempt, follow its spec versions (one
        subscription per attempt)."""
        key = (job_id, attempt)
        if key not in self._following:
            self._following[key] = asyncio.create_task(self._refresh(job_id, attempt))

    async def _refresh(self, job_id: str, attempt: int) -> None:
        """Each new spec version: every running task here that is still in the gang gets its env
        file rewritten for it, then the job's resize signal if it asked for one
        (`extras.elastic.signal`). A task's own environment cannot change; the file can. The
        version stored last comes first: one published before this began (while a task's image
        was pulled, while no agent ran here) was heard by no one."""
        subject = subjects.cluster_spec(job_id, attempt)
        sub = await self.nc.subscribe(subject)
        try:
            with contextlib.suppress(Exception):  # none yet, garbage, or no answer: the next one
                stored = await asyncio.wait_for(
                    self.js.get_last_msg(subjects.EVENTS_STREAM, subject, direct=True), SPEC_READ_WAIT
                )
                await self._gang_changed(job_id, attempt, ClusterSpec.from_bytes(stored.data))
            while self.of_attempt(job_id, attempt):
                try:
                    msg = await sub.next_msg(timeout=2)
                    spec = ClusterSpec.from_bytes(msg.data)
                except nats.errors.TimeoutError:
                    continue
                except ValueError as exc:  # not a spec: the registry would never send it
                    self.log.warning("agent.bad_spec", job_id=job_id, attempt=attempt, error=str(exc)[:200])
                    continue
                await self._gang_changed(job_id, attempt, spec)
        finally:
            self._following.pop((job_id, attempt), None)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _gang_changed(self, job_id: str, attempt: int, spec: ClusterSpec) -> None:
        """Spec `spec` of the attempt: each running task here it is new to and lists is told."""
        for task in self.of_attempt(job_id, attempt):
            if task.handle is None or spec.version <= task.version or not spec.has(task.spec.key):
                continue
            try:
                task_env(task.assignment, task.spec, spec, self.where)
            except Exception as exc:
                self.log.warning("agent.env_refresh_failed", task=task.name, error=str(exc)[:200])
                continue
            task.version = spec.version
            sig = resize_signal(task.assignment.config.extras)
            if sig is not None:
                with contextlib.suppress(Exception):
                    await task.handle.signal(sig)
            self.log.info("agent.gang_changed", task=task.name, version=spec.version, signal=sig)

    # ------------------------------------------------------------ stopping

    async def stop(self, task: LocalTask, reason: str, grace: float) -> None:
        if task.kill_reason is None:
            task.kill_reason = reason
        task.kill_grace = grace
        if task.handle is not None:
            said = task.stopped()
            if said is not None and self.runtime.can_adopt and not note_stop(self._stop_note(task), *said):
                self.log.warning("agent.stop_not_noted", task=task.name)
            await task.handle.stop(grace)
        elif task.runner is not None and not task.starting and not task.cancelled:
            # Still waiting for the cluster spec: it never starts. Once: a second cancel would
            # cut short the end the first one is reporting (and it would be reported again).
            task.cancelled = True
            task.runner.cancel()
        # While the runtime is starting it, cancelling could orphan the new process or
        # container: `_run` sees kill_reason once start returns and stops it.
        if task.runner is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task.runner
            a, spec = task.assignment, task.spec
            key = (a.job_id, a.attempt, spec.role, spec.index)
            if task.runner.cancelled() and not self.detaching and self.live.get(key) is task:
                # Cancelled before its first step, so its own handler never ran: said here, or
                # it would stay live, its ports held and its end never reported.
                why = f"killed before start: {task.kill_reason}"
                await self._finish(key, task, TaskCause.KILLED, NOT_STARTED, why)

    def _stop_note(self, task: LocalTask) -> Path:
        a, spec = task.assignment, task.spec
        return stop_note(self.where.work_root, a.job_id, a.attempt, spec.role, spec.index)

    async def hung(self, key: TaskKey, timeout: int) -> None:
        """A running task printed nothing for `timeout` seconds (its job's noProgressTimeoutSec):
        it is stopped as a platform failure, so its attempt ends and the gang runs again."""
        task = self.live.get(key)
        if task is None or task.kill_reason is not None or task.handle is None:
            return
        task.kill_cause = TaskCause.PLATFORM
        reason = f"hung: no output for {timeout} s (noProgressTimeoutSec)"
        self.log.warning("agent.stopping_hung_task", task=task.name, reason=reason)
        await self.stop(task, reason, HUNG_GRACE)

    async def stop_all(self, reason: str, grace: float) -> None:
        await asyncio.gather(*(self.stop(t, reason, grace) for t in list(self.live.values())))

    def detach(self) -> None:
        """Stop watching every task and leave it running (the next agent adopts it)."""
        self.detaching = True
        for task in list(self.live.values()):
            if task.runner is not None:
                task.runner.cancel()
            if task.shipper is not None:
                task.shipper.flush()

    # ------------------------------------------------------------ reports

    def report(
        self, a: Assignment | AttemptRecord, spec: TaskSpec, kind: TaskEventKind, **fields: Any
    ) -> None:
        self.reporter.report(
            TaskEvent(
                job_id=a.job_id,
                attempt=a.attempt,
                role=spec.role,
                index=spec.index,
                node=self.node,
                kind=kind,
                **fields,
            )
        )

    def report_ended(
        self,
        a: Assignment | AttemptRecord,
        spec: TaskSpec,
        cause: TaskCause,
        code: int,
        reason: str,
        lines: list[str] | None = None,
        at: datetime | None = None,
    ) -> None:
        """`at`: when it ended, when that was not now (it ended while no agent watched)."""
        fields: dict[str, Any] = {"at": at} if at is not None else {}
        self.report(
            a,
            spec,
            TaskEventKind.EXITED,
            cause=cause,
            exit_code=code,
            reason=reason,
            last_lines=lines or [],
            **fields,
        )
