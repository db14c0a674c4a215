"""One scheduling cycle as data, a pure core: `decide(view, vcs, fixed, at)` reads the scheduler's
view (waiting jobs, attempts, nodes as the placement index has them), the virtual clusters and
the sharing order's per-job cache, and returns a `Decision`; the service (service.py) applies it
(KV writes, kill orders, assignments, events). No I/O here: the view's in-memory index is read,
and changed only tentatively (every tentative allocation is undone before `decide` returns), and
`fixed`, a cache across cycles, moves on by one cycle.

What a cycle decides, in the order the service applies it:
1. **Preemptions.** The protected head (placement.py: the first waiting job that does not fit)
   lends its reservation: jobs behind it run on what it holds, and once it would fit on what is
   free plus what gangs behind it in the queue hold (same VC and priority, submitted later and,
   with virtual clusters in use, by the same user), the fewest of them are stopped for it
   ("head"), gracefully and uncharged (they wait again in their place), and it starts on what
   they free the next cycle. With no virtual cluster configured, the queue is by priority, then
   in least-attained order under FIFO's bound (attained.py; `decide(shadow=...)`), and
   "behind" means later in that order. While any gang is being stopped for someone, no
   other gang is called back, and the job it is stopped for is planned onto what it holds, which
   is then lent to nobody. With virtual clusters or priorities in use (quota.py), when no head
   calls gangs back: the first waiting job, in queue order, that does not fit now but would if
   some gangs stopped gets them stopped — lower-priority gangs of its own VC ("priority"), or
   borrowed gangs of other VCs when it is within its quota ("reclaim"). None while any gang is
   still stopping.
2. **Placements and reasons**, in queue order: the plan of the waiting queue (placement.py, a
   bounded backfill window, around nodes to avoid), each placement marked `borrowed` when its VC
   is beyond its quota, counted in sharing order; every other waiting job's reason, when it
   differs from the one its record has (and whether it can never run on these nodes).
3. **Elastic roles** (elastic.py): newest tasks removed so that the first blocked waiting job
   fits (a shrink), or else elastic roles grown into capacity no waiting job can use (grows),
   within the quota of a VC that may not borrow: none while gangs stop for a job, nor while a
   blocked job would fit in what stopping tasks will free. Read as the cluster will be once step
   2's placements are held.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from muster.services.scheduler import attained, elastic, placement, quota
from muster.services.scheduler.avoid import nodes_to_avoid, plan_around
from muster.services.scheduler.view import Job, View
from muster.shared import settings
from muster.shared.jobconfig import JobConfig, rank
from muster.shared.messages import QUEUE_SHOWN, AttemptRecord, JobState, TaskSpec, VirtualCluster

# Jobs behind the head that one plan tries at most (Slurm's bf_max_job_test); later ones wait.
BACKFILL_WINDOW = settings.number("MUSTER_BACKFILL_WINDOW", 500, int, low=0)
PREEMPT_TRIES = 16  # waiting jobs one cycle looks at for a preemption that would let them run
# The head lends its reservation and calls back what overtook it (placement.py); 0: the claims idle.
LEND = settings.number("MUSTER_LEND_RESERVATION", 1, int, low=0, high=1) == 1


@dataclass(frozen=True)
class Place:
    """Place attempt `attempt` of `job` on `tasks`; `borrowed`: beyond its VC's quota."""

    job: Job
    attempt: int
    tasks: list[TaskSpec]
    borrowed: bool = False


@dataclass(frozen=True)
class Wait:
    """`job` waits: its record's reason becomes `reason` (written only when it changed)."""

    job: Job
    reason: str
    unschedulable: bool = False


