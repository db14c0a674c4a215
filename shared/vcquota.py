"""Virtual clusters' quota arithmetic, a pure core: what a job needs, what placed tasks hold,
what the nodes have, and every VC's limit (`default`'s is what the configured VCs leave of the
cluster). The scheduler orders, borrows and preempts with it (services/scheduler/quota.py); the
gateway shows per-VC usage with it. Shared, so that neither service imports the other."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from muster.shared.jobconfig import JobConfig
from muster.shared.messages import GpuDevice, Quota, TaskSpec, VirtualCluster

DEFAULT_VC = "default"
ANY_MODEL = "*"  # in an Amount's gpus: every GPU, whatever its model


@dataclass
class Amount:
    """Resources: GPUs by lower-cased model (and ANY_MODEL: all of them), CPUs, memory. A task
    that shares a GPU counts its share (0.25), so GPU counts are kept to thousandths."""

    gpus: dict[str, float] = field(default_factory=dict)
    cpus: int = 0
    memory_mb: int = 0

    def add(self, other: Amount, sign: int = 1) -> None:
        for model, n in other.gpus.items():
            self.gpus[model] = gpu_count(self.gpus.get(model, 0) + sign * n)
        self.cpus += sign * other.cpus
        self.memory_mb += sign * other.memory_mb

    def shown(self) -> str:
        """`2 v100, 1 GPUs of any model, 8 CPUs, 4096 MB`: GPUs by model, and those of no model
        (jobs without a gpuType) apart, never "0 GPUs" for a job that asks for some."""
        named = {m: n for m, n in sorted(self.gpus.items()) if m != ANY_MODEL and n}
        parts = [f"{n:g} {m}" for m, n in named.items()]
        other = gpu_count(self.gpus.get(ANY_MODEL, 0) - sum(named.values()))
        if other > 0:
            parts.append(f"{other:g} GPUs of any model")
        return f"{', '.join(parts) or '0 GPUs'}, {self.cpus} CPUs, {self.memory_mb} MB"


def gpu_count(n: float) -> float:
    """A GPU count kept to thousandths (what a share is given in), an int when whole: sums of
    shares must come back to exactly what they were when the shares are taken away."""
    n = round(n, 3)
    return int(n) if float(n).is_integer() else n


def need(config: JobConfig) -> Amount:
    """What a whole job asks for (elastic roles at their minimum); its GPUs under ANY_MODEL and,
    with a gpuType, that model too."""
    config = config.smallest()
    gpus = gpu_count(sum(r.gpuNumber * r.taskNumber for r in config.taskRoles))
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
        each = 1 if t.gpu_milli is None else t.gpu_milli / 1000
        for index in t.gpus:
            model = (model_of(t.node, index) or "?").lower()
            amount.gpus[model] = gpu_count(amount.gpus.get(model, 0) + each)
            amount.gpus[ANY_MODEL] = gpu_count(amount.gpus.get(ANY_MODEL, 0) + each)
    return amount


class Sized(Protocol):
    """A node as capacity reads it: a `NodeInfo` record, or the scheduler's `NodeState`."""

    @property
    def cpus(self) -> int: ...
    @property
    def memory_mb(self) -> int: ...
    @property
    def gpus(self) -> Sequence[GpuDevice]: ...


def capacity_of(nodes: Iterable[Sized]) -> Amount:
    """What the nodes have in all: every GPU by model and under ANY_MODEL, CPUs, memory."""
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

    gpus: dict[str, float]
    cpus: int | None
    memory_mb: int | None
    borrow: bool = True

    def fits(self, used: Amount, extra: Amount) -> bool:
        for model, n in extra.gpus.items():
            if n and gpu_count(used.gpus.get(model, 0) + n) > self.gpus.get(model, 0):
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
        gpus = ", ".join(f"{n:g} {m}" for m, n in sorted(self.gpus.items()) if m != ANY_MODEL)
        cpus = "any CPUs" if self.cpus is None else f"{self.cpus} CPUs"
        mem = "any memory" if self.memory_mb is None else f"{self.memory_mb} MB"
        return f"{gpus or 'no GPUs'}, {cpus}, {mem}"


def _limit(q: Quota, borrow: bool) -> Limit:
    gpus: dict[str, float] = {m.lower(): n for m, n in q.gpus.items()}
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
