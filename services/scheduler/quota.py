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
  so it returns to its old place.
- **Preemption.** A job that cannot be placed now may stop, whole gangs only: lower-priority
  gangs of its own VC, and, when it is within its quota, gangs that other VCs run on borrowed
  capacity. Of those, the fewest lost GPU-seconds (then task-seconds) that make room: victims
  are tried cheapest first until the job fits, then any that were not needed are given back.
  Victims are never of equal or higher priority in the same VC, and borrowed work is taken only
  for work within its quota, so a preemption never answers a preemption.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from services.scheduler import placement
from shared.jobconfig import JobConfig, rank
from shared.messages import Quota, TaskSpec, VirtualCluster

DEFAULT_VC = "default"
ANY_MODEL = "*"  # in an Amount's gpus: every GPU, whatever its model


@dataclass
class Amount:
    """Resources: GPUs by lower-cased model (and ANY_MODEL: all of them), CPUs, memory."""

    gpus: dict[str, int] = field(default_factory=dict)
    cpus: int = 0
    memory_mb: int = 0

    def add(self, other: Amount, sign: int = 1) -> None:
        for model, n in other.gpus.items():
            self.gpus[model] = self.gpus.get(model, 0) + sign * n
        self.cpus += sign * other.cpus
        self.memory_mb += sign * other.memory_mb

    def shown(self) -> str:
        gpus = ", ".join(f"{n} {m}" for m, n in sorted(self.gpus.items()) if m != ANY_MODEL and n)
        return f"{gpus or '0 GPUs'}, {self.cpus} CPUs, {self.memory_mb} MB"


def need(config: JobConfig) -> Amount:
    """What a whole job asks for (elastic roles at their minimum); its GPUs under ANY_MODEL and,
    with a gpuType, that model too."""
    config = config.smallest()
    gpus = sum(r.gpuNumber * r.taskNumber for r in config.taskRoles)
    amount = Amount(
        {ANY_MODEL: gpus},
        sum(r.cpuNumber * r.taskNumber for r in config.taskRoles),
        sum(r.memoryMB * r.taskNumber for r in config.taskRoles),
    )
    if config.gpuType and gpus:
        amount.gpus[config.gpuType.lower()] = gpus
    return amount


def task_need(config: JobConfig, role_no: int) -> Amount:
    """What one task of a role asks for."""
    role = config.taskRoles[role_no]
    amount = Amount({ANY_MODEL: role.gpuNumber}, role.cpuNumber, role.memoryMB)
    if config.gpuType and role.gpuNumber:
        amount.gpus[config.gpuType.lower()] = role.gpuNumber
    return amount


def held(config: JobConfig, tasks: Iterable[TaskSpec], model_of: Callable[[str, int], str | None]) -> Amount:
    """What placed tasks hold, their GPUs by the model of each device (`model_of(node, index)`)."""
    amount = Amount()
    roles = config.taskRoles
    for t in tasks:
        if not 0 <= t.role_no < len(roles):
            continue
        role = roles[t.role_no]
        amount.cpus += role.cpuNumber
        amount.memory_mb += role.memoryMB
        for index in t.gpus:
            model = (model_of(t.node, index) or "?").lower()
            amount.gpus[model] = amount.gpus.get(model, 0) + 1
            amount.gpus[ANY_MODEL] = amount.gpus.get(ANY_MODEL, 0) + 1
    return amount


def capacity_of(nodes: Iterable[placement.NodeState]) -> Amount:
    total = Amount()
    for n in nodes:
        total.cpus += n.cpus
        total.memory_mb += n.memory_mb
        for d in n.gpus:
            total.gpus[d.model.lower()] = total.gpus.get(d.model.lower(), 0) + 1
            total.gpus[ANY_MODEL] = total.gpus.get(ANY_MODEL, 0) + 1
    return total


@dataclass(frozen=True)
class Limit:
    """A VC's quota as an Amount (None: that resource is not limited), and whether it borrows."""

    gpus: dict[str, int]
    cpus: int | None
    memory_mb: int | None
    borrow: bool = True

    def fits(self, used: Amount, extra: Amount) -> bool:
        for model, n in extra.gpus.items():
            if n and used.gpus.get(model, 0) + n > self.gpus.get(model, 0):
                return False
        if self.cpus is not None and used.cpus + extra.cpus > self.cpus:
            return False
        return self.memory_mb is None or used.memory_mb + extra.memory_mb <= self.memory_mb

    def share(self, used: Amount) -> float:
        """The dominant share: the largest fraction of any resource of this quota `used` holds."""
        parts = [used.gpus.get(ANY_MODEL, 0) / self.gpus[ANY_MODEL]] if self.gpus.get(ANY_MODEL) else []
        if self.cpus:
            parts.append(used.cpus / self.cpus)
        if self.memory_mb:
            parts.append(used.memory_mb / self.memory_mb)
        return max(parts, default=0.0)

    def shown(self) -> str:
        gpus = ", ".join(f"{n} {m}" for m, n in sorted(self.gpus.items()) if m != ANY_MODEL)
        cpus = "any CPUs" if self.cpus is None else f"{self.cpus} CPUs"
        mem = "any memory" if self.memory_mb is None else f"{self.memory_mb} MB"
        return f"{gpus or 'no GPUs'}, {cpus}, {mem}"


def _limit(q: Quota, borrow: bool) -> Limit:
    gpus = {m.lower(): n for m, n in q.gpus.items()}
    gpus[ANY_MODEL] = sum(gpus.values())
    return Limit(gpus, q.cpus, q.memory_mb, borrow)


def limits(vcs: Mapping[str, VirtualCluster], capacity: Amount) -> dict[str, Limit]:
    """Every VC's limit; `default`, unless configured, gets what the others leave of `capacity`."""
    out = {name: _limit(vc.quota, vc.borrow) for name, vc in vcs.items()}
    if DEFAULT_VC not in out:
        left = Amount(dict(capacity.gpus), capacity.cpus, capacity.memory_mb)
        for lim in out.values():
            left.add(Amount({m: n for m, n in lim.gpus.items()}, lim.cpus or 0, lim.memory_mb or 0), -1)
        out[DEFAULT_VC] = Limit(
            {m: max(0, n) for m, n in left.gpus.items()}, max(0, left.cpus), max(0, left.memory_mb)
        )
    return out


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
        lim = self.limit(w.vc)
        if lim.borrow or self.within(w.vc, need(w.config)):
            return None
        used = self.vc.get(w.vc, Amount())
        return (
            f"waiting for virtual cluster {w.vc}'s quota ({lim.shown()}): it needs "
            f"{need(w.config).shown()}, and {used.shown()} are in use"
        )


def candidates(job: Waiting, ledger: Ledger, running: Iterable[Running]) -> list[Running]:
    """The gangs `job` may preempt, cheapest first: lower priority in its own VC; and, if it is
    within its quota, other VCs' borrowed gangs."""
    within = ledger.within(job.vc, need(job.config))
    out = [
        r
        for r in running
        if r.job_id != job.job_id
        and not r.stopping
        and r.tasks
        and ((r.vc == job.vc and r.rank < job.rank) or (within and r.vc != job.vc and r.borrowed))
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