@dataclass(frozen=True)
class Preempt:
    """Stop `victim` (a running gang) for the waiting job `for_job`; `kind`: "priority" (same
    VC, lower priority), "reclaim" (capacity another VC borrowed) or "head" (it started after
    the protected head, which now fits on what it holds); `why`: its attempt's rule."""

    victim: quota.Running
    for_job: Job
    kind: str
    why: str

    def stopped(self, record: AttemptRecord, at: datetime) -> AttemptRecord | None:
        """The victim's stored attempt record ended as stopped for `for_job`, or None to leave it
        alone: it ended, is stopping already, or a task of it has ended since the plan read the
        view (its event was on its way: stopping now would run that task again)."""
        if record.ended or record.preempted_by is not None or record.finished_work:
            return None
        update = {"ended_at": at, "outcome": JobState.STOPPED, "rule": self.why}
        return record.model_copy(update={**update, "preempted_by": self.for_job.job_id})


@dataclass(frozen=True)
class Shrink:
    """Remove these tasks of running elastic attempts, so that `for_job` fits."""

    for_job: Job
    tasks: list[tuple[AttemptRecord, TaskSpec]]


@dataclass(frozen=True)
class Grow:
    """Add `added` to the running elastic attempt `record` of `job`."""

    job: Job
    record: AttemptRecord
    added: list[TaskSpec]


@dataclass
class Decision:
    queued: int = 0  # jobs whose next attempt may be placed now (planned when > 0)
    preempt: list[Preempt] = field(default_factory=list)
    steps: list[Place | Wait] = field(default_factory=list)  # in queue order
    shrink: Shrink | None = None
    grow: list[Grow] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)  # every waiting job left waiting: why
    blocked: list[Job] = field(default_factory=list)  # could run here, do not fit now (first few)
    # The waiting queue after this cycle, in the order it considered the jobs (sharing order, or
    # by priority and least-attained order), those it places left out: the first QUEUE_SHOWN job
    # ids only.
    queue: list[str] = field(default_factory=list)
    due_at: float | None = None  # when the next waiting job becomes due (attained.py), seconds
    resize_failed: str | None = None  # why resizing raised (the cycle's placements stand; logged)

    def lines(self) -> list[str]:
        """The decision, one short line per act, in the order they are applied (for tests and
        logs): `preempt V for J (kind)`, `place J.n on node[gpus],... [borrowed]`,
        `wait J: reason [unschedulable]`, `shrink A role.i@node for J`, `grow A +role.i@node`."""
        out = [f"preempt {p.victim.key} for {p.for_job.job_id} ({p.kind})" for p in self.preempt]
        for step in self.steps:
            if isinstance(step, Place):
                on = " ".join(
                    f"{t.role}.{t.index}@{t.node}{list(t.gpus) if t.gpus else ''}" for t in step.tasks
                )
                out.append(
                    f"place {step.job.job_id}.{step.attempt} {on}{' borrowed' if step.borrowed else ''}"
                )
            else:
                out.append(
                    f"wait {step.job.job_id}: {step.reason}{' [unschedulable]' if step.unschedulable else ''}"
                )
        if self.shrink is not None:
            for record, t in self.shrink.tasks:
                out.append(
                    f"shrink {record.key} {t.role}.{t.index}@{t.node} for {self.shrink.for_job.job_id}"
                )
        for g in self.grow:
            out += [f"grow {g.record.key} +{t.role}.{t.index}@{t.node}" for t in g.added]
        return out


def decide(
    view: View,
    vcs: Mapping[str, VirtualCluster],
    fixed: quota.Fixeds,
    at: datetime,
    window: int = BACKFILL_WINDOW,
    tries: int = PREEMPT_TRIES,
    shadow: attained.Shadow | None = None,
) -> Decision:
    """What this cycle does (module docstring). `window`: jobs behind the head one plan tries;
    `tries`: waiting jobs looked at for a preemption, or a shrink, that would let them in;
    `shadow`: the queue in least-attained order under its FIFO bounds (attained.py) rather than
    in submission order, when no virtual cluster is configured (by priority first, if any job
    has one: one high job does not turn the whole queue to the sharing order)."""
    waiting = view.queue(at)
    decision = Decision(queued=len(waiting))
    if waiting:
        keys = None if shadow is None or vcs else _Keys(view, shadow, at)
        if keys is not None:  # by priority first, where some job has one (`view.ranked`)
            waiting.sort(key=lambda w: (-rank(w[0].config.priority), keys(w[0])))
            decision.due_at = keys.due_at(job for job, _ in waiting)
        _place(view, vcs, fixed, waiting, at, window, tries, decision, keys)
    if view.elastic:
        try:
            _resize(view, vcs, at, tries, decision)
        except Exception as exc:  # resizing is the cycle's extra: a fault there must not cost every
            decision.shrink, decision.grow = None, []  # job its placement, cycle after cycle
            decision.resize_failed = f"{type(exc).__name__}: {exc}"
    return decision


