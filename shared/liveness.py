"""Which nodes live: the last sign of life of each, and which have gone quiet, at the cost of
what the beats are, not of a pass over the nodes.

An agent beats on core NATS every heartbeat (`subjects.beat(node)`, no payload, never stored:
a few µs to receive, where a KV write of the node record was a JetStream store, an ack and a
decoded record for every watcher). Its node record (KV `muster_nodes`) is written only when it
changes (registration, drain, a restart announced), after a reconnect, and every
MUSTER_NODE_REFRESH seconds (default 60) so that its `heartbeat_at` is never older than that.
A node's last sign of life is the later of its record's `heartbeat_at` and its last beat heard.

`Beats` keeps those times and finds the nodes gone quiet (nothing for `timeout` seconds) from a
heap holding at most one entry per node: a beat only updates a dict; the entry of a node that
beat since it was queued is queued again once per timeout when it comes out."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from datetime import datetime, timedelta

from nats.aio.client import Client as NATS

from muster.shared import subjects
from muster.shared.messages import now

PREFIX = subjects.beat("")  # "muster.beat."


class Beats:
    def __init__(self, timeout: float) -> None:
        self.timeout = timedelta(seconds=timeout)
        self.last: dict[str, datetime] = {}  # node -> its last sign of life
        self._heap: list[tuple[datetime, str]] = []
        # node -> the time of its one live entry in the heap: not (yet) found quiet. An entry
        # that is not a node's live one was left by `forget` and is skipped.
        self._queued: dict[str, datetime] = {}
        self._stale = 0  # entries left by `forget`: swept out once they outnumber the live ones

    def saw(self, node: str, at: datetime) -> bool:
        """A sign of life of `node` at `at` (a beat, or its record's heartbeat_at); whether it
        was quiet (or unknown) until now."""
        last = self.last.get(node)
        if last is not None and last >= at:
            return False
        self.last[node] = at
        if node in self._queued:
            return False
        self._queued[node] = at
        heapq.heappush(self._heap, (at, node))
        return True

    def quiet(self, at: datetime) -> list[str]:
        """The nodes that have gone quiet since the last call: no sign of life for longer than
        the timeout. Costs O(log n) per node that beat since it was queued, once a timeout."""
        cutoff = at - self.timeout
        out = []
        while self._heap and self._heap[0][0] < cutoff:
            queued, node = heapq.heappop(self._heap)
            if self._queued.get(node) != queued:  # forgotten since it was queued
                self._stale = max(0, self._stale - 1)
                continue
            last = self.last[node]
            if last >= cutoff:  # it beat since: look again a timeout after its last beat
                self._queued[node] = last
                heapq.heappush(self._heap, (last, node))
            else:
                del self._queued[node]
                out.append(node)
        return out

    def alive(self, node: str, at: datetime) -> bool:
        last = self.last.get(node)
        return last is not None and last >= at - self.timeout

    def forget(self, node: str) -> None:
        """`node` is gone (its record was removed): nothing of it is kept. Its heap entry is
        left, skipped, and swept out with the others once they outnumber the live ones (an
        owner that never asks which nodes are quiet, the gateway, kept one per node name ever
        seen)."""
        self.last.pop(node, None)
        if self._queued.pop(node, None) is not None:
            self._stale += 1
            if self._stale > len(self._queued) + 64:
                self._heap = [e for e in self._heap if self._queued.get(e[1]) == e[0]]
                heapq.heapify(self._heap)
                self._stale = 0


async def listen(nc: NATS, on_beat: Callable[[str, datetime], None]) -> None:
    """Call `on_beat(node, when it was heard)` for every beat on the bus, until unsubscribed
    (the subscription lives as long as the connection)."""

    async def heard(msg: object) -> None:
        subject = getattr(msg, "subject", "")
        if subject.startswith(PREFIX):
            on_beat(subject[len(PREFIX) :], now())

    await nc.subscribe(subjects.beat("*"), cb=heard, pending_msgs_limit=1_000_000)
