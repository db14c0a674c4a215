"""Sharing the cluster, a pure core: virtual clusters' quotas, the order jobs go in, and which
running gangs a waiting job may preempt.

- **Quotas.** A virtual cluster (VC) is guaranteed its quota: GPUs per model, CPUs, memory. A job
  is *within quota* when what its VC already holds plus what it needs fits the quota (a job with
  no gpuType counts against the VC's GPUs of all models together). `default` needs no record:
  its quota is what the configured VCs leave of the cluster (with none configured, the whole
  cluster). A job beyond its quota still runs on idle capacity if its VC may borrow
  (`VirtualCluster.borrow`), and its attempt is marked borrowed; if not, it waits.
- **Order.** Higher priority first; then jobs within their quota before borrowing ones; then the
  user whose dominant share of the VC's quota is smallest (dominant resource fairness over
  what each user holds now); then submission time. A preempted job keeps its submission time,
  so it returns to its old place. `Order` makes it as the planner takes it, at the cost of
  what the planner takes (its backfill window), not a sort of the whole backlog per cycle;
  `Ledger.order` is the same order as one sort, for reference.
- **Preemption.** A job that cannot be placed now may stop, whole gangs only: lower-priority
  gangs of its own VC, and, when it is within its quota, gangs that other VCs run on borrowed
  capacity. Of those, the fewest lost GPU-seconds (then task-seconds) that make room: victims
  are tried cheapest first until the job fits, then any that were not needed are given back.
  Victims are never of equal or higher priority in the same VC, and borrowed work is taken only
  for work within its quota, so a preemption never answers a preemption.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Generic, TypeVar

from muster.services.scheduler import placement
from muster.shared import settings
from muster.shared.jobconfig import JobConfig, rank
from muster.shared.messages import TaskSpec

# The VC arithmetic is shared/vcquota.py (the gateway shows per-VC usage with it too); its names
# are this module's as well (re-exported).
from muster.shared.vcquota import ANY_MODEL as ANY_MODEL
from muster.shared.vcquota import DEFAULT_VC as DEFAULT_VC
from muster.shared.vcquota import Amount as Amount
from muster.shared.vcquota import Limit as Limit
from muster.shared.vcquota import capacity_of as capacity_of
from muster.shared.vcquota import gpu_count
from muster.shared.vcquota import held as held
from muster.shared.vcquota import limits as limits
from muster.shared.vcquota import need as need
from muster.shared.vcquota import task_need as task_need

# Seconds a stopped gang has from SIGTERM to SIGKILL (a preemption, a head's call-back).
PREEMPT_GRACE = settings.seconds("MUSTER_PREEMPT_GRACE", 30.0)


@dataclass
class Running:
    """A placed, not yet ended attempt, as preemption sees it."""

    job_id: str
    key: str  # its attempt key
    vc: str
    user: str
    rank: int
    config: JobConfig
    tasks: list[TaskSpec]  # its live tasks
    use: Amount
    borrowed: bool
    lost: float  # GPU-seconds (task-seconds for CPU tasks) it has run: what stopping it loses
    stopping: bool = False  # ended or preempted already, its tasks not yet stopped: no victim
    preempted_by: str | None = None  # the job it is being stopped for
    # Some of its tasks have ended already, or may have unheard (a node of it has missed beats):
    # stopping it would run them again in the next attempt (a finished task must not run
    # twice), so it is no victim: never lent-on work called back for a head, never preempted.
    finished: bool = False
    # Its time limit (maxRunTimeSec) ends it within PREEMPT_GRACE: a stop would free nothing
    # sooner than the limit does, and would throw its work away. No victim either.
    ends_soon: bool = False

    @property
    def victim(self) -> bool:
        """Whether it may be stopped for another job (a head, a priority, a reclaim)."""
        return bool(self.tasks) and not (self.stopping or self.finished or self.ends_soon)


@dataclass
class Waiting:
    job_id: str
    vc: str
    user: str
    rank: int
    config: JobConfig
    submitted_at: datetime


class Ledger:
    """What each VC and each (VC, user) holds now, and the VCs' limits."""

    def __init__(self, lims: dict[str, Limit], running: Iterable[Running]) -> None:
        self.limits = lims
        self.vc: dict[str, Amount] = {}
        self.user: dict[tuple[str, str], Amount] = {}
        for r in running:
            self.take(r.vc, r.user, r.use)

    def limit(self, vc: str) -> Limit:
        # A VC removed while its jobs wait or run: nothing is guaranteed to it any more.
        return self.limits.get(vc) or Limit({}, 0, 0, borrow=True)

    def take(self, vc: str, user: str, use: Amount, sign: int = 1) -> None:
        self.vc.setdefault(vc, Amount()).add(use, sign)
        self.user.setdefault((vc, user), Amount()).add(use, sign)

    def within(self, vc: str, amount: Amount) -> bool:
        return self.limit(vc).fits(self.vc.get(vc, Amount()), amount)

    def share(self, vc: str, user: str) -> float:
        return self.limit(vc).share(self.user.get((vc, user), Amount()))

    def order(self, waiting: list[Waiting]) -> list[Waiting]:
        """The queue in the order jobs go (module docstring)."""

        def key(w: Waiting) -> tuple[int, bool, float, datetime, str]:
            within = self.within(w.vc, need(w.config))
            return (-w.rank, not within, self.share(w.vc, w.user), w.submitted_at, w.job_id)

        return sorted(waiting, key=key)

    def why_not(self, w: Waiting) -> str | None:
        """Why a job of a VC that may not borrow must wait for its quota, or None."""
        return self.beyond_quota(w.vc, need(w.config))

    def beyond_quota(self, vc: str, amount: Amount) -> str | None:
        """Why `amount` more for `vc` must wait, if its VC may not borrow and it would go beyond
        the quota with what the ledger holds; None otherwise."""
        lim = self.limit(vc)
        if lim.borrow or self.within(vc, amount):
            return None
        used = self.vc.get(vc, Amount())
        return (
            f"waiting for virtual cluster {vc}'s quota ({lim.shown()}): it needs "
            f"{amount.shown()}, and {used.shown()} are in use"
        )