def _queue(waiting: Iterable[str], placed: Mapping[str, object]) -> list[str]:
    """The first QUEUE_SHOWN of `waiting` (job ids, in queue order) that are not `placed`: read
    only that far, so a lazy order is taken no further than the queue shown."""
    return list(itertools.islice((j for j in waiting if j not in placed), QUEUE_SHOWN))


# ------------------------------------------------------------------ placing the queue


def _place(
    view: View,
    vcs: Mapping[str, VirtualCluster],
    fixed: quota.Fixeds,
    waiting: list[tuple[Job, int]],
    at: datetime,
    window: int,
    tries: int,
    decision: Decision,
    keys: _Keys | None = None,
) -> None:
    held_back: dict[str, str] = {}
    order: quota.Order[placement.PendingJob] | None = None
    queue: list[placement.PendingJob] | quota.Order[placement.PendingJob]
    running: list[quota.Running] | None = None
    if vcs or (view.ranked and keys is None):
        order, ledger, running = _sharing(view, vcs, fixed, waiting, at)
        queue = order
    else:
        queue = [placement.PendingJob(j.job_id, j.config.smallest()) for j, _ in waiting]
    # What runs is read only once a head would call gangs back: a cycle whose queue fits pays
    # nothing for lending.
    read = functools.partial(view.running, at) if running is None else lambda: running or []
    lending, gangs = _lending(view, waiting, read, order is not None, keys)
    avoid = nodes_to_avoid(view.avoid_candidates(at), at)
    plan = plan_around(view.cluster, view.capacity, queue, avoid, window, lending)
    by_id = {job.job_id: job for job, _ in waiting}
    decision.preempt = [
        _stop_for_head(gangs.by_id[victim], by_id[head], keys)
        for victim, head in plan.stop.items()
        if not gangs.by_id[victim].stopping  # one being stopped for it already is not stopped twice
    ]
    if running is None:
        running = gangs.running
    stopping = Counter(r.preempted_by for r in running or [] if r.stopping and r.preempted_by)
    for job_id in plan.pending:  # a head whose gangs are being stopped for it says so
        if n := stopping.get(job_id, 0):
            plan.pending[job_id] = f"waiting for {n} gang(s) stopped for it to stop"
    borrowed: set[str] = set()
    jobs: dict[str, Job] = {}
    if order is not None:
        jobs = {job.job_id: job for job, _ in waiting}
        held_back = order.held()
        placed = [p.job_id for p in order.taken if p.job_id in plan.placements]
        if len(placed) < len(plan.placements):  # the second plan (around avoided nodes) placed more
            placed = order.in_order(plan.placements)
        for job_id in placed:  # in queue order: who is within its quota, placements counted
            job = jobs[job_id]
            use = quota.need(job.config)
            vc = job.config.virtualCluster
            # The order read the ledger once: two jobs of a VC that may not borrow, each within
            # its quota alone, may both be planned. The later one waits for the quota.
            if (why := ledger.beyond_quota(vc, use)) is not None:
                del plan.placements[job_id]
                plan.pending[job_id] = why
                continue
            if not ledger.within(vc, use):
                borrowed.add(job.job_id)
            ledger.take(vc, job.user, use)
        if not decision.preempt:
            decision.preempt = _preempt_for(view, _in_order(order, jobs), plan, ledger, running or [], tries)
        plan.pending.update(held_back)
    elif view.ranked and not decision.preempt:  # priorities in least-attained order
        running = gangs.load().running or []
        capacity = quota.capacity_of(view.capacity.cluster.nodes.values())
        ledger = quota.Ledger(quota.limits(vcs, capacity), running)
        decision.preempt = _preempt_for(view, (job for job, _ in waiting), plan, ledger, running, tries)
    # With no node registered at all, the cluster is starting, not too small.
    registered = bool(view.capacity.cluster.nodes)
    for job, n in waiting:
        if job.job_id in plan.placements:
            decision.steps.append(Place(job, n, plan.placements[job.job_id], job.job_id in borrowed))
        elif job.job_id in plan.pending:
            reason = plan.pending[job.job_id]
            unschedulable = job.job_id in plan.unschedulable and registered
            if (job.reason, job.unschedulable) != (reason, unschedulable):
                decision.steps.append(Wait(job, reason, unschedulable))
    decision.reasons = dict(plan.pending)
    if order is None:
        decision.queue = _queue((job.job_id for job, _ in waiting), plan.placements)
    else:  # taken on from where the plan left it (after `rest()`: what the order still holds)
        decision.queue = _queue((p.job_id for p in order.ordered()), plan.placements)
    # Gangs stop for these (called back for a head, or preempted for a job): nothing shrinks for
    # them too (a 1-GPU job got a preemption and a shrink in one cycle, two GPUs freed).
    stopped_for = set(plan.stop.values()) | {p.for_job.job_id for p in decision.preempt}
    # In queue order; what is shrunk for reads the first `tries` of them only.
    blocked = (job for job, _ in waiting) if order is None else _in_order(order, jobs)
    decision.blocked = list(
        itertools.islice(
            (
                job
                for job in blocked
                if job.job_id in plan.pending
                and job.job_id not in plan.unschedulable
                and job.job_id not in held_back
                and job.job_id not in stopped_for  # gangs stop for it: nothing shrinks for it too
            ),
            tries,
        )
    )


