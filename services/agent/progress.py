"""What a running task's output says of its progress: the training metrics it prints (picked out
of each line, published in batches to MUSTER_METRICS and shown as a gauge while it runs) and when
it last printed anything (a job's `noProgressTimeoutSec`: a task silent that long is hung).

Only tasks of jobs that declare `metrics` or `noProgressTimeoutSec` are tracked: for the others,
a line costs one dict lookup. A task printing thousands of lines a second costs the bus at most
one batch a second (`FLUSH`), of at most MAX_PER_METRIC points per metric (thinned beyond:
`muster.shared.trainmetrics.Series`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime

import structlog
from nats.aio.client import Client as NATS
from prometheus_client import Counter, Gauge

from muster.shared import subjects
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import MetricBatch, MetricPoint
from muster.shared.trainmetrics import LinePicker, Point, Series

log = structlog.get_logger(service="agent")

# Bounded: a label set exists only while its task runs here (removed when it ends), and a job
# declares at most 16 metrics.
TRAINING_METRIC = Gauge(
    "muster_task_metric",
    "Latest value of a training metric a running task printed (the job's `metrics`)",
    ["job_id", "task", "metric"],  # not `job`: Prometheus gives that label to the scrape job
)
BATCHES = Counter("muster_agent_metric_batches_total", "Metric batches published by this agent", ["outcome"])
HUNG = Counter("muster_agent_tasks_hung_total", "Tasks stopped as hung: silent past noProgressTimeoutSec")

FLUSH = 1.0  # a task's batches go out at most once a second
HEARTBEAT = 15.0  # a task that prints but no metric still says when it last printed this often
TaskKey = tuple[str, int, str, int]  # job id, attempt, role, index


@dataclass
class Tracked:
    key: TaskKey
    picker: LinePicker | None
    timeout: int | None
    series: Series = field(default_factory=Series)
    last_mono: float = field(default_factory=time.monotonic)
    published: float = 0.0  # monotonic time of the last batch
    hung: bool = False

    @property
    def task(self) -> str:
        return f"{self.key[2]}.{self.key[3]}"


def _point(p: Point) -> MetricPoint:
    at, step, name, value = p
    return MetricPoint(t=datetime.fromtimestamp(at, UTC), step=step, name=name, value=value)


class Progress:
    """`hung(key, silent_seconds)` is called (once) for a tracked task silent past its timeout."""

    def __init__(self, nc: NATS, node: str, hung: Callable[[TaskKey, int], Coroutine[None, None, None]]):
        self.nc, self.node, self.on_hung = nc, node, hung
        self.tracked: dict[TaskKey, Tracked] = {}
        self._loop: asyncio.Task[None] | None = None
        self._stopping: set[asyncio.Task[None]] = set()

    def track(self, key: TaskKey, config: JobConfig) -> None:
        """A task started running (or was adopted): its silence is counted from now."""
        names = [s.name for s in config.metric_specs]
        if not names and config.noProgressTimeoutSec is None:
            return
        self.tracked[key] = Tracked(key, LinePicker(names) if names else None, config.noProgressTimeoutSec)
        if self._loop is None or self._loop.done():
            self._loop = asyncio.create_task(self._run())

    def started(self, key: TaskKey) -> None:
        t = self.tracked.get(key)
        if t is not None:
            t.last_mono, t.hung = time.monotonic(), False

    def line(self, key: TaskKey, line: str) -> None:
        t = self.tracked.get(key)
        if t is None:
            return
        t.last_mono = time.monotonic()
        points, step = t.picker.pick(line) if t.picker is not None else ([], None)
        t.series.add(time.time(), points, step)

    async def untrack(self, key: TaskKey) -> None:
        """The task ended: its last points go out, its gauges go away."""
        t = self.tracked.pop(key, None)
        if t is None:
            return
        if t.series.pending or t.series.changed:
            await self._publish(t)
        job = key[0]
        if any(o.key[0] == job and o.task == t.task for o in self.tracked.values()):
            return  # another attempt's task of the same name runs here: its gauges stay
        for name in t.series.latest:
            with contextlib.suppress(KeyError):
                TRAINING_METRIC.remove(job, t.task, name)

    async def _run(self) -> None:
        while self.tracked:
            await asyncio.sleep(FLUSH / 2)
            try:
                await self._round()
            except Exception:  # a bug here must not end hang detection for every task
                log.exception("agent.progress_failed")

    async def _round(self) -> None:
        now = time.monotonic()
        for t in list(self.tracked.values()):
            due = t.series.pending or (t.series.changed and now - t.published >= HEARTBEAT)
            if due and now - t.published >= FLUSH:
                await self._publish(t)
            if t.timeout is not None and not t.hung and now - t.last_mono > t.timeout:
                t.hung = True
                HUNG.inc()
                log.warning("agent.task_hung", job_id=t.key[0], task=t.task, silent_s=t.timeout)
                stopping = asyncio.create_task(self._stop_hung(t))
                self._stopping.add(stopping)
                stopping.add_done_callback(self._stopping.discard)

    async def _stop_hung(self, t: Tracked) -> None:
        try:
            await self.on_hung(t.key, t.timeout or 0)
        except Exception:
            log.exception("agent.stop_hung_failed", job_id=t.key[0], task=t.task)

    async def _publish(self, t: Tracked) -> None:
        points, dropped = t.series.take()
        t.published = time.monotonic()
        job, attempt, role, index = t.key
        for name, (_, _, _, value) in t.series.latest.items():
            TRAINING_METRIC.labels(job, t.task, name).set(value)
        last = t.series.last_output
        batch = MetricBatch(
            job_id=job,
            attempt=attempt,
            role=role,
            index=index,
            node=self.node,
            points=[_point(p) for p in points],
            latest=[_point(p) for p in t.series.latest.values()],
            dropped=dropped,
            last_output_at=datetime.fromtimestamp(last, UTC) if last is not None else None,
        )
        try:
            subject = subjects.task_metrics(job, attempt, role, index, self.node)
            await self.nc.publish(subject, batch.to_bytes())
            BATCHES.labels("published").inc()
        except Exception as exc:  # the bus is away: the points are lost, the task goes on
            BATCHES.labels("failed").inc()
            log.warning("agent.metrics_publish_failed", job_id=job, task=t.task, error=str(exc)[:200])
