"""Virtual clusters in the trace replay (`python -m bench.replay --vcs K [--users U]`): the
scheduler's sharing order (services/scheduler/quota.py) in front of its planner, each timed.

A trace has no VCs or users, so they are drawn from each task's name (crc32, the same every run):
K VCs `vc0`..`vc{K-1}`, each guaranteed 1/K of every GPU model of the nodes and free to borrow
beyond it (`--no-borrow`: not, so jobs beyond a VC's quota wait in the queue, held back), and U
users in each. The priority comes from the trace's QoS class (LS high, BE low,
the others normal; a trace without one: all normal). The ledger (what each VC and user holds) is
kept in step with what the replay starts and ends, as the scheduler's view keeps it.

Policies:
  * `muster-vc`: the order as the scheduler makes it, `quota.Order`, made as the planner takes it
    (its backfill window), never a sort of the whole backlog;
  * `muster-vc-sort`: the order as one sort of the whole backlog per decision (`Ledger.order`,
    and `why_not` for every job): the scheduler before issue 23. Too slow for the whole trace;
    compare them on a slice (`--limit`). Both start exactly the same jobs (a test holds them to it).

Each reports `order_s`, the CPU of the order within the decisions (for `muster-vc`, timed around
each job the planner takes from it, which adds two clock reads per job to it), `plan_s` the rest
of the decisions (the planner), and per decision the jobs handed to the order (`given`) and the
jobs whose place it worked out (`keyed`: one sort works out every one)."""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta

from bench.replay_policies import WINDOW, MusterKept, Placements
from bench.replay_trace import Trace
from muster.services.scheduler import quota
from muster.services.scheduler.placement import NodeState, PendingJob
from muster.shared.messages import TaskSpec, VirtualCluster

T0 = datetime(2023, 1, 1, tzinfo=UTC)
RANKS = {"LS": 2, "BE": 0}  # the trace's QoS class -> priority (high, low); others normal (1)
ORDERS = ("muster-vc", "muster-vc-sort")


def _draw(name: str, salt: str, n: int) -> int:
    return zlib.crc32(f"{salt}:{name}".encode()) % n


def vcs_for(nodes: Sequence[NodeState], k: int, borrow: bool = True) -> dict[str, VirtualCluster]:
    """K VCs, each guaranteed 1/K of every GPU model (rounded down), borrowing beyond it or not."""
    models: dict[str, int] = {}
    for n in nodes:
        for d in n.gpus:
            models[d.model] = models.get(d.model, 0) + 1
    return {
        f"vc{i}": VirtualCluster.model_validate(
            {
                "name": f"vc{i}",
                "quota": {"gpus": {m: c // k for m, c in models.items() if c // k}},
                "borrow": borrow,
            }
        )
        for i in range(k)
    }


def facts_for(trace: Trace, k: int, users: int, speedup: float) -> dict[str, quota.Fixed]:
    """Each task's VC, user, priority and submission time, as the order reads them."""
    out = {}
    for t in trace.tasks:
        vc = f"vc{_draw(t.name, 'vc', k)}"
        user = f"{vc}-u{_draw(t.name, 'user', users)}"
        at = T0 + timedelta(seconds=t.arrival / speedup)
        out[t.name] = quota.Fixed(t.name, vc, user, RANKS.get(t.qos, 1), at, quota.need(t.config))
    return out


class _Timed:
    """An order handed to the planner, the time spent in it summed."""

    def __init__(self, order: quota.Order[PendingJob]) -> None:
        self.order, self.spent = order, 0.0

    def _timed(self, jobs: Iterator[PendingJob]) -> Iterator[PendingJob]:
        clock = time.perf_counter
        while True:
            t = clock()
            job = next(jobs, None)
            self.spent += clock() - t
            if job is None:
                return
            yield job

    def __iter__(self) -> Iterator[PendingJob]:
        return self._timed(iter(self.order))

    def rest(self) -> Iterator[PendingJob]:
        return self._timed(iter(self.order.rest()))

    def in_order(self, job_ids: Iterable[str]) -> list[str]:
        t = time.perf_counter()
        try:
            return self.order.in_order(job_ids)
        finally:
            self.spent += time.perf_counter() - t


class Sharing(MusterKept):
    """Muster's kept core behind the sharing order: `windowed` as the scheduler makes it, else
    one sort of the whole backlog per decision."""

    def __init__(
        self,
        name: str,
        facts: Mapping[str, quota.Fixed],
        vcs: Mapping[str, VirtualCluster],
        nodes: Sequence[NodeState],
    ) -> None:
        super().__init__()
        self.name, self.facts, self.windowed = name, facts, name == "muster-vc"
        self.ledger = quota.Ledger(quota.limits(vcs, quota.capacity_of(nodes)), [])
        models = {(n.name, d.index): d.model for n in nodes for d in n.gpus}
        self.model_of = lambda node, index: models.get((node, index))
        self.held: dict[str, quota.Amount] = {}
        self.order_s = 0.0
        self.given = self.keyed = 0

    def _decide(self, nodes: Mapping[str, NodeState], queue: Sequence[PendingJob]) -> Placements:
        if self._nodes is not nodes:
            super()._decide(nodes, [])  # builds the kept index for these nodes
        clock = time.perf_counter
        t = clock()
        if self.windowed:
            order = quota.Order(self.ledger, ((self.facts[j.job_id], j) for j in queue))
            self.order_s += clock() - t
            timed = _Timed(order)
            placements = self._cluster.plan(timed, self._capacity, window=WINDOW).placements
            t = clock()
            order.held()  # asked as the scheduler asks: the reasons of the jobs held back
            self.order_s += timed.spent + clock() - t
            self.given += order.given
            self.keyed += order.keyed
            return placements
        waiting = [
            quota.Waiting(j.job_id, f.vc, f.user, f.rank, j.config, f.submitted_at)
            for j in queue
            for f in [self.facts[j.job_id]]
        ]
        held = {w.job_id for w in waiting if self.ledger.why_not(w) is not None}
        pending = {j.job_id: j for j in queue}
        ordered = [pending[w.job_id] for w in self.ledger.order(waiting) if w.job_id not in held]
        self.order_s += clock() - t
        self.given += len(queue)
        self.keyed += len(queue)
        return self._cluster.plan(ordered, self._capacity, window=WINDOW).placements

    def started(self, job: PendingJob, tasks: Sequence[TaskSpec]) -> None:
        super().started(job, tasks)
        use = quota.held(job.config, tasks, self.model_of)
        f = self.facts[job.job_id]
        self.ledger.take(f.vc, f.user, use)
        self.held[job.job_id] = use

    def ended(self, job: PendingJob, tasks: Sequence[TaskSpec]) -> None:
        super().ended(job, tasks)
        f = self.facts[job.job_id]
        self.ledger.take(f.vc, f.user, self.held.pop(job.job_id), -1)