class _Gangs:
    """What runs, read from the view (O(running attempts)) once, the first time a head needs it
    (`load`): every running attempt, the gangs being stopped (job -> the job they stop for), and
    the gangs a head may call back, by job id. Empty until then."""

    def __init__(self, read: Callable[[], list[quota.Running]]) -> None:
        self._read = read
        self.running: list[quota.Running] | None = None
        self.stopping_for: dict[str, str] = {}
        self.by_id: dict[str, quota.Running] = {}

    def load(self) -> _Gangs:
        if self.running is None:
            self.running = runs = self._read()
            self.stopping_for = {r.job_id: r.preempted_by for r in runs if r.stopping and r.preempted_by}
            # A gang some of whose tasks have ended is never called back (they would run again),
            # nor one its time limit ends within the grace (a stop would free nothing sooner).
            self.by_id = {
                r.job_id: r for r in runs if r.tasks and (r.job_id in self.stopping_for or r.victim)
            }
        return self


class _Keys:
    """Each job's place in the least-attained order (attained.py) at `at`, and when a job not
    yet due becomes due, worked out once per cycle and job, from the records (so a new leader
    agrees, up to its shadow)."""

    def __init__(self, view: View, shadow: attained.Shadow, at: datetime) -> None:
        self.view, self.shadow, self.at = view, shadow, at.timestamp()
        self._keys: dict[str, tuple[int, int, float, str]] = {}
        self._due: dict[str, float] = {}  # job not due -> when it becomes due

    def __call__(self, job: Job) -> tuple[int, int, float, str]:
        key = self._keys.get(job.job_id)
        if key is None:
            service = self.view.service(job.job_id, self.at)
            arrival, resumable = job.submitted_at.timestamp(), job.config.resumable
            key, due = self.shadow.rank(job.job_id, arrival, self.at, service, resumable)
            self._keys[job.job_id] = key
            if due is not None:
                self._due[job.job_id] = due
        return key

    def due_at(self, waiting: Iterable[Job]) -> float | None:
        """When the first waiting job not yet due becomes due (None: none will)."""
        return min((self._due[j.job_id] for j in waiting if self(j)[0]), default=None)


