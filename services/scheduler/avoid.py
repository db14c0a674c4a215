"""Which nodes to place around, a pure core: nodes that keep failing attempts are avoided, but
never to the point that a job waits for ever."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from muster.services.scheduler import placement
from muster.shared import settings
from muster.shared.messages import AttemptRecord, FailureKind, TaskSpec

AVOID_AFTER = settings.number("MUSTER_AVOID_AFTER", 3, int, low=1)
AVOID_WINDOW = settings.seconds("MUSTER_AVOID_WINDOW", 600.0)


def nodes_to_avoid(attempts: Iterable[AttemptRecord], at: datetime) -> set[str]:
    """Nodes that keep failing attempts: platform failures at AVOID_AFTER different moments
    (10 s apart, so one agent restart that loses several tasks at once counts once) within
    AVOID_WINDOW seconds before `at`."""
    since = at - timedelta(seconds=AVOID_WINDOW)
    moments: dict[str, set[int]] = {}
    for a in attempts:
        if a.failure and a.failure.kind == FailureKind.PLATFORM and a.ended_at and a.ended_at >= since:
            moments.setdefault(a.failure.node, set()).add(int(a.ended_at.timestamp() // 10))
    return {node for node, seen in moments.items() if len(seen) >= AVOID_AFTER}


def plan_around(
    cluster: placement.Cluster,
    capacity: placement.Capacity,
    queue: Sequence[placement.PendingJob] | placement.Backlog,
    avoid: set[str],
    window: int | None = None,
    lending: Mapping[str, Any] | None = None,
) -> placement.Plan:
    """Place around the nodes to avoid; a job that fits only on them still runs there: avoiding
    is a preference, never a reason to wait forever. `cluster` is left as it was. `lending`:
    `Cluster.plan`'s running/ahead/stop_first, for the first plan (the second places only jobs
    that fit nowhere else)."""
    more = dict(lending or {})
    if not avoid:
        return cluster.plan(queue, capacity, avoid, window, **more)
    jobs: Sequence[placement.PendingJob]
    if isinstance(queue, Sequence):
        plan = cluster.plan(queue, capacity, avoid, window, **more)
        jobs = queue
    else:
        noted = _Noted(queue)
        plan = cluster.plan(noted, capacity, avoid, window, **more)
        jobs = noted.jobs
    stuck = [j for j in jobs if j.job_id in plan.unschedulable]
    if not isinstance(queue, Sequence):  # its rest came in any order: the second plan needs it
        by_id = {j.job_id: j for j in stuck}
        stuck = [by_id[job_id] for job_id in queue.in_order(by_id)]
    if not stuck:
        return plan
    configs = {j.job_id: j.config for j in jobs}
    placed = list(plan.placements.items())
    done: list[tuple[str, list[TaskSpec]]] = []
    try:
        for job_id, tasks in placed:  # what the first plan took is not there for the second
            cluster.allocate(configs[job_id], tasks)
            done.append((job_id, tasks))
        second = cluster.plan(stuck, capacity, window=window)
    finally:
        for job_id, tasks in reversed(done):
            cluster.release(configs[job_id], tasks)
    plan.placements.update(second.placements)
    for job_id in second.placements:
        plan.pending.pop(job_id, None)
    plan.pending.update(second.pending)
    return plan


class _Noted:
    """A backlog whose jobs are noted as the planner takes them (the second plan needs them)."""

    def __init__(self, queue: placement.Backlog) -> None:
        self.queue = queue
        self.jobs: list[placement.PendingJob] = []

    def __iter__(self) -> Iterator[placement.PendingJob]:
        for job in self.queue:
            self.jobs.append(job)
            yield job

    def rest(self) -> Iterator[placement.PendingJob]:
        for job in self.queue.rest():
            self.jobs.append(job)
            yield job

    def in_order(self, job_ids: Iterable[str]) -> list[str]:
        return self.queue.in_order(job_ids)