T = TypeVar("T")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


@dataclass(frozen=True, slots=True)
class Fixed:
    """What a waiting job's place in the order depends on that does not change while it waits:
    worked out once per job (`Fixeds`), not once per cycle."""

    job_id: str
    vc: str
    user: str
    rank: int
    submitted_at: datetime
    need: Amount  # read, never changed
    group: tuple[int, str, str] = field(init=False)  # (rank, VC, user): its group in the order
    least: tuple[float, int, int] = field(init=False)  # its GPUs (of any model), CPUs and MB
    at: int = field(init=False)  # submitted_at in microseconds: compared faster, in the same order
    model: str | None = field(init=False)  # the GPU model its GPUs count against too, if any

    def __post_init__(self) -> None:
        object.__setattr__(self, "group", (self.rank, self.vc, self.user))
        when = self.submitted_at if self.submitted_at.tzinfo else self.submitted_at.replace(tzinfo=UTC)
        object.__setattr__(self, "at", (when - _EPOCH) // _MICROSECOND)
        n = self.need
        typed = [m for m, k in n.gpus.items() if m != ANY_MODEL and k]
        object.__setattr__(self, "model", typed[0] if typed else None)
        object.__setattr__(self, "least", (n.gpus.get(ANY_MODEL, 0), n.cpus, n.memory_mb))

    @classmethod
    def of(cls, job_id: str, config: JobConfig, user: str, submitted_at: datetime) -> Fixed:
        return cls(job_id, config.virtualCluster, user, rank(config.priority), submitted_at, need(config))


class Fixeds:
    """`Fixed` per waiting job, kept from one cycle to the next: a job's config is read again only
    when its record changed (a new config object); jobs not asked for in a cycle are forgotten."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[JobConfig, Fixed]] = {}
        self._now: dict[str, tuple[JobConfig, Fixed]] = {}

    def of(self, job_id: str, config: JobConfig, user: str, submitted_at: datetime) -> Fixed:
        kept = self._now.get(job_id) or self._last.get(job_id)
        if (
            kept is None
            or kept[0] is not config
            or (kept[1].user, kept[1].submitted_at) != (user, submitted_at)
        ):
            kept = (config, Fixed.of(job_id, config, user, submitted_at))
        self._now[job_id] = kept
        return kept[1]

    def next_cycle(self) -> None:
        self._last, self._now = self._now, {}


_ALL, _NONE, _MIXED = 0, 1, 2  # a group's jobs: all within its VC's quota, none, or some


class _Group(Generic[T]):
    """The waiting jobs of one (priority, VC, user), in submission order. Within a cycle they
    share their rank and the user's share, so only being within the quota (which depends on each
    job's need) sets them apart: two streams, within and beyond. When the group's largest needs
    all fit the quota, or its smallest do not, the streams are known without looking at its jobs
    one by one; else they are told apart lazily, as far as the order is taken."""

    __slots__ = (
        "beyond",
        "cursor",
        "items",
        "kind",
        "levels",
        "limit",
        "rank",
        "share",
        "used",
        "user",
        "vc",
        "within",
    )

    def __init__(self, key: tuple[int, str, str]) -> None:
        self.rank, self.vc, self.user = key
        self.items: list[tuple[Fixed, T]] = []
        self.kind: int | None = None  # worked out when the order first reaches the group
        self.cursor = 0  # the items before it are taken (_ALL, _NONE) or told apart (_MIXED)
        self.within: deque[tuple[Fixed, T]] = deque()  # _MIXED: told apart, not yet taken
        self.beyond: deque[tuple[Fixed, T]] = deque()
        self.limit = Limit({}, 0, 0)
        self.used = Amount()
        self.share = 0.0
        self.levels = (0, 0)  # where its within and beyond streams sort (see Order)


_PLACEHOLDER, _JOB = 0, 1


class Order(Generic[T]):
    """The queue in sharing order (module docstring), made as it is taken: what a plan reads,
    never a sort of the whole backlog.

    The waiting jobs are grouped by (priority, VC, user), each group in submission order (the
    order they are given in, the view's queue; a group given out of order is sorted, and
    counted). A heap merges the groups by the order's key; a group enters it by a placeholder
    that sorts first at its place (priority, within the quota or not, the user's share) and is
    replaced by the group's first job of that kind only when the merge gets there. A cycle costs
    a pass that drops each job into its group, a pass over each group the merge reaches for its
    largest and smallest needs, and a heap step per job taken in order (with the few told apart
    on the way): what the planner takes before its backfill window closes. After that it takes
    `rest()`, the others in any order: its outcome for them no longer depends on their order
    (placement.Cluster.plan).

    The ledger is read when the order is made (what each VC holds, each user's share), as one
    sort would read it, and not again: later `take`s on it change nothing here. Jobs of a VC that
    may not borrow and are beyond its quota are never in the order: `held()` says why each waits.
    """

    def __init__(self, ledger: Ledger, entries: Iterable[tuple[Fixed, T]]) -> None:
        self.taken: list[T] = []  # in order, as taken
        self.told = 0  # jobs told apart one by one (within the quota or not)
        self._straight = 0  # jobs taken from a group all or none of whose jobs are within
        self.looked = 0  # jobs looked over in a pass for their group's largest and smallest needs
        self.sorted_groups = 0  # groups given out of submission order, sorted
        self._held: dict[str, str] = {}
        self._whys: dict[tuple[str, tuple[float, int, int], str | None], str] = {}
        self._carry: tuple[int, int, int, str, int] | None = None  # the last group's next job
        self._index: dict[str, Fixed] | None = None
        self._groups: dict[tuple[int, str, str], _Group[T]] = {}
        groups = self._groups
        for entry in entries:
            key = entry[0].group
            group = groups.get(key)
            if group is None:
                group = groups[key] = _Group(key)
            group.items.append(entry)
        self.groups = list(groups.values())
        self.given = sum(len(g.items) for g in self.groups)
        used: dict[str, Amount] = {}
        for g in self.groups:
            if g.vc not in used:
                held = ledger.vc.get(g.vc, Amount())
                used[g.vc] = Amount(dict(held.gpus), held.cpus, held.memory_mb)
            g.limit, g.used, g.share = ledger.limit(g.vc), used[g.vc], ledger.share(g.vc, g.user)
        # A stream's level: where (priority, within or not, share) puts it, as one number, so the
        # heap compares (level, placeholder or job, submitted, job id, group): ints, mostly.
        levels = sorted({(-g.rank, beyond, g.share) for g in self.groups for beyond in (False, True)})
        level = {key: n for n, key in enumerate(levels)}
        self._beyond = [key[1] for key in levels]  # level -> whether its streams are beyond
        self._heap: list[tuple[int, int, int, str, int]] = []
        for i, g in enumerate(self.groups):
            g.levels = (level[(-g.rank, False, g.share)], level[(-g.rank, True, g.share)])
            self._heap.append((g.levels[0], _PLACEHOLDER, 0, "", i))
            if g.limit.borrow:
                self._heap.append((g.levels[1], _PLACEHOLDER, 0, "", i))
        heapq.heapify(self._heap)

    @property
    def keyed(self) -> int:
        """Jobs whose place was worked out, each once: told apart (within the quota or not), or
        taken from a group whose jobs need no telling apart (one sort works out every job's)."""
        return self.told + self._straight

    # ------------------------------------------------------------ a group's streams

    def _kind(self, g: _Group[T]) -> int:
        """Whether all, none or some of g's jobs are within its quota, from its largest and
        smallest needs (one pass over it, which also checks it came in submission order)."""
        if g.kind is not None:
            return g.kind
        items = g.items
        self.looked += len(items)
        fxs = [fx for fx, _ in items]
        gpus, cpus, memory_mb = zip(*[fx.least for fx in fxs], strict=True)
        least = (min(gpus), min(cpus), min(memory_mb))
        most = (max(gpus), max(cpus), max(memory_mb))
        models: dict[str, float] = {}
        for fx in fxs:
            if fx.model is not None and fx.least[0] > models.get(fx.model, 0):
                models[fx.model] = fx.least[0]
        keys = [(fx.at, fx.job_id) for fx in fxs]
        if not all(map(operator.le, keys, itertools.islice(keys, 1, None))):
            items.sort(key=lambda e: (e[0].at, e[0].job_id))
            self.sorted_groups += 1
        lim, used = g.limit, g.used
        if not self._fits(lim, used, least, {}):
            g.kind = _NONE
        elif self._fits(lim, used, most, models):
            g.kind = _ALL
        else:
            g.kind = _MIXED
        return g.kind

    @staticmethod
    def _fits(lim: Limit, used: Amount, amount: tuple[float, int, int], models: dict[str, float]) -> bool:
        gpus, cpus, memory_mb = amount
        if gpus and gpu_count(used.gpus.get(ANY_MODEL, 0) + gpus) > lim.gpus.get(ANY_MODEL, 0):
            return False
        for model, k in models.items():
            if k and gpu_count(used.gpus.get(model, 0) + k) > lim.gpus.get(model, 0):
                return False
        if lim.cpus is not None and used.cpus + cpus > lim.cpus:
            return False
        return lim.memory_mb is None or used.memory_mb + memory_mb <= lim.memory_mb

    def _why(self, g: _Group[T], fx: Fixed) -> str:
        key = (g.vc, fx.least, fx.model)  # what the reason says: jobs alike share it
        why = self._whys.get(key)
        if why is None:
            why = self._whys[key] = (
                f"waiting for virtual cluster {g.vc}'s quota ({g.limit.shown()}): it needs "
                f"{fx.need.shown()}, and {g.used.shown()} are in use"
            )
        return why

    def _tell(self, g: _Group[T], want_within: bool) -> None:
        """Tell g's next jobs apart until one of the wanted kind is found (or none is left)."""
        want = g.within if want_within else g.beyond
        while not want and g.cursor < len(g.items):
            entry = g.items[g.cursor]
            g.cursor += 1
            self.told += 1
            if g.limit.fits(g.used, entry[0].need):
                g.within.append(entry)
            elif g.limit.borrow:
                g.beyond.append(entry)
            else:
                self._held[entry[0].job_id] = self._why(g, entry[0])

    def _head(self, g: _Group[T], beyond: bool) -> Fixed | None:
        """The first job of one of g's streams, telling jobs apart as far as needed."""
        kind = self._kind(g)
        if kind != _MIXED:
            if (kind == _NONE) != beyond or g.cursor >= len(g.items):
                return None
            return g.items[g.cursor][0]
        self._tell(g, not beyond)
        stream = g.beyond if beyond else g.within
        return stream[0][0] if stream else None

    def _pop(self, g: _Group[T], beyond: bool) -> T:
        if g.kind != _MIXED:
            g.cursor += 1
            return g.items[g.cursor - 1][1]
        return (g.beyond if beyond else g.within).popleft()[1]

    # ------------------------------------------------------------ taking the order

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        heap = self._heap
        while True:
            carry = self._carry
            if carry is not None:  # the last group's next job: first again, most often
                self._carry = None
                entry = heapq.heappushpop(heap, carry) if heap else carry
            elif heap:
                entry = heapq.heappop(heap)
            else:
                raise StopIteration
            g, beyond = self.groups[entry[4]], self._beyond[entry[0]]
            if entry[1] == _PLACEHOLDER:  # the merge got to this stream: its first job enters
                head = self._head(g, beyond)
                if head is not None:
                    heapq.heappush(heap, (entry[0], _JOB, head.at, head.job_id, entry[4]))
                continue
            if g.kind == _MIXED:
                item = self._pop(g, beyond)
                head = self._head(g, beyond)
            else:  # one stream, the group's items as they stand: no call, no test per job
                item = g.items[g.cursor][1]
                g.cursor += 1
                self._straight += 1
                head = g.items[g.cursor][0] if g.cursor < len(g.items) else None
            self.taken.append(item)
            if head is not None:
                self._carry = (entry[0], _JOB, head.at, head.job_id, entry[4])
            return item

    def ordered(self) -> Iterator[T]:
        """The whole order from its start: what was taken, then on from there."""
        i = 0
        while True:
            if i == len(self.taken) and next(self, None) is None:
                return
            yield self.taken[i]
            i += 1

    def rest(self) -> Iterator[T]:
        """The jobs not yet taken (nor held back), in any order; the order is left as it is."""
        for g in self.groups:
            if not g.limit.borrow:
                self._tell_all(g)
            elif g.kind is None:  # never reached: none taken, none told apart
                for _, item in g.items:
                    yield item
                continue
            if g.kind == _MIXED:
                for _, item in g.within:
                    yield item
                for _, item in g.beyond:
                    yield item
            for _, item in g.items[g.cursor :]:
                yield item

    def _tell_all(self, g: _Group[T]) -> None:
        """Every job of a group of a VC that may not borrow told apart: which are held back."""
        kind = self._kind(g)
        if kind == _NONE:
            for fx, _ in g.items[g.cursor :]:
                self._held[fx.job_id] = self._why(g, fx)
            g.cursor = len(g.items)
        elif kind == _MIXED:
            while g.cursor < len(g.items):
                self._tell(g, False)  # never finds one: a VC that may not borrow has no beyond

    def held(self) -> dict[str, str]:
        """Jobs held back by a quota their VC may not exceed (job id -> why), every one."""
        for g in self.groups:
            if not g.limit.borrow:
                self._tell_all(g)
        return self._held

    def key(self, fx: Fixed) -> tuple[int, bool, float, datetime, str]:
        """A given job's key in the order (what `Ledger.order` sorts by)."""
        g = self._groups[fx.group]
        return (-fx.rank, not g.limit.fits(g.used, fx.need), g.share, fx.submitted_at, fx.job_id)

    def in_order(self, job_ids: Iterable[str]) -> list[str]:
        """Some given jobs in the order, without taking it that far (the first call indexes the
        jobs given: a pass, for the rare caller, not every cycle's)."""
        if self._index is None:
            self._index = {fx.job_id: fx for g in self.groups for fx, _ in g.items}
        index = self._index
        return sorted(job_ids, key=lambda job_id: self.key(index[job_id]))


def candidates(job: Waiting, ledger: Ledger, running: Iterable[Running]) -> list[Running]:
    """The gangs `job` may preempt, cheapest first: lower priority in its own VC; and, if it is
    within its quota, other VCs' borrowed gangs while their VC is beyond its quota now (a gang
    is marked borrowed when placed; once its VC's other work has ended it runs within the
    quota, and reclaiming it would stop work the quota guarantees). Never a gang some of whose
    tasks have ended (they would run again in its next attempt), nor one its time limit ends
    within the grace."""
    within = ledger.within(job.vc, need(job.config))
    over: dict[str, bool] = {}

    def beyond(vc: str) -> bool:
        if vc not in over:
            over[vc] = not ledger.limit(vc).fits(Amount(), ledger.vc.get(vc, Amount()))  # what it holds
        return over[vc]

    out = [
        r
        for r in running
        if r.job_id != job.job_id
        and r.victim
        and (
            (r.vc == job.vc and r.rank < job.rank)
            or (within and r.vc != job.vc and r.borrowed and beyond(r.vc))
        )
    ]
    return sorted(out, key=lambda r: (r.lost, r.rank, r.key))


def choose_victims(cluster: placement.Cluster, job: Waiting, options: list[Running]) -> list[Running] | None:
    """The victims that make room for `job` at the least lost work, or None when stopping every
    option would not be enough. `cluster` (what is placed now) is left as it was."""
    if not options:
        return None
    pending = placement.PendingJob(job.job_id, job.config)
    released: list[Running] = []

    def fits() -> bool:
        return cluster.place_alone(pending) is not None

    try:
        for victim in options:  # cheapest first, until it fits
            cluster.release(victim.config, victim.tasks)
            released.append(victim)
            if fits():
                break
        else:
            return None
        chosen = list(released)
        for victim in sorted(released, key=lambda r: -r.lost):  # give back what was not needed
            cluster.allocate(victim.config, victim.tasks)
            if fits():
                chosen.remove(victim)
                released.remove(victim)
            else:
                cluster.release(victim.config, victim.tasks)
        return chosen
    finally:
        for victim in released:
            cluster.allocate(victim.config, victim.tasks)


def running_rank(config: JobConfig) -> int:
    return rank(config.priority)