def _lending(
    view: View,
    waiting: list[tuple[Job, int]],
    running: Callable[[], list[quota.Running]],
    sharing: bool,
    keys: _Keys | None = None,
) -> tuple[dict[str, Any], _Gangs]:
    """`Cluster.plan`'s lending arguments, and the gangs a head may call back (by job id, read
    from `running` when a head first asks). A
    waiting job stood ahead of a running gang if it is of the same VC and priority, submitted
    before it and (in sharing order, which puts a VC's users by their share) of the same user:
    the queue's order, read from the records, so a new leader agrees (a lower priority gang is
    priority preemption's). In least-attained order (`keys`) it stood ahead if its key is the
    smaller, and a gang that does not resume only of a job that is due (attained.py). While
    gangs are being stopped for someone, no other gang is called back (what they free may be
    enough), and each head they stop for is planned onto what they hold (named in `Plan.stop`
    again, not stopped twice), so nothing is lent on the resources it is about to take."""
    gangs = _Gangs(running)
    if not LEND:
        return {}, gangs
    jobs = {job.job_id: job for job, _ in waiting}

    def ahead(w: Job, r: quota.Running) -> bool:
        stopping_for = gangs.stopping_for  # loaded: `stoppable` asks first
        if stopping_for:
            return stopping_for.get(r.job_id) == w.job_id
        job = view.jobs.get(r.job_id)
        if job is None or w.config.virtualCluster != job.config.virtualCluster:
            return False
        if rank(w.config.priority) != rank(job.config.priority):
            return False  # a lower priority gang is priority preemption's (quota.py)
        if keys is not None:  # ahead in the order (submitted at the same time: neither is)
            if not job.config.resumable and keys(w)[0] != 0:
                return False  # its run would be thrown away: worth it for a due job only
            return keys(w)[:3] < keys(job)[:3]
        # The sharing order puts users of one VC by their share: only a user's own are in order.
        return (not sharing or w.user == job.user) and w.submitted_at < job.submitted_at

    def stoppable(waiting_id: str) -> list[placement.Loan]:
        w = jobs.get(waiting_id)
        if w is None:
            return []
        gangs.load()
        behind = [r for r in gangs.by_id.values() if ahead(w, r)]
        behind.sort(key=lambda r: last_called_back(view, r, keys))  # the call-back stops from the end
        return [placement.Loan(r.job_id, r.config, r.tasks) for r in behind]

    return {"stoppable": stoppable, "stop_first": True}, gangs


def last_called_back(view: View, r: quota.Running, keys: _Keys | None) -> tuple[Any, ...]:
    """Gangs a head may call back, sorted by this, are stopped from the last on, until it fits:
    first, in least-attained order, those that resume, the last in the order first (Tiresias
    stops the job that has run most; a stop costs it no work); then the others, the newest
    placed first. (Before, the view's order decided: the gang whose record changed last first.)
    On the Philly-shaped replays (docs/BENCHMARKS.md): with every job resumable, mean JCT fell
    on 6 seeds of 7, with fewer stops; with none, the newest first beat the fewest GPU-seconds
    run first on all 7."""
    job = view.jobs.get(r.job_id)
    if keys is not None and job is not None and job.config.resumable:
        return (1, keys(job))
    record = view.attempts.get(r.key)
    return (0, record.placed_at.timestamp() if record is not None else 0.0)


