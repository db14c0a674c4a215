"""Typed access to Muster's KV buckets: one `Store` per bucket and record type.

Every read decodes through the record's model; a record that does not decode (garbage written
by a buggy or hostile client, a record of a newer version) is skipped, counted in
`muster_bad_records_total` and named in the log once — it is never fatal to the reader.
Writes that must not overwrite another writer go through `update` (read-modify-write with
the revision read, retried)."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

import structlog
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError
from nats.js.kv import KV_DEL, KV_MARKER_REASON, KV_OP, KV_PURGE, KeyValue
from prometheus_client import Counter
from pydantic import ValidationError

from muster.shared.messages import Message

M = TypeVar("M", bound=Message)
KV_PUT = "PUT"
OWN_KEPT = 256  # records a store wrote kept for its watcher (see Store._wrote): a cycle's commits
BAD_RECORDS = Counter(
    "muster_bad_records_total", "KV records skipped: they do not decode, or claim what cannot be", ["bucket"]
)
log = structlog.get_logger()
# (bucket, key, why) already logged: each is named once. Bounded (the oldest forgotten first): a
# why may quote the record (a heartbeat from the future names its time), so a node rewriting a
# bad record adds one per write.
_named: dict[tuple[str, str, str], None] = {}
NAMED_KEPT = 4096


async def confirmed(kv: KeyValue, key: str) -> KeyValue.Entry | None:
    """The entry under `key` in `kv`, asked of the bucket's stream leader (`$JS.API.STREAM.MSG.GET`)
    too when a direct get finds none: a replica that lags may answer a direct get (`Store.get`)."""
    try:
        return await kv.get(key)
    except KeyNotFoundError:
        pass
    leader = KeyValue(name=kv._name, stream=kv._stream, pre=kv._pre, js=kv._js, direct=False)
    try:
        return await leader.get(key)
    except KeyNotFoundError:
        return None


class Store(Generic[M]):
    def __init__(
        self,
        kv: KeyValue,
        model: type[M],
        check: Callable[[str, M], str | None] | None = None,
        cache: int = 0,
    ):
        """`check(key, record)`: why a record that decodes may still not be believed (a node
        record from the future), or None; such records are skipped like undecodable ones.

        `cache`: keep the latest (revision, bytes) of up to that many keys (the newest) that
        `mirror` and this store's own writes saw, so that `update` can write on a known revision
        without reading first (half the round trips of a read-modify-write), with the record as
        decoded then (so `update` does not decode it again). A stale or evicted copy costs
        nothing but the read it would have saved: the write is conditional on its revision.
        0: none."""
        self.kv, self.model, self.check = kv, model, check
        self.bucket = kv._name
        self._limit = cache
        self._latest: dict[str, tuple[int, bytes, M | None]] | None = {} if cache else None
        # Once `mirror` runs: the records this store writes, as bytes and decoded, kept from just
        # before the write until the watcher sees those bytes come back (then it takes the record
        # rather than decoding again: a big attempt record is ~12 ms). Kept before: the delivery
        # can come before the write's own reply.
        self._wrote: dict[str, tuple[bytes, M]] = {}
        self._mirrored = False
        # The mirror's position (the stream sequence it last applied), and who waits for it to
        # reach one (`caught_up`): (sequence, tie, future), a heap.
        self.applied = 0
        self._behind: list[tuple[int, int, asyncio.Future[None]]] = []
        self._tie = itertools.count()
        self._unreached = 0  # a sequence it waited for in vain (see `caught_up`)

    def _saw(self, key: str, revision: int, data: bytes | None, record: M | None = None) -> None:
        if self._latest is None:
            return
        known = self._latest.get(key)
        if known is not None and known[0] >= revision:
            return
        if data is None:
            self._latest.pop(key, None)
            return
        self._latest[key] = (revision, data, record)
        if len(self._latest) > self._limit:  # the oldest first (insertion order)
            del self._latest[next(iter(self._latest))]

    def _own(self, key: str, data: bytes, record: M) -> None:
        if not self._mirrored:
            return
        self._wrote.pop(key, None)
        self._wrote[key] = (data, record)
        if len(self._wrote) > OWN_KEPT:
            del self._wrote[next(iter(self._wrote))]

    def decode(self, key: str, data: bytes | None) -> M | None:
        """The record, or None (counted and named once) when it does not decode or check."""
        if not data:
            return None
        try:
            record = self.model.model_validate_json(data)
            why = self.check(key, record) if self.check else None
            if why is None:
                return record
            error = f"not believed: {why}"
        except (ValidationError, ValueError) as exc:
            error = str(exc)[:200]
        BAD_RECORDS.labels(self.bucket).inc()
        if (self.bucket, key, error) not in _named:
            _named[(self.bucket, key, error)] = None
            if len(_named) > NAMED_KEPT:
                del _named[next(iter(_named))]
            log.warning("store.bad_record", bucket=self.bucket, key=key, error=error)
        return None

    async def get(self, key: str, confirm: bool = False) -> M | None:
        """The record under `key`; None when there is none or it does not decode.

        `confirm`: a key the read did not find is asked of the bucket's stream leader too. Reads
        are direct gets, which any replica of a replicated bucket may answer, and one that has
        not applied the newest write yet says "not found" for a record just written: in CI the
        registry refused a gang's endpoint as "no such attempt" 120 ms after the scheduler had
        stored the attempt, and the gang never started. For reads whose None drops something
        for good (an event, an endpoint); one more request, only when nothing was found."""
        if confirm:
            entry = await confirmed(self.kv, key)
        else:
            try:
                entry = await self.kv.get(key)
            except KeyNotFoundError:
                entry = None
        return None if entry is None else self.decode(key, entry.value)

    async def create(self, key: str, record: M) -> bool:
        """Write `record` only if `key` has none; whether it was written."""
        data = record.to_bytes()
        self._own(key, data, record)
        try:
            revision = await self.kv.create(key, data)
            self._saw(key, revision, data, record)
            return True
        except KeyWrongLastSequenceError:
            return False

    async def write(self, key: str, record: M, revision: int) -> bool:
        """Write `record` only if `key` is still at `revision`; whether it was written."""
        data = record.to_bytes()
        self._own(key, data, record)
        try:
            written = await self.kv.update(key, data, last=revision)
            self._saw(key, written, data, record)
            return True
        except KeyWrongLastSequenceError:
            return False

    def cached(self, key: str) -> tuple[int, bytes] | None:
        """The newest (revision, bytes) of `key` this store saw, if it keeps them (`cache`): a
        guess to write on, proved current only by the write."""
        known = self._latest.get(key) if self._latest is not None else None
        return known[:2] if known is not None else None

    async def update(self, key: str, change: Callable[[M], M | None]) -> M | None:
        """Read-modify-write with the revision read, retried until no other writer got in
        between. `change` returns the new record, or None to leave it as it is; it must not
        change the record it is given (with `cache`, that may be the one a mirror's view holds):
        it returns a copy (`model_copy`). Returns the record written, or None (nothing written:
        no record, a bad one, or no change).

        With `cache`, the first try is on the cached copy, decoded once when it was seen; only a
        write proves it current, so when it says "no change" (or does not decode) the stored
        record decides.

        A record the read does not find is asked of the stream's leader (see `get`): a replica
        behind would make the change silently nothing."""
        cached = self._latest.get(key) if self._latest is not None else None
        revision: int | None
        data: bytes | None
        while True:
            fresh = cached is None
            current: M | None = None
            if cached is not None:
                (revision, data, current), cached = cached, None
            else:
                entry = await confirmed(self.kv, key)
                if entry is None:
                    return None
                revision, data = entry.revision, entry.value
            current = current or self.decode(key, data)
            updated = change(current) if current is not None else None
            if updated is None:
                if fresh:
                    return None
                continue
            new = updated.to_bytes()
            self._own(key, new, updated)
            try:
                written = await self.kv.update(key, new, last=revision)
            except KeyWrongLastSequenceError:
                continue
            self._saw(key, written, new, updated)
            return updated

    async def delete(self, key: str) -> None:
        await self.kv.purge(key)
        if self._latest is not None:
            self._latest.pop(key, None)

    async def keys(self) -> list[str]:
        return await keys(self.kv)

    async def items(self) -> AsyncIterator[tuple[str, M]]:
        """Every record that decodes, with its key."""
        for key in await self.keys():
            record = await self.get(key)
            if record is not None:
                yield key, record

    def _reached(self, revision: int) -> None:
        self.applied = max(self.applied, revision)
        while self._behind and self._behind[0][0] <= self.applied:
            _, _, waiter = heapq.heappop(self._behind)
            if not waiter.done():
                waiter.set_result(None)

    async def caught_up(self, timeout: float) -> bool:
        """Wait until the mirror holds every write made to the bucket before this call (read
        your writes: a job listed right after its submit was accepted), at most `timeout`
        seconds; whether it does. One request for the stream's last sequence, then nothing if
        the mirror is there already. A last message that never comes (an expired one) is waited
        for once, not by every later call."""
        info = await self.kv._js.stream_info(self.kv._stream)
        last = info.state.last_seq
        if not info.state.messages or self.applied >= last or last <= self._unreached:
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._behind, (last, next(self._tie), waiter))
        try:
            await asyncio.wait_for(waiter, timeout)
            return True
        except TimeoutError:
            self._unreached = max(self._unreached, last)
            return False

    async def mirror(
        self,
        into: MutableMapping[str, Any],
        synced: asyncio.Event,
        changed: Callable[[str], None] | None = None,
        keep: Callable[[M], Any] | None = None,
        refresh: Callable[[Any, bytes], Any] | None = None,
    ) -> None:
        """Keep `into` equal to the bucket (records that decode) for as long as it runs, with one
        watcher: no polling, no consumer per read. `synced` is set once the current content is
        in; `changed(key)` is called after each change. `keep(record)`: what to hold of each
        record (default: the record), or None to hold nothing for it. `refresh(held, data)`:
        for a key `into` holds already, what to hold from the new bytes and the held value
        without decoding the whole record (records whose unchanging part is most of them, as a
        job's config); it raises ValueError for bytes it cannot read, and the record is then
        decoded whole. A watch that cannot be set up is tried again every second.

        The watch is nats-py's KV watch (an ordered consumer of each key's last message, then of
        every change) without its per-message layers: each delivery is applied in the
        subscription's own callback, not handed through a queue as an `Entry` with its metadata
        (a timestamp) parsed, a quarter of what a delivery cost the scheduler. "In" is a delivery
        with nothing pending after it, or a bucket whose stream holds no message (`empty`) once
        the consumer exists: nats-py's own "no more for now" marker could come before the first
        entries (the race `keys()` describes), and a view called synced without them would let a
        scheduler place on GPUs it had not yet seen held."""
        self._mirrored = True
        prefix = len(self.kv._pre)

        async def delivered(msg: Msg) -> None:
            try:
                revision, pending = _position(msg.reply)
            except ValueError:
                log.error("store.watch_update_failed", bucket=self.bucket, subject=msg.subject, exc_info=True)
                return
            try:
                key = msg.subject[prefix:]
                operation = _operation(msg.headers)
                if operation is None:
                    return  # a marker of a kind this client does not know: nothing to apply
                record = kept = None
                if operation not in (KV_DEL, KV_PURGE):
                    own = self._wrote.get(key)
                    if own is not None and own[0] == msg.data:  # what this store wrote: taken back
                        del self._wrote[key]
                        record = own[1]
                    elif refresh is not None and key in into:
                        with contextlib.suppress(ValueError):
                            kept = refresh(into[key], msg.data)
                    if kept is None and record is None:
                        record = self.decode(key, msg.data)
                if kept is None:
                    self._saw(key, revision, msg.data if record is not None else None, record)
                    kept = record if record is None or keep is None else keep(record)
                else:  # refreshed: the bytes are kept, decoded when a write needs them
                    self._saw(key, revision, msg.data, None)
                if kept is None:
                    into.pop(key, None)
                else:
                    into[key] = kept
                if changed is not None:
                    changed(key)
                if pending == 0:
                    synced.set()
            except Exception:  # never lost in nats-py's error callback: said, and the next goes on
                log.error("store.watch_update_failed", bucket=self.bucket, subject=msg.subject, exc_info=True)
            finally:
                self._reached(revision)  # applied, or skipped for good: either way, passed

        while True:
            sub = None
            try:
                sub = await self.kv._js.subscribe(
                    f"{self.kv._pre}>",
                    stream=self.kv._stream,
                    cb=delivered,
                    ordered_consumer=True,
                    deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                    inactive_threshold=300,  # as nats-py's KV watch: the server drops it if we go
                )
                if not synced.is_set() and await empty(self.kv):
                    synced.set()
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError  # a cancel nats-py's flush swallowed (it does)
                await asyncio.Future()  # until cancelled: deliveries come to `delivered`
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("store.watch_restart", bucket=self.bucket, error=str(exc) or type(exc).__name__)
                await asyncio.sleep(1)
            finally:
                if sub is not None:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()


def _position(reply: str) -> tuple[int, int]:
    """(stream sequence, messages pending) of a JetStream delivery, from its reply subject
    (`$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>`, or
    the longer form with a domain and account hash): what nats-py's `metadata` gives, without
    building it."""
    tokens = reply.split(".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[8])
    if len(tokens) >= 12:
        return int(tokens[Msg.Ack.StreamSeq]), int(tokens[Msg.Ack.NumPending])
    raise ValueError(f"not a JetStream delivery: reply subject {reply!r}")


def _operation(headers: dict[str, str] | None) -> str | None:
    """A delivery's KV operation: PUT, DEL or PURGE (a server's expiry marker as the delete it
    stands for), or None for a marker reason this client does not know (as nats-py skips it)."""
    if not headers:
        return KV_PUT
    if KV_OP in headers:
        return headers[KV_OP]
    reason = headers.get(KV_MARKER_REASON)
    if reason is None:
        return KV_PUT
    return {"MaxAge": KV_PURGE, "Purge": KV_PURGE, "Remove": KV_DEL}.get(reason)


async def empty(kv: KeyValue) -> bool:
    """Whether the bucket's stream holds no message at all (no value, no delete marker)."""
    info = await kv._js.stream_info(kv._stream)
    return not info.state.messages


