"""The queue's order without runtimes, a pure core: least attained service, bounded by what strict
FIFO would have made each job wait (issue 27; measured as `muster-fifo-las` in `bench.replay`).

- **Least attained service** (Tiresias, NSDI'19): a job's *attained service* is the GPU-seconds
  its attempts have run. Jobs go by its *level* (`LEVELS`: below 1 GPU-hour, below 10, below 100,
  beyond), then by submission. A job that has run long goes behind jobs that have not, and, when
  a job ahead of it in that order does not fit, it may be called back for it as any gang behind
  the protected head is (placement.py's lending: graceful, uncharged, it waits again in its
  place). Levels, not the exact figure, so that two jobs do not overtake each other at every
  cycle: within a level jobs keep submission order.
- **FIFO's bound.** A job is *due* once the time it has waited reaches a lower bound on its wait
  under strict FIFO; due jobs go first, in submission order, ahead of every level, so nothing
  that is not due can call one back. The bound is strict FIFO replayed (`fifo_starts`) over the
  jobs seen, each running for what is known of its run time (it only grows), on the nodes as if
  empty. Shorter runs only start FIFO's jobs earlier, and so do fewer jobs: a shadow of the last
  `SHADOW_JOBS` jobs, or one replayed a while ago, gives bounds that are lower, never higher, up
  to best fit's packing; a job submitted after the shadow was made is given its latest start.
  No runtime estimate, no oracle: only what has happened.
- **Progress.** A stopped job is taken to start over (no checkpoint): all its time since
  submission counts as waited, should it be stopped now, and its longest run is what is known of
  its run time. A job that says it resumes from its checkpoints (`"resumable": true` in its
  config) has its runs counted as run, and their sum as its run time: the bound is then on the
  time it spent not running, and least-attained order gains more (docs/BENCHMARKS.md: the
  replay's default, against `--lose-progress`).
- **What a call-back throws away.** A gang that does not resume is called back only for a job
  that is due: a stop throws its run away, which FIFO's bound is worth and the least-attained
  order alone is not (on the Philly-shaped replays with no job resumable, calling such gangs
  back by level threw away 16-27 % of the GPU time allocated; only for due jobs, 1-11 %). A
  resumable gang loses nothing and is called back by the order, as above.

What a running job's key means: one that has waited as long as FIFO would have made it (its
FIFO start has come) is due, so only an earlier due job can call it back, as under plain FIFO
lending; one that started before its FIFO start (it overtook others) can be called back by any
job ahead of it in the order if it resumes, and by a due job if it does not. With every job
below one GPU-hour the order is submission order, and it calls back what FIFO lending does, a
gang that does not resume only once the head is due.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from muster.services.scheduler import placement
from muster.shared import settings
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import TaskSpec

GPU_HOUR = 3600.0
LEVELS = (1 * GPU_HOUR, 10 * GPU_HOUR, 100 * GPU_HOUR)  # attained GPU-seconds at each level's end
# 0: the queue in submission order (FIFO lending alone, the rule before issue 27).
ON = settings.number("MUSTER_LEAST_ATTAINED", 1, int, low=0, high=1) == 1
SHADOW_JOBS = settings.number("MUSTER_SHADOW_JOBS", 2000, int, low=1)  # the newest jobs the shadow replays
SHADOW_EVERY = settings.seconds("MUSTER_SHADOW_EVERY", 30.0)  # seconds between two shadows
EPSILON_S = 1e-6  # waits this close to their bound are at it (sums of floats)


def level(attained_gpu_s: float) -> int:
    """The level of a job that has run `attained_gpu_s` GPU-seconds (0: the first)."""
    return bisect.bisect_right(LEVELS, attained_gpu_s)


@dataclass(frozen=True)
class Seen:
    """A job as the shadow replays it: submitted `arrival` (seconds, any epoch), running for
    `run_s` (what is known of its run time)."""

    job_id: str
    arrival: float
    run_s: float
    config: JobConfig


@dataclass(frozen=True)
class Service:
    """What a job's attempts have run, until now: GPU-seconds (`attained`), wall seconds in all
    (`ran`) and its longest attempt (`longest`), a running one so far."""

    attained: float = 0.0
    ran: float = 0.0
    longest: float = 0.0

    def run_s(self, resumable: bool) -> float:
        """What is known of its run time."""
        return self.ran if resumable else self.longest

    def waited(self, since_submit: float, resumable: bool) -> float:
        """What it has waited, or would have if stopped now (module docstring)."""
        return since_submit - (self.ran if resumable else 0.0)


def fifo_starts(nodes: Iterable[placement.NodeState], jobs: Sequence[Seen]) -> dict[str, float]:
    """When strict FIFO would start each job (seconds, the jobs' epoch): jobs start in
    submission order only, each the moment it fits after every earlier one started (placed as
    Muster places a gang on the nodes, which are taken empty at the first arrival), and runs for
    its `run_s`. A job that does not fit on the empty nodes is left out (it never blocks)."""
    empty = [n.copy(empty=True) for n in nodes]
    cluster, never = placement.Cluster(n.copy() for n in empty), placement.Cluster(empty)
    order = sorted(jobs, key=lambda s: (s.arrival, s.job_id))
    ends: list[tuple[float, int, JobConfig, list[TaskSpec]]] = []  # (end, sequence, config, tasks)
    starts: dict[str, float] = {}
    fits_empty: set[str] = set()
    clock, i, seq = -math.inf, 0, 0
    while i < len(order):
        job = order[i]
        clock = max(clock, job.arrival)
        while ends and ends[0][0] <= clock:
            _, _, config, held = heapq.heappop(ends)
            cluster.release(config, held)
        pending = placement.PendingJob(job.job_id, job.config)
        tasks = cluster.place_alone(pending)
        if tasks is None:
            if ends and (job.job_id in fits_empty or never.place_alone(pending) is not None):
                fits_empty.add(job.job_id)
                clock = ends[0][0]  # it waits for the next end
            else:
                i += 1  # it never fits on these nodes (they are empty or it fits on none): it never blocks
            continue
        cluster.allocate(job.config, tasks)
        starts[job.job_id] = clock
        seq += 1
        heapq.heappush(ends, (clock + job.run_s, seq, job.config, tasks))
        i += 1
    return starts


@dataclass
class Shadow:
    """The bounds a FIFO shadow gives (`make`): each job's lower bound on its wait under strict
    FIFO, the latest start it holds, and the newest submission it replayed. A job submitted
    since starts no earlier than that latest start; one it left out (older than its horizon, or
    one that never fits) is given none (0: it is due at once)."""

    bounds: dict[str, float] = field(default_factory=dict)
    latest_start: float = -math.inf
    newest: float = math.inf  # the newest arrival replayed (none: every job is left out)

    @classmethod
    def make(cls, nodes: Iterable[placement.NodeState], jobs: Sequence[Seen]) -> Shadow:
        starts = fifo_starts(nodes, jobs)
        arrival = {s.job_id: s.arrival for s in jobs}
        return cls(
            {job_id: start - arrival[job_id] for job_id, start in starts.items()},
            max(starts.values(), default=-math.inf),
            max(arrival.values(), default=math.inf),
        )

    def bound(self, job_id: str, arrival: float) -> float:
        if job_id in self.bounds:
            return self.bounds[job_id]
        if arrival <= self.newest:
            return 0.0  # left out of the shadow: no bound is known
        return max(0.0, self.latest_start - arrival)

    def rank(
        self, job_id: str, arrival: float, at: float, service: Service, resumable: bool = False
    ) -> tuple[tuple[int, int, float, str], float | None]:
        """The job's place in the queue (smaller first: due jobs by submission, then the others
        by level and submission), and when it becomes due (None: it is)."""
        left = self.bound(job_id, arrival) - service.waited(at - arrival, resumable)
        if left <= EPSILON_S:  # waited + EPSILON_S >= bound
            return (0, 0, arrival, job_id), None
        return (1, level(service.attained), arrival, job_id), at + left

    def key(
        self, job_id: str, arrival: float, at: float, service: Service, resumable: bool = False
    ) -> tuple[int, int, float, str]:
        return self.rank(job_id, arrival, at, service, resumable)[0]

    def due_at(
        self, job_id: str, arrival: float, at: float, service: Service, resumable: bool = False
    ) -> float | None:
        return self.rank(job_id, arrival, at, service, resumable)[1]
