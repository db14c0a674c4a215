"""The cluster as the active scheduler sees it, as Prometheus gauges computed on scrape from the
view it already keeps (no bus traffic): jobs by state and virtual cluster, the queue and the age
of its oldest job, nodes by status and their heartbeat age, GPUs total/allocated/free by node and
model. Only the active leader reports them (a standby's view may lag), so every series has one
source however many replicas run. Labels are bounded: states, virtual clusters, nodes, models.

`snapshot` is pure (the view and a time in, samples out); `ClusterCollector` is the
prometheus_client side, and never raises: a failure is counted, not a broken /metrics."""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import structlog
from prometheus_client import REGISTRY
from prometheus_client import Counter as PromCounter
from prometheus_client.core import GaugeMetricFamily

from muster.services.scheduler.view import View
from muster.shared.messages import JobState, now

log = structlog.get_logger(service="scheduler")

COLLECT_FAILED = PromCounter(
    "muster_scheduler_collect_failures_total", "Scrapes whose cluster gauges could not be computed"
)


@dataclass
class Snapshot:
    jobs: Counter[tuple[str, str]] = field(default_factory=Counter)  # (state, vc) -> jobs
    queue: Counter[str] = field(default_factory=Counter)  # vc -> waiting jobs
    oldest_wait: float = 0.0  # seconds the oldest waiting job has waited since submission
    nodes: Counter[str] = field(default_factory=Counter)  # status -> nodes
    heartbeat_age: dict[str, float] = field(default_factory=dict)  # node -> seconds
    gpus: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (node, model) -> [total, used]


def snapshot(view: View, at: datetime) -> Snapshot:
    """The gauges of `view` at time `at`. Every state appears for the default VC and every VC
    that has a job, so a state that empties reads 0 instead of vanishing."""
    snap = Snapshot()
    oldest: datetime | None = None
    vcs = {"default"}
    for job in view.jobs.values():
        vc = job.config.virtualCluster
        vcs.add(vc)
        snap.jobs[(job.state.value, vc)] += 1
        if job.state == JobState.WAITING:
            snap.queue[vc] += 1
            oldest = job.submitted_at if oldest is None else min(oldest, job.submitted_at)
    for vc in vcs:
        for state in JobState:
            snap.jobs[(state.value, vc)] += 0
        snap.queue[vc] += 0
    snap.oldest_wait = max(0.0, (at - oldest).total_seconds()) if oldest else 0.0
    for status in ("alive", "lost", "drained", "restarting"):
        snap.nodes[status] += 0
    for name, info in view.nodes.items():
        age = max(0.0, (at - (view.last_beat(name) or info.heartbeat_at)).total_seconds())
        snap.heartbeat_age[name] = age
        if info.drained:
            snap.nodes["drained"] += 1
        elif info.restarting_until is not None and at < info.restarting_until:
            snap.nodes["restarting"] += 1
        elif age > view.node_timeout.total_seconds():
            snap.nodes["lost"] += 1
        else:
            snap.nodes["alive"] += 1
    for name, node in view.cluster.nodes.items():  # the schedulable nodes, with what is held
        for device in node.gpus:
            counts = snap.gpus.setdefault((name, device.model), [0, 0])
            counts[0] += 1
            counts[1] += device.index in node.used_gpus or device.index in node.shared  # held or shared
    return snap


def families(snap: Snapshot) -> Iterator[GaugeMetricFamily]:
    jobs = GaugeMetricFamily("muster_jobs", "Jobs by state and virtual cluster", labels=["state", "vc"])
    for (state, vc), n in sorted(snap.jobs.items()):
        jobs.add_metric([state, vc], n)
    queue = GaugeMetricFamily(
        "muster_queue_jobs", "Jobs waiting to be placed, by virtual cluster", labels=["vc"]
    )
    for vc, n in sorted(snap.queue.items()):
        queue.add_metric([vc], n)
    oldest = GaugeMetricFamily(
        "muster_queue_oldest_wait_seconds",
        "Seconds since the oldest waiting job was submitted (0: none waits)",
    )
    oldest.add_metric([], snap.oldest_wait)
    nodes = GaugeMetricFamily("muster_nodes", "Nodes by status", labels=["status"])
    for status, n in sorted(snap.nodes.items()):
        nodes.add_metric([status], n)
    age = GaugeMetricFamily(
        "muster_node_heartbeat_age_seconds", "Seconds since the node's last heartbeat", labels=["node"]
    )
    for name, seconds in sorted(snap.heartbeat_age.items()):
        age.add_metric([name], seconds)
    total = GaugeMetricFamily("muster_gpus", "GPUs of schedulable nodes", labels=["node", "model"])
    used = GaugeMetricFamily("muster_gpus_allocated", "GPUs held by placed tasks", labels=["node", "model"])
    free = GaugeMetricFamily("muster_gpus_free", "GPUs free to place on", labels=["node", "model"])
    for (name, model), (n, u) in sorted(snap.gpus.items()):
        total.add_metric([name, model], n)
        used.add_metric([name, model], u)
        free.add_metric([name, model], n - u)
    yield from (jobs, queue, oldest, nodes, age, total, used, free)


class ClusterCollector:
    """Registered once per process; reports the view of the scheduler in this process that leads."""

    def __init__(self) -> None:
        self.schedulers: weakref.WeakSet[Any] = weakref.WeakSet()

    def describe(self) -> list[Any]:
        return []  # computed on scrape: nothing to check at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            leader = next((s for s in list(self.schedulers) if s.leading), None)
            if leader is None:
                return
            out = list(families(snapshot(leader.view, now())))
        except Exception as exc:
            COLLECT_FAILED.inc()
            log.warning("scheduler.metrics_failed", error=str(exc) or type(exc).__name__)
            return
        yield from out


COLLECTOR = ClusterCollector()
REGISTRY.register(COLLECTOR)