def _stop_for_head(victim: quota.Running, head: Job, keys: _Keys | None) -> Preempt:
    gang = keys.view.jobs.get(victim.job_id) if keys is not None else None
    if keys is None or gang is None or head.submitted_at < gang.submitted_at:
        why = f"stopped to let job {head.job_id}, which waited longer, start"
    elif keys(head)[0] == 0:  # it is due (attained.py), and the gang started before its turn
        why = (
            f"stopped to let job {head.job_id}, which has waited as long as it would have in "
            "submission order, start (this gang had started before its turn)"
        )
    else:
        why = f"stopped to let job {head.job_id}, which has used fewer GPU-hours, start"
    return Preempt(victim, head, "head", why)


def _in_order(order: quota.Order[placement.PendingJob], jobs: Mapping[str, Job]) -> Iterator[Job]:
    """The waiting jobs in sharing order, taken from `order` as far as they are read."""
    for pending in order.ordered():
        job = jobs.get(pending.job_id)
        if job is not None:
            yield job


def _sharing(
    view: View,
    vcs: Mapping[str, VirtualCluster],
    fixed: quota.Fixeds,
    waiting: list[tuple[Job, int]],
    at: datetime,
) -> tuple[quota.Order[placement.PendingJob], quota.Ledger, list[quota.Running]]:
    """With virtual clusters configured (or priorities in use and no least-attained order): the
    queue in sharing order (quota.py), made as the planner takes it; the ledger; what runs."""
    running = view.running(at)
    capacity = quota.capacity_of(view.capacity.cluster.nodes.values())
    ledger = quota.Ledger(quota.limits(vcs, capacity), running)
    of = fixed.of
    order = quota.Order(
        ledger,
        (
            (
                of(j.job_id, j.config, j.user, j.submitted_at),
                placement.PendingJob(j.job_id, j.config.smallest()),
            )
            for j, _ in waiting
        ),
    )
    fixed.next_cycle()
    return order, ledger, running


def _preempt_for(
    view: View,
    waiting: Iterable[Job],
    plan: placement.Plan,
    ledger: quota.Ledger,
    running: list[quota.Running],
    tries: int,
) -> list[Preempt]:
    """The first waiting job (in queue order) that cannot run now but would if some gangs
    stopped gets them stopped. None while any gang is still stopping (preempted, or ended and
    tearing down): what it frees may be enough, and choosing more victims before it is would
    stop more than needed. Read from the records, so a new leader keeps to it too. Sets the
    reasons in `plan.pending` that say so."""
    stopping = [r for r in running if r.stopping]
    if stopping:
        for job_id in plan.pending:
            n = sum(1 for r in stopping if r.preempted_by == job_id)
            if n:
                plan.pending[job_id] = f"waiting for {n} preempted gang(s) to stop"
        return []
    tried = 0
    for job in waiting:
        if job.job_id not in plan.pending or job.job_id in plan.unschedulable:
            continue
        tried += 1
        if tried > tries:
            return []
        w = quota.Waiting(
            job.job_id,
            job.config.virtualCluster,
            job.user,
            rank(job.config.priority),
            job.config.smallest(),  # as it is placed: an elastic role at its minimum
            job.submitted_at,
        )
        options = quota.candidates(w, ledger, running)
        victims = quota.choose_victims(view.cluster, w, options)
        if not victims:
            continue
        plan.pending[job.job_id] = (
            f"preempted {', '.join(v.job_id for v in victims)} to make room; waiting for them to stop"
        )
        return [_preempt(job, v) for v in victims]
    return []


def _preempt(job: Job, victim: quota.Running) -> Preempt:
    if victim.vc == job.config.virtualCluster:
        why = f"preempted by {job.job_id} ({job.config.priority} priority, {job.user})"
        return Preempt(victim, job, "priority", why)
    why = (
        f"preempted by {job.job_id}: virtual cluster {job.config.virtualCluster} reclaims "
        f"the capacity {victim.vc} borrowed"
    )
    return Preempt(victim, job, "reclaim", why)


# ------------------------------------------------------------------ elastic roles (elastic.py)


