"""The gateway's cluster page (`nodes`): every node, its state and what its live tasks hold, and
the GPU allocation over time. Pure: no bus (the gateway mirrors the node and attempt buckets
into it, and feeds it the nodes' beats).

- `nodes`: the node records as the bucket holds them; `node_changed` keeps their names sorted
  (pages go by name) and takes each record's heartbeat as a sign of life.
- `held`: per attempt, its live tasks only (`live`, the attempts mirror's `keep`: an attempt
  with none is not kept), indexed by node as they change: a page reads its own nodes' tasks.
- A node is `restarting` while its record's restarting_until is ahead, else `lost` when nothing
  was heard of it (a beat, or its record's heartbeat) within the node timeout, else `draining`
  when drained, else `healthy` (as the scheduler and the supervisor see it: shared/liveness.py).
- What a task holds: its GPUs (the devices its attempt record names), and its role's CPUs and
  memory, from the job's summary in the gateway's job list. A device in use names its job only
  to the job's owner (or an admin).
- `allocation`: (time, GPUs used, GPUs of nodes not lost), one sample a call to `sample`, the
  last 24 hours of them.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import deque
from collections.abc import Iterator, Mapping, MutableMapping
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from muster.services.gateway.listing import Summary, micros, shown_time
from muster.shared import subjects
from muster.shared.liveness import Beats
from muster.shared.messages import AttemptRecord, NodeInfo

KEEP_ALLOCATION = timedelta(hours=24)
STATES = ("healthy", "draining", "restarting", "lost")


class Hold(NamedTuple):
    """One live task: where it runs and what it holds."""

    node: str
    job_id: str
    role_no: int
    gpus: tuple[int, ...]
    milli: int | None = None  # its share of gpus[0] in thousandths, when it holds part of one GPU


Live = tuple[Hold, ...]


def live(record: AttemptRecord) -> Live | None:
    """What an attempt's live tasks hold (the attempts mirror's `keep`); None when none is live
    (its record is then not kept)."""
    held = tuple(
        Hold(t.node, record.job_id, t.role_no, tuple(t.gpus), t.gpu_milli)
        for t in record.tasks
        if not t.state.ended
    )
    return held or None


class Held(MutableMapping[str, Live]):
    """Attempt key -> its live tasks, and per node: (attempt key, n) -> the task."""

    def __init__(self) -> None:
        self.attempts: dict[str, Live] = {}
        self.on: dict[str, dict[tuple[str, int], Hold]] = {}

    def __getitem__(self, key: str) -> Live:
        return self.attempts[key]

    def __setitem__(self, key: str, held: Live) -> None:
        if key in self.attempts:
            del self[key]
        self.attempts[key] = held
        for n, hold in enumerate(held):
            self.on.setdefault(hold.node, {})[(key, n)] = hold

    def __delitem__(self, key: str) -> None:
        for n, hold in enumerate(self.attempts.pop(key)):
            tasks = self.on.get(hold.node)
            if tasks is not None:
                tasks.pop((key, n), None)
                if not tasks:
                    del self.on[hold.node]

    def __iter__(self) -> Iterator[str]:
        return iter(self.attempts)

    def __len__(self) -> int:
        return len(self.attempts)


class Cluster:
    def __init__(self, jobs: Mapping[str, Summary], node_timeout: float, sample_every: float = 60.0) -> None:
        self.jobs = jobs  # job id -> summary (the gateway's job list): owners and what roles hold
        self.nodes: dict[str, NodeInfo] = {}
        self.names: list[str] = []  # of `nodes`, sorted
        self.held = Held()
        self.beats = Beats(node_timeout)
        points = math.ceil(KEEP_ALLOCATION.total_seconds() / max(sample_every, 1.0)) + 1
        self.allocation: deque[tuple[int, int, int]] = deque(maxlen=points)

    # ------------------------------------------------------------ what it is told

    def node_changed(self, name: str) -> None:
        """The nodes mirror's `changed`: the record of `name` was written (or removed)."""
        info = self.nodes.get(name)
        i = bisect.bisect_left(self.names, name)
        there = i < len(self.names) and self.names[i] == name
        if info is None:
            if there:
                del self.names[i]
            self.beats.forget(name)
            return
        if not there:
            self.names.insert(i, name)
        self.beats.saw(name, info.heartbeat_at)

    def beat(self, name: str, at: datetime) -> None:
        """A beat heard from node `name` (only its own agent may send it), kept even before its
        record is read (as the scheduler keeps it): the record's heartbeat may be a minute old."""
        self.beats.saw(name, at)

    # ------------------------------------------------------------ what it answers

    def state(self, info: NodeInfo, at: datetime) -> str:
        if info.restarting_until is not None and info.restarting_until > at:
            return "restarting"
        if not self.beats.alive(info.node, at):
            return "lost"
        return "draining" if info.drained else "healthy"

    def _used_gpus(self, info: NodeInfo) -> dict[int, list[Hold]]:
        """The node's devices held by live tasks: index -> the tasks (several on a shared GPU)."""
        indices = {d.index for d in info.gpus}
        out: dict[int, list[Hold]] = {}
        for hold in self.held.on.get(info.node, {}).values():
            for g in hold.gpus:
                if g in indices:
                    out.setdefault(g, []).append(hold)
        return out

    def node(self, info: NodeInfo, who: str, at: datetime) -> dict[str, Any]:
        """What the page shows of one node, as `who` may see it."""
        used = self._used_gpus(info)
        cpus = memory_mb = 0
        for hold in self.held.on.get(info.node, {}).values():
            s = self.jobs.get(hold.job_id)
            if s is not None and 0 <= hold.role_no < len(s.roles):
                cpus += s.roles[hold.role_no][0]
                memory_mb += s.roles[hold.role_no][1]
        models: dict[str, list[int]] = {}
        devices = []
        for d in sorted(info.gpus, key=lambda d: d.index):
            holders = used.get(d.index, [])
            jobs: list[str] = []  # the holders' jobs `who` may see, each once
            for hold in holders:
                s = self.jobs.get(hold.job_id)
                if s is not None and (who == subjects.ALL or s.user == who) and hold.job_id not in jobs:
                    jobs.append(hold.job_id)
            count = models.setdefault(d.model, [0, 0])
            count[0] += 1
            count[1] += bool(holders)
            device: dict[str, Any] = {
                "index": d.index,
                "model": d.model,
                "used": bool(holders),
                "job": jobs[0] if jobs else None,
                "jobs": jobs,
            }
            if any(h.milli is not None for h in holders):  # a shared GPU: how much of it is taken
                device["shared_milli"] = sum(h.milli or 0 for h in holders)
            devices.append(device)
        return {
            "name": info.node,
            "state": self.state(info, at),
            "address": info.address,
            "cpus": info.cpus,
            "cpus_used": cpus,
            "memory_mb": info.memory_mb,
            "memory_mb_used": memory_mb,
            "gpus": [
                {"model": m, "total": total, "used": n, "free": total - n}
                for m, (total, n) in sorted(models.items())
            ],
            "devices": devices,
        }

    def summary(self, at: datetime) -> dict[str, Any]:
        """Nodes per state, and GPUs per model: total, used, and free on healthy nodes (where
        new work may go). A pass over the nodes: asked on a first page only."""
        states = dict.fromkeys(STATES, 0)
        models: dict[str, list[int]] = {}
        for info in self.nodes.values():
            state = self.state(info, at)
            states[state] += 1
            used = self._used_gpus(info)
            for d in info.gpus:
                count = models.setdefault(d.model, [0, 0, 0])
                count[0] += 1
                count[1] += d.index in used
                count[2] += state == "healthy" and d.index not in used
        return {
            "nodes": len(self.nodes),
            "states": states,
            "gpus": [
                {"model": m, "total": t, "used": u, "free": f} for m, (t, u, f) in sorted(models.items())
            ],
        }

    def page(self, who: str, after: str | None, limit: int, budget: int, at: datetime) -> dict[str, Any]:
        """Nodes by name after `after` (a page's `next`), up to `limit` and `budget` bytes;
        the first page (no `after`) also has `summary` and `allocation` (thinned to fit a
        quarter of the budget). `next`: the cursor of the page after, None at the end."""
        answer: dict[str, Any] = {}
        if after is None:
            answer["summary"] = self.summary(at)
            answer["allocation"] = self.shown_allocation(budget // 4)
            budget -= len(json.dumps(answer, separators=(",", ":")))
        i = 0 if after is None else bisect.bisect_right(self.names, after)
        nodes: list[dict[str, Any]] = []
        size, more = 0, False
        while i < len(self.names):
            info = self.nodes.get(self.names[i])
            i += 1
            if info is None:
                continue
            if len(nodes) >= limit:
                more = True
                break
            item = self.node(info, who, at)
            cost = len(json.dumps(item, separators=(",", ":"))) + 1
            if nodes and size + cost > budget:
                more = True
                break
            nodes.append(item)
            size += cost
        answer["nodes"] = nodes
        # A cursor as the jobs' are shaped (`<n>.<name>`): how many came before, and the last name.
        answer["next"] = f"{i - 1}.{nodes[-1]['name']}" if more and nodes else None
        return answer

    # ------------------------------------------------------------ allocation over time

    def sample(self, at: datetime) -> tuple[int, int]:
        """Take one allocation sample at `at`: GPUs held, GPUs of the nodes not lost."""
        used = total = 0
        for info in self.nodes.values():
            if self.state(info, at) == "lost":
                continue
            total += len(info.gpus)
            used += len(self._used_gpus(info))
        t = micros(at)
        self.allocation.append((t, used, total))
        cutoff = t - KEEP_ALLOCATION // timedelta(microseconds=1)
        while self.allocation and self.allocation[0][0] < cutoff:
            self.allocation.popleft()
        return used, total

    def shown_allocation(self, budget: int) -> list[list[Any]]:
        """`[[iso time, used, total], ...]`, every k-th sample (and the last) so as to fit `budget`."""
        points = list(self.allocation)
        one = 48  # bytes of one point, about: ["2026-01-01T00:00:00.000000+00:00",123,456]
        step = max(1, math.ceil(len(points) * one / max(budget, one)))
        kept = points[::step]
        if points and kept[-1] is not points[-1]:
            kept.append(points[-1])
        return [[shown_time(t), used, total] for t, used, total in kept]
