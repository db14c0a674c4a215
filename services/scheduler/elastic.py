"""Elastic roles (PaddlePaddle EDL), a pure core: how far a running attempt's elastic roles grow
into what is free now, and which of their newest tasks to remove so that a waiting job fits.

A role with `minTaskNumber`/`maxTaskNumber` is placed at its minimum. Then, in each cycle:
- if a job waits that does not fit, the fewest newest tasks of elastic roles above their
  minimum whose removal lets it fit are removed (never below a minimum; nothing is removed if
  removing every candidate would not be enough);
- else every elastic role grows into free capacity, up to its maximum, all it can at once
  (one membership change rather than one per task), and replaces tasks that failed; a role one
  of whose tasks has succeeded is finishing and no longer grows.
Waiting work comes first: a role grows only when no waiting job could be let in by shrinking,
nor fits in what tasks still stopping will free (removed ones, or a preempted or called-back
gang's), so what it takes is room no waiting job can use now (EDL's point: idle GPUs do work).
An attempt changes at most once per `dwell` seconds and only while every member runs, so a
gang that is still starting, or just changed, is left alone (no thrashing).

`cluster` (what is placed now) is always left as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from muster.services.scheduler import placement
from muster.shared import settings
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import AttemptRecord, TaskSpec, TaskState

DWELL = settings.seconds("MUSTER_ELASTIC_DWELL", 30.0)  # seconds between changes of one attempt


def settled(record: AttemptRecord, at: datetime, dwell: float = DWELL) -> bool:
    """Whether an elastic attempt may change now: not ended, every member running, and its last
    change (or its placement) at least `dwell` seconds ago."""
    if record.ended or not record.elastic:
        return False
    members = record.members()
    if not members or any(t.state != TaskState.RUNNING for t in members):
        return False
    return (at - (record.resized_at or record.placed_at)).total_seconds() >= dwell


def grow(cluster: placement.Cluster, config: JobConfig, record: AttemptRecord) -> list[TaskSpec]:
    """The tasks to add to the attempt's elastic roles now: as many as fit, up to each role's
    maximum, each with the next index after its role's highest so far."""
    added: list[TaskSpec] = []
    counts = record.counts()
    try:
        for role_no, role in enumerate(config.taskRoles):
            if not role.elastic or role.maxTaskNumber is None:
                continue
            if counts.get(role.name, 0) >= role.maxTaskNumber:
                continue
            if any(t.role == role.name and t.state == TaskState.SUCCEEDED for t in record.tasks):
                continue  # it is finishing: a task that succeeded is the training's end, not room
            one = config.model_copy(
                update={
                    "taskRoles": [
                        role.model_copy(
                            update={"taskNumber": 1, "minTaskNumber": None, "maxTaskNumber": None}
                        )
                    ]
                }
            )
            index = max((t.index for t in record.tasks if t.role == role.name), default=-1) + 1
            for _ in range(role.maxTaskNumber - counts.get(role.name, 0)):
                placed = cluster.place_alone(placement.PendingJob(record.key, one))
                if not placed:
                    break
                spec = TaskSpec(
                    role=role.name,
                    role_no=role_no,
                    index=index,
                    node=placed[0].node,
                    gpus=placed[0].gpus,
                    gpu_milli=placed[0].gpu_milli,  # a share of a GPU (left out: a whole one, refused)
                )
                cluster.allocate(config, [spec])  # taken, for the next one
                added.append(spec)
                index += 1
    finally:
        for spec in added:
            cluster.release(config, [spec])
    return added


def freeing_for(
    cluster: placement.Cluster,
    waiting: placement.PendingJob,
    freeing: Sequence[tuple[JobConfig, TaskSpec]],
) -> bool:
    """Whether `waiting` fits once the `freeing` tasks (stopping: removed by a shrink, or of a
    gang preempted, called back or ended; each holds its node until its agent reports it
    stopped) are gone: room already being made for it, which no role may grow into meanwhile."""
    released: list[tuple[JobConfig, TaskSpec]] = []
    try:
        for config, spec in freeing:
            if spec.node not in cluster.nodes:  # out of placement (restarting, lost): frees nothing
                continue  # here, and allocating it back would raise (the cycle with it)
            cluster.release(config, [spec])
            released.append((config, spec))
        return cluster.place_alone(waiting) is not None
    finally:
        for config, spec in released:
            cluster.allocate(config, [spec])


def shrink_for(
    cluster: placement.Cluster,
    waiting: placement.PendingJob,
    running: Sequence[tuple[JobConfig, AttemptRecord]],
) -> list[tuple[AttemptRecord, TaskSpec]] | None:
    """The newest tasks of elastic roles above their minimum whose removal lets `waiting` be
    placed, as few as will do; None when removing every one of them would not be enough."""
    options: list[tuple[datetime, int, JobConfig, AttemptRecord, TaskSpec]] = []
    for config, record in running:
        counts = record.counts()
        for role in config.taskRoles:
            if not role.elastic or role.minTaskNumber is None:
                continue
            members = sorted((t for t in record.members() if t.role == role.name), key=lambda t: -t.index)
            for t in members[: max(0, counts.get(role.name, 0) - role.minTaskNumber)]:
                if t.node not in cluster.nodes:  # out of placement: removing it frees nothing
                    continue  # here, and allocating it back would raise (the cycle with it)
                options.append((t.placed_at or record.placed_at, t.index, config, record, t.spec()))
    options.sort(key=lambda o: (o[0], o[1]), reverse=True)  # newest first

    def fits() -> bool:
        return cluster.place_alone(waiting) is not None

    released: list[tuple[JobConfig, AttemptRecord, TaskSpec]] = []
    try:
        for _, _, config, record, spec in options:
            cluster.release(config, [spec])
            released.append((config, record, spec))
            if fits():
                break
        else:
            return None
        for item in list(reversed(released)):  # the oldest taken first: give back what was not needed
            config, _, spec = item
            cluster.allocate(config, [spec])
            if fits():
                released.remove(item)
            else:
                cluster.release(config, [spec])
        return [(record, spec) for _, record, spec in released]
    finally:
        for config, _, spec in released:
            cluster.allocate(config, [spec])