def _resize(
    view: View, vcs: Mapping[str, VirtualCluster], at: datetime, tries: int, decision: Decision
) -> None:
    """Shrink elastic roles for the first blocked job that removing their newest tasks would
    let in; else (nothing waits, or nothing waiting could be let in so) grow them into free
    capacity, which no waiting job can use now. Read with this cycle's placements held, and
    without the gangs it preempts (their attempts end)."""
    stopped = {p.victim.key for p in decision.preempt}
    ready = []
    for key in sorted(view.elastic):
        record = view.attempts.get(key)
        job = view.jobs.get(record.job_id) if record is not None else None
        if record is not None and job is not None and key not in stopped and elastic.settled(record, at):
            ready.append((job, record))
    if not ready:
        return
    placed = [step for step in decision.steps if isinstance(step, Place)]
    held: list[tuple[JobConfig, list[TaskSpec]]] = []  # tentative allocations, undone below
    try:
        for step in placed:  # as the cluster will be once they are committed
            view.cluster.allocate(step.job.config, step.tasks)
            held.append((step.job.config, step.tasks))
        _shrink_or_grow(view, vcs, at, tries, decision, ready, placed, held)
    finally:
        for config, tasks in held:
            view.cluster.release(config, tasks)


def _freeing(view: View) -> list[tuple[JobConfig, TaskSpec]]:
    """What is being freed: the tasks of gangs ended or stopped whose tasks have not stopped
    yet, and of elastic roles that a shrink removed; each holds its node until its agent
    reports it stopped."""
    out = []
    for key in view.stopping | view.elastic:
        record = view.attempts.get(key)
        job = view.jobs.get(record.job_id) if record is not None else None
        if record is not None and job is not None:
            gone = key in view.stopping
            out += [(job.config, t.spec()) for t in record.tasks if not t.state.ended and (gone or t.removed)]
    return out


def _shrink_or_grow(
    view: View,
    vcs: Mapping[str, VirtualCluster],
    at: datetime,
    tries: int,
    decision: Decision,
    ready: list[tuple[Job, AttemptRecord]],
    placed: list[Place],
    held: list[tuple[JobConfig, list[TaskSpec]]],
) -> None:
    blocked = decision.blocked[:tries]
    freeing = _freeing(view) if blocked else []
    for waiting in blocked:
        pending = placement.PendingJob(waiting.job_id, waiting.config.smallest())
        if freeing and elastic.freeing_for(view.cluster, pending, freeing):
            return  # room is being made for it: nothing shrinks more, nothing grows into it
        running = [(job.config, record) for job, record in ready if job.job_id != waiting.job_id]
        chosen = elastic.shrink_for(view.cluster, pending, running)
        if chosen:
            decision.shrink = Shrink(waiting, chosen)
            return
    if decision.preempt or any(view.attempts[k].preempted_by for k in view.stopping if k in view.attempts):
        return  # gangs stop for a job, planned onto what they hold and what is free beside it
    ledger = None
    if vcs:  # a VC that may not borrow: its elastic jobs grow only within its quota
        capacity = quota.capacity_of(view.capacity.cluster.nodes.values())
        ledger = quota.Ledger(quota.limits(vcs, capacity), view.running(at))
        for step in placed:  # what this cycle places holds too
            ledger.take(
                step.job.config.virtualCluster,
                step.job.user,
                quota.held(step.job.config, step.tasks, view.model_of),
            )
    for job, record in ready:
        added = elastic.grow(view.cluster, job.config, record)
        if added and ledger is not None and not ledger.limit(job.config.virtualCluster).borrow:
            kept = []
            for spec in added:
                one = quota.task_need(job.config, spec.role_no)
                if not ledger.within(job.config.virtualCluster, one):
                    break
                ledger.take(job.config.virtualCluster, job.user, one)
                kept.append(spec)
            added = kept
        if added:
            decision.grow.append(Grow(job, record, added))
            view.cluster.allocate(job.config, added)  # held once applied: the next grows see it
            held.append((job.config, added))
