"""What the tasks of one connection read from the bus, read once: the cluster spec of an
attempt (one subscription and one read however many of its tasks wait for it) and, for a
process of many agents, attempt records (concurrent reads of one record share a single read).

A gang's spec and attempt record grow with the gang: an 800-task attempt's are ~100 KB each.
Read once per task they are 80 MB at once on one connection, which the server cuts off as a
slow consumer; a sim process (services/agent/sim.py) holds hundreds of one gang's tasks on its
one connection, and a real agent a handful."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, TypeVar

import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from muster.shared import subjects
from muster.shared.messages import AttemptRecord, ClusterSpec, Message, TaskStatus
from muster.shared.store import Store

M = TypeVar("M", bound=Message)
AttemptKey = tuple[str, int]


@dataclass(frozen=True)
class Shared:
    """What the agents of one process share (a sim process: thousands on one connection)."""

    attempts: Attempts
    specs: Specs

    @classmethod
    def of(cls, nc: NATS, js: JetStreamContext, attempts: KeyValue) -> Shared:
        return cls(Attempts(attempts), Specs(nc, js))


class Specs:
    """Cluster specs awaited here: one read per attempt, shared by every task waiting for it,
    and dropped once no task waits (a late task reads the stored spec again)."""

    def __init__(self, nc: NATS, js: JetStreamContext) -> None:
        self.nc, self.js = nc, js
        # A read and the keys of the spec it read, found once for all its waiters (a sim process
        # holds a whole gang: a pass over the spec per task would be O(N²)).
        self._reads: dict[AttemptKey, asyncio.Task[tuple[ClusterSpec, frozenset[str]]]] = {}
        self._waiting: dict[AttemptKey, int] = {}
        self._early: dict[AttemptKey, Any] = {}  # subscriptions made before the endpoint went out

    async def expect(self, job_id: str, attempt: int) -> None:
        """Subscribe to the attempt's spec now, before this node reports its endpoint: the
        registry publishes the spec only after every endpoint is in, and the server handles a
        connection's SUB before its later PUB, so the spec cannot pass by unseen (a missed one
        costs a read, 50 ms later at best). Taken over by the attempt's next `wait`; `forget`
        drops it when no task will wait."""
        key = (job_id, attempt)
        if key not in self._early and key not in self._reads:
            self._early[key] = await self.nc.subscribe(subjects.cluster_spec(job_id, attempt))

    async def forget(self, job_id: str, attempt: int) -> None:
        sub = self._early.pop((job_id, attempt), None)
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def wait(self, job_id: str, attempt: int, member: str | None = None) -> ClusterSpec:
        """The attempt's spec once the registry has published it (the rendezvous barrier); with
        `member` ("<role>.<index>"), one that lists it: a task that joined an elastic attempt
        waits for the version with itself in it (read on its own: that is rare)."""
        spec, members = await self._shared(job_id, attempt)
        if member is None or member in members:
            return spec
        return await self._read(job_id, attempt, member)

    async def _keyed(self, job_id: str, attempt: int, early: Any) -> tuple[ClusterSpec, frozenset[str]]:
        spec = await self._read(job_id, attempt, None, early)
        return spec, frozenset(f"{e.role}.{e.index}" for e in spec.endpoints)

    async def _shared(self, job_id: str, attempt: int) -> tuple[ClusterSpec, frozenset[str]]:
        key = (job_id, attempt)
        read = self._reads.get(key)
        if read is None:
            read = self._reads[key] = asyncio.create_task(
                self._keyed(job_id, attempt, self._early.pop(key, None))
            )
        self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            return await asyncio.shield(read)
        finally:
            self._waiting[key] -= 1
            if not self._waiting[key]:  # the last waiter: nobody needs it any more
                del self._waiting[key], self._reads[key]
                read.cancel()

    async def _read(
        self, job_id: str, attempt: int, member: str | None = None, early: Any = None
    ) -> ClusterSpec:
        """Subscribe, then wait on the subscription between reads of the stored spec. The
        server hands a published message to subscribers before the stream has stored it, so a
        spec published just as we subscribe can be missed by both: the reads come soon at first
        (50 ms, doubling to 5 s), not a whole wait later. The first read comes after the first
        wait: a task's spec is usually published after its order is taken (it waits for the
        task's own endpoint), so it comes on the subscription and is never read (a round trip
        per task saved); one published already (a restarted agent) is read 50 ms later. With
        `member`: a spec that lists it. `early`: the subscription `expect` made, if any."""
        subject = subjects.cluster_spec(job_id, attempt)
        sub = early or await self.nc.subscribe(subject)
        wait = 0.05
        try:
            while True:
                with contextlib.suppress(nats.errors.TimeoutError, ValueError):  # none, or garbage
                    spec = ClusterSpec.from_bytes((await sub.next_msg(timeout=wait)).data)
                    if member is None or spec.has(member):
                        return spec
                try:
                    stored = await self.js.get_last_msg(subjects.EVENTS_STREAM, subject, direct=True)
                    spec = ClusterSpec.from_bytes(stored.data)
                    if member is None or spec.has(member):
                        return spec
                except NotFoundError:
                    pass
                except Exception:
                    await asyncio.sleep(0.5)
                wait = min(wait * 2, 5.0)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


class SharedStore(Store[M]):
    """A `Store` whose concurrent reads of one key share a single read, and whose records are
    reused for `ttl` seconds: for many agents on one connection, which all read the records of
    the attempts they run (placing, starting, and checking every heartbeat that a task is still
    live). A record up to `ttl` old is what the heartbeat check of a real agent sees at worst
    anyway: it runs only every heartbeat."""

    def __init__(self, kv: KeyValue, model: type[M], ttl: float = 1.0) -> None:
        super().__init__(kv, model)
        self.ttl = ttl
        self._reads: dict[str, tuple[float, asyncio.Task[M | None]]] = {}
        self._swept = 0.0

    async def get(self, key: str, confirm: bool = False) -> M | None:  # shared reads: never confirmed
        now = asyncio.get_running_loop().time()
        if now - self._swept > self.ttl:  # at most once a ttl: forget what is too old to reuse
            self._reads = {
                k: (at, r) for k, (at, r) in self._reads.items() if not _stale(at, r, now, self.ttl)
            }
            self._swept = now
        at, read = self._reads.get(key, (now, None))
        if read is None or _stale(at, read, now, self.ttl):
            read = asyncio.create_task(super().get(key))
            self._reads[key] = (now, read)
        return await asyncio.shield(read)


def _stale(at: float, read: asyncio.Task[M | None], now: float, ttl: float) -> bool:
    """A read not to reuse: done more than `ttl` after it began, or failed (read again)."""
    if not read.done():
        return False
    return now - at > ttl or read.cancelled() or read.exception() is not None


@dataclass(frozen=True)
class Placement:
    """An attempt record's tasks by key and by node, worked out once per read of the record:
    what an agent looks up for its own tasks (orders, kill orders, the obsolete-task check)
    without a pass over the gang per task (a gang of N on N nodes: O(N²) for the gang)."""

    record: AttemptRecord
    by_key: dict[str, TaskStatus]
    by_node: dict[str, list[TaskStatus]]

    @classmethod
    def of(cls, record: AttemptRecord) -> Placement:
        by_node: dict[str, list[TaskStatus]] = {}
        for t in record.tasks:
            by_node.setdefault(t.node, []).append(t)
        return cls(record, {t.key: t for t in record.tasks}, by_node)


class Attempts(SharedStore[AttemptRecord]):
    """Attempt records, read as `SharedStore` reads them, each indexed (`Placement`) once per
    read however many agents and tasks look into it."""

    KEPT = 256  # attempts whose newest read's index is kept

    def __init__(self, kv: KeyValue, ttl: float = 1.0) -> None:
        super().__init__(kv, AttemptRecord, ttl)
        # attempt key -> the index of its newest read (which holds it), the least recently
        # indexed first. By key, not by read: every read of an attempt after `ttl` is a new
        # record, and each kept its own index, so an agent held up to KEPT whole copies of
        # the one big record it checks (a 2,000-task gang's: ~1 GB after a day).
        self._indexed: dict[str, Placement] = {}

    async def placement(self, key: str) -> Placement | None:
        record = await self.get(key)
        if record is None:
            return None
        found = self._indexed.get(key)
        if found is None or found.record is not record:
            self._indexed.pop(key, None)
            found = self._indexed[key] = Placement.of(record)
            while len(self._indexed) > self.KEPT:
                del self._indexed[next(iter(self._indexed))]
        return found