async def keys(kv: KeyValue) -> list[str]:
    """Every key of the bucket with a value. nats-py's `keys()` may find none in a bucket that
    has some: it asks the server how many are pending after they were sent but before its
    watcher counted them. So "none" is believed only from a bucket whose stream holds no
    message; otherwise asked again (a bucket of delete markers alone is empty after the last
    try)."""
    for _ in range(5):
        try:
            return await kv.keys()
        except NoKeysError:
            if await empty(kv):
                return []
    return []


PURGE_WATCH_IDLE = 5.0


async def purge_deletes(kv: KeyValue, older_than: float) -> int:
    """Drop the bucket's delete markers (each key deleted or purged leaves one), keeping those
    written less than `older_than` seconds ago (a watcher that missed the deletion still sees
    it); returns how many were found. nats-py's `KeyValue.purge_deletes` does the same but never
    stops its watcher: each call left a subscription and a consumer fed every later write of
    the bucket, for good (an hourly call on four buckets: a supervisor out of memory in days).
    Only the entries' headers come here (meta_only), not every record's value."""
    # Its consumer goes from the server once nobody has listened for PURGE_WATCH_IDLE seconds.
    watcher = await kv.watchall(meta_only=True, inactive_threshold=PURGE_WATCH_IDLE)
    markers = []
    try:  # nats-py leaves KeyWatcher's methods unannotated
        while True:
            try:
                entry = await watcher.updates(timeout=10)  # type: ignore[no-untyped-call]
            except TimeoutError:  # what was last when it began went meanwhile (another purge)
                break
            if entry is None:
                # nats-py's "no more for now" may come before the entries (the race `keys` works
                # around): believed from a bucket that holds nothing only.
                if await empty(kv):
                    break
                continue
            if entry.operation in (KV_DEL, KV_PURGE):
                markers.append(entry)
            if not entry.delta:  # the last one there was when the watch began
                break
    finally:
        await watcher.stop()  # type: ignore[no-untyped-call]
    at = datetime.now(UTC)
    for entry in markers:
        keep = 1 if entry.created is not None and (at - entry.created).total_seconds() < older_than else 0
        await kv._js.purge_stream(kv._stream, subject=f"{kv._pre}{entry.key}", keep=keep)
    return len(markers)


T = TypeVar("T")


class GroupCommit(Generic[T]):
    """Items for one record (by key) that arrive while it is being written wait, and go into its
    next write together: `await add(key, item)` returns once `write(key, items)` has written a
    batch holding `item` (or raises what that write raised). Items of a key are written in the
    order they were added, one batch at a time; other keys' meanwhile. A record of size N
    updated once per item costs O(N) per item, O(N²) for N items arriving together (a gang's
    endpoints or task events); in batches, it costs O(N) per batch.

    Batches alone do not bound the writes of items that trickle in (each may find the record
    idle and be written alone): `spacing(key, waiting, last)`, if given, is the least time in
    seconds between the starts of two writes of a key while `waiting` items wait for the next and
    the last write took `last`, so that the items of that time share one write. Sized to the
    record (seconds per byte, as it were), it bounds the bytes written per second whatever the
    record's size or the items' pace; 0 once enough wait (a burst is written as soon as a write
    can take it), or after a big batch (a burst's tail is not held back: at most one write more
    per big batch).

    `linger`, with `spacing`: a record whose spacing for one item is at least `linger` (a big one,
    costly to write) is written once its items have stopped coming for `linger` seconds, at
    most its spacing after the batch's first: a burst arriving over a while (a big gang's N
    running reports, taken in as fast as the bus hands them over) goes into one write, not a
    first one of the few that came first and a second of the rest after it."""

    KEPT = 4096  # keys whose last write time is kept (for `spacing`), the newest

    def __init__(
        self,
        write: Callable[[str, list[T]], Awaitable[None]],
        spacing: Callable[[str, int, int], float] | None = None,
        linger: float = 0.0,
    ) -> None:
        self.write, self.spacing, self.linger = write, spacing, linger
        self._pending: dict[str, tuple[list[T], asyncio.Future[None]]] = {}
        self._writers: dict[str, asyncio.Task[None]] = {}
        self._last: dict[str, tuple[float, int]] = {}  # key -> its last write: loop time, items
        self._spaced: dict[str, asyncio.Event] = {}  # keys whose writer waits out a spacing
        self._came: dict[str, tuple[float, float]] = {}  # pending key -> its batch's first item, last

    async def add(self, key: str, item: T) -> None:
        batch = self._pending.get(key)
        loop = asyncio.get_running_loop()
        at = loop.time()
        if batch is None:
            batch = self._pending[key] = ([], loop.create_future())
            self._came[key] = (at, at)
            if key not in self._writers:
                self._writers[key] = asyncio.create_task(self._drain(key))
        else:
            self._came[key] = (self._came[key][0], at)
        batch[0].append(item)
        spaced = self._spaced.get(key)
        if spaced is not None and self.spacing is not None and self._spacing(key, len(batch[0])) <= 0:
            spaced.set()  # enough wait now: no need to wait the spacing out
        await asyncio.shield(batch[1])

    def _spacing(self, key: str, waiting: int) -> float:
        assert self.spacing is not None
        return self.spacing(key, waiting, self._last.get(key, (0.0, 0))[1])

    async def _linger(self, key: str) -> None:
        """Wait while the key's items still come (see the class's doc); at once for a record
        cheap to write, or without `linger`."""
        if self.linger <= 0 or self.spacing is None:
            return
        bound = self.spacing(key, 1, 0)
        if bound < self.linger:
            return
        loop = asyncio.get_running_loop()
        while True:
            first, last = self._came[key]
            now = loop.time()
            quiet = self.linger - (now - last)
            if quiet <= 0 or now - first >= bound:
                return
            await asyncio.sleep(min(quiet, first + bound - now))

    async def _drain(self, key: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            while key in self._pending:
                last = self._last.get(key)
                if self.spacing is not None and last is not None:
                    wait = self._spacing(key, len(self._pending[key][0])) - (loop.time() - last[0])
                    if wait > 0:  # what comes meanwhile joins this batch
                        spaced = self._spaced[key] = asyncio.Event()
                        try:
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(spaced.wait(), wait)
                        finally:
                            del self._spaced[key]
                await self._linger(key)
                items, done = self._pending.pop(key)
                self._came.pop(key, None)
                if self.spacing is not None:
                    self._last.pop(key, None)
                    self._last[key] = (loop.time(), len(items))
                    while len(self._last) > self.KEPT:
                        del self._last[next(iter(self._last))]
                try:
                    await self.write(key, items)
                    done.set_result(None)
                except Exception as exc:
                    done.set_exception(exc)
                    done.exception()  # retrieved: each waiter raises it on its own
        finally:
            self._writers.pop(key, None)
