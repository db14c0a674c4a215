"""The bus adapter: connecting to NATS, and the JetStream streams and KV buckets Muster needs.

Every service and the CLI connect through `connect()`; every JetStream resource is declared in
`ensure_jetstream()`, which is idempotent and safe to call from any number of replicas at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext, api
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import (
    BadRequestError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from muster.shared import auth, settings, subjects

DEFAULT_URL = "nats://127.0.0.1:4222"
# The longest subject (or reply subject) sent. The server reads at most 4096 bytes of a control
# line (`PUB <subject> <reply> <size>`), and closes the connection over a longer one; Muster's own
# subjects, built of 64-character tokens, stay under 400.
MAX_SUBJECT = 1024
_SUBJECT = re.compile(r"[^\x00-\x20\x7f]{1," + str(MAX_SUBJECT) + "}")  # no space or control character
LOGS_MAX_BYTES = settings.number("MUSTER_LOGS_MAX_BYTES", 1 << 30, int, low=1)
METRICS_MAX_BYTES = settings.number("MUSTER_METRICS_MAX_BYTES", 256 << 20, int, low=1)
log = structlog.get_logger()
PATIENCE = 60.0  # seconds a service's start waits for the bus to answer it (`patiently`)


def nats_url() -> str:
    """MUSTER_NATS_URL: one URL or a comma-separated list of a cluster's servers."""
    return os.environ.get("MUSTER_NATS_URL") or DEFAULT_URL


def shown(url: str) -> str:
    """A URL (or list) fit for a message: credentials replaced by ***."""
    return ", ".join(re.sub(r"//[^/@]*@", "//***@", s.strip()) for s in url.split(",") if s.strip())


def node_timeout() -> float:
    """Seconds without a heartbeat after which a node is lost (supervisor) and gets no work (scheduler)."""
    return settings.number("MUSTER_NODE_TIMEOUT", 5.0, float, low=0.1)


def replicas() -> int:
    """JetStream replicas for every stream and bucket: 1 on one machine, 3 on a NATS cluster."""
    return settings.number("MUSTER_JS_REPLICAS", 1, int, low=1, high=5)


class Client(NATS):
    """nats-py's client, refusing (with `nats.errors.BadSubjectError`, before anything is sent) a
    subject the server would close the connection over or read as something else: longer than
    MAX_SUBJECT, or holding a space or control character. nats-py sends what it is given, and a
    connection the server closes is closed for good (see `closed`): one subject built from a
    forged id stopped a whole service. Messages are checked where they are decoded
    (`muster.shared.shapes`); this is the net under that.

    `closed_on_purpose`: whether `close()` closed it (else the server did, or nothing has)."""

    closed_on_purpose = False

    async def close(self) -> None:
        if not self.is_closed:
            self.closed_on_purpose = True
        await super().close()

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        if not _SUBJECT.fullmatch(subject) or (reply and not _SUBJECT.fullmatch(reply)):
            raise nats.errors.BadSubjectError
        await super().publish(subject, payload, reply, headers)

    async def subscribe(self, subject: str, *args: Any, **kwargs: Any) -> Any:
        if not _SUBJECT.fullmatch(subject):
            raise nats.errors.BadSubjectError
        return await super().subscribe(subject, *args, **kwargs)


async def connect(
    name: str,
    url: str | None = None,
    *,
    connect_timeout: float | None = None,
    quiet: bool = False,
    credentials: auth.Credentials | None = None,
) -> NATS:
    """Connect to `url`, a comma-separated list of servers (any one will do), retrying the first
    connection for up to `connect_timeout` seconds (default MUSTER_CONNECT_TIMEOUT, 30: services
    wait for NATS to come up), then reconnect forever. Each disconnect and reconnect is logged;
    raises `ConnectionError` naming the URLs tried if never connected.

    `credentials` (default: the file MUSTER_CREDENTIALS names, if set) authenticate as an nkey
    identity, whose replies come to its own inbox prefix; TLS is used when MUSTER_TLS_CA is set
    (see `tls_context`). A server's refusals (permission violations) are logged and kept in
    `refusals(nc)`. A connection the server closes (nats-py does not reconnect after a server
    error other than a stale connection or a permissions violation) is logged as an error and
    `closed(nc)` is set: a service then exits, to be restarted (see `muster.shared.service`)."""
    url = url or nats_url()
    if credentials is None:
        try:
            credentials = auth.from_env()
        except auth.AuthError as exc:
            raise ConnectionError(str(exc)) from None
    servers = [s.strip() for s in url.split(",") if s.strip()]
    if connect_timeout is None:
        connect_timeout = settings.number("MUSTER_CONNECT_TIMEOUT", 30.0, float, low=0.1)
    logger = log.bind(component=name, url=shown(url))

    client: list[Client] = []
    refused: list[str] = []
    gone = asyncio.Event()

    async def disconnected() -> None:
        if not client:
            return  # a first try that failed: said once, when no try succeeds in time
        closing = client[0].is_closed or client[0].is_draining
        if not quiet and not closing:
            logger.warning("nats.disconnected")

    async def reconnected() -> None:
        if not quiet:
            logger.info("nats.reconnected")

    async def closed_for_good() -> None:
        if not client:
            return  # a first try that failed (see below): nothing was handed out
        gone.set()
        if not client[0].closed_on_purpose:
            why = client[0].last_error
            logger.error("nats.closed", error=(str(why) or type(why).__name__) if why else None)

    async def error(exc: Exception) -> None:
        text = str(exc) or type(exc).__name__
        if "permissions violation" in text.lower() or "authorization" in text.lower():
            refused.append(text)
            del refused[:-20]
        if not quiet:
            logger.warning("nats.error", error=text)

    options: dict[str, Any] = dict(
        servers=servers,
        name=name,
        max_reconnect_attempts=1,  # a first try: two turns per server, then it ends (below)
        reconnect_time_wait=0.5,
        connect_timeout=min(2.0, connect_timeout / max(1, len(servers))),  # each server gets a turn
        ping_interval=5,
        max_outstanding_pings=3,
        disconnected_cb=disconnected,
        reconnected_cb=reconnected,
        closed_cb=closed_for_good,
        error_cb=error,
        allow_reconnect=False,  # for the first connection; on once connected (below)
    )
    if credentials is not None:
        options.update(nkeys_seed_str=credentials.seed, inbox_prefix=credentials.inbox)
    tls = tls_context()
    if tls is not None:
        options["tls"] = tls
    try:
        Client()._setup_server_pool(servers)  # a URL nats-py cannot use fails here, not in a try
    except nats.errors.Error as exc:
        why = str(exc).removeprefix("nats: ")
        raise ConnectionError(f"cannot use NATS URL {shown(url)!r}: {why}") from None

    # The first connection: tries that each end by themselves, until `connect_timeout`. nats-py
    # with reconnects on retries a first connection until it is cancelled, and Python 3.11 can
    # lose that cancel (one of nats-py's own waits ending as it comes): a client the servers
    # refused went on retrying for minutes past its bound. A try with reconnects off ends when a
    # server refuses it, and one limited to a few attempts per server when none answers (with
    # unlimited attempts it went round the servers until cancelled).
    loop = asyncio.get_running_loop()
    deadline = loop.time() + connect_timeout
    while True:
        nc = Client()
        try:
            await asyncio.wait_for(nc.connect(**options), max(0.1, deadline - loop.time()))
            break
        except (TimeoutError, OSError, nats.errors.Error):
            with contextlib.suppress(Exception):  # bounded: closing a failed TLS handshake hangs
                await asyncio.wait_for(nc.close(), 1.0)
        left = deadline - loop.time()
        if left <= 0:
            why = f"; refused: {refused[-1]}" if refused else ""
            raise ConnectionError(f"cannot reach NATS at {shown(url)} within {connect_timeout:g}s{why}")
        await asyncio.sleep(min(options["reconnect_time_wait"], left))
    nc.options["allow_reconnect"] = True  # from now on, nats-py reconnects for ever
    nc.options["max_reconnect_attempts"] = -1
    client.append(nc)
    _IDENTITY[nc] = (credentials, refused)
    _CLOSED[nc] = gone
    return nc


_IDENTITY: weakref.WeakKeyDictionary[NATS, tuple[auth.Credentials | None, list[str]]] = (
    weakref.WeakKeyDictionary()
)
_CLOSED: weakref.WeakKeyDictionary[NATS, asyncio.Event] = weakref.WeakKeyDictionary()


def closed(nc: NATS) -> asyncio.Event:
    """Set once `nc` (made by `connect`) is closed for good: by `close()`, or by the server
    (after an error it closes connections over, nats-py never reconnects). A service watches it
    (shared/service.py) and exits when it is set and `lost(nc)`."""
    event = _CLOSED.get(nc)
    if event is None:
        event = _CLOSED[nc] = asyncio.Event()
        if nc.is_closed:
            event.set()
    return event


def lost(nc: NATS) -> bool:
    """Whether `nc` is closed for good without anyone here closing it."""
    return nc.is_closed and not getattr(nc, "closed_on_purpose", False)


def identity(nc: NATS) -> auth.Credentials | None:
    """The credentials `nc` connected with (None: an open bus, no authentication)."""
    return _IDENTITY.get(nc, (None, []))[0]


def refusals(nc: NATS) -> list[str]:
    """The server's latest refusals of what `nc` tried (permission violations), oldest first."""
    return _IDENTITY.get(nc, (None, []))[1]


def tls_context() -> Any:
    """TLS for clients when MUSTER_TLS_CA names the CA that signed the servers' certificates;
    MUSTER_TLS_CERT and MUSTER_TLS_KEY add a client certificate (for servers that verify them)."""
    ca = os.environ.get("MUSTER_TLS_CA")
    if not ca:
        return None
    import ssl

    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    cert, key = os.environ.get("MUSTER_TLS_CERT"), os.environ.get("MUSTER_TLS_KEY")
    if cert:
        context.load_cert_chain(cert, key or None)
    return context


# Every stream and bucket `ensure_jetstream` declares (buckets: history, TTL in seconds or 0).
STREAMS = (
    subjects.SUBMISSIONS_STREAM,
    subjects.EVENTS_STREAM,
    subjects.COMMANDS_STREAM,
    subjects.LOGS_STREAM,
    subjects.METRICS_STREAM,
)


class JetStream(JetStreamContext):
    """nats-py's JetStream context with cheaper publishes and direct gets (and so cheaper KV
    writes and reads, which go through them): each waits for its reply on one wildcard
    subscription of the connection, named by a counter, with one timer, where nats-py's makes
    random token bytes (a getrandom call), a `wait_for` and, for a publish, a dataclass built
    by introspection each time. On this machine, 256 publishes in flight cost ~28 µs of client
    CPU each against ~50, one at a time ~94 µs against ~155. The same results and errors as
    nats-py's: `APIError` and its kinds (in nats-py's KV, a write on a stale revision is
    `KeyWrongLastSequenceError` as before), `NoStreamResponseError` when no stream takes the
    subject, `nats.errors.TimeoutError` when no reply comes in time."""

    def __init__(self, conn: NATS, timeout: float = 5) -> None:
        super().__init__(conn, timeout=timeout)
        self._replies: dict[str, asyncio.Future[Any]] = {}
        self._reply_prefix = ""
        self._count = 0
        self._starting: asyncio.Lock | None = None

    async def _listen(self) -> None:
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if not self._reply_prefix:
                nc = self._nc
                prefix = f"{nc._inbox_prefix.decode()}.{nc._nuid.next().decode()}."
                await nc.subscribe(prefix + "*", cb=self._replied)
                self._reply_prefix = prefix

    async def _replied(self, msg: Any) -> None:
        waiting = self._replies.pop(msg.subject[len(self._reply_prefix) :], None)
        if waiting is not None and not waiting.done():
            waiting.set_result(msg)

    async def _ask(
        self, subject: str, payload: bytes, headers: dict[str, Any] | None, timeout: float | None
    ) -> Any:
        """Publish with a reply subject of our own; the reply (a Msg)."""
        if not self._reply_prefix:
            await self._listen()
        self._count += 1
        token = str(self._count)
        loop = asyncio.get_running_loop()
        waiting: asyncio.Future[Any] = loop.create_future()
        self._replies[token] = waiting
        try:
            await self._nc.publish(subject, payload, reply=self._reply_prefix + token, headers=headers)
            timer = loop.call_later(timeout or self._timeout, _expire, waiting)
            try:
                return await waiting
            finally:
                timer.cancel()
        finally:
            self._replies.pop(token, None)

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,
        stream: str | None = None,
        headers: dict[str, Any] | None = None,
        msg_ttl: float | None = None,
    ) -> api.PubAck:
        if stream is not None or msg_ttl is not None:  # not used by Muster: nats-py's own way
            return await super().publish(subject, payload, timeout, stream, headers, msg_ttl)
        msg = await self._ask(subject, payload, headers, timeout)
        if msg.headers and msg.headers.get(STATUS) == "503":
            raise nats.js.errors.NoStreamResponseError()
        resp = json.loads(msg.data)
        if "error" in resp:
            nats.js.errors.APIError.from_error(resp["error"])  # raises its kind
        return api.PubAck(stream=resp["stream"], seq=resp["seq"], duplicate=resp.get("duplicate"))

    async def get_msg(
        self,
        stream_name: str,
        seq: int | None = None,
        subject: str | None = None,
        direct: bool | None = False,
        next: bool | None = False,
    ) -> api.RawStreamMsg:
        if not (direct and subject and seq is None and not next):  # else nats-py's own way
            return await super().get_msg(stream_name, seq, subject, direct, next)
        msg = await self._ask(f"{self._prefix}.DIRECT.GET.{stream_name}.{subject}", b"", None, None)
        return JetStreamContext._lift_msg_to_raw_msg(msg)


def _expire(waiting: asyncio.Future[Any]) -> None:
    if not waiting.done():
        waiting.set_exception(nats.errors.TimeoutError())


def jetstream(nc: NATS, timeout: float = 5) -> JetStream:
    return JetStream(nc, timeout=timeout)


async def ensure_jetstream(nc: NATS) -> tuple[JetStreamContext, dict[str, KeyValue]]:
    """Create (or update) every stream and bucket. Returns the JetStream context and the buckets."""
    js = jetstream(nc)
    r = replicas()
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.SUBMISSIONS_STREAM,
            subjects=[subjects.SUBMIT, subjects.KILL],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            max_msg_size=-1,
            duplicate_window=120,
            num_replicas=r,
            allow_direct=True,
            description="User requests: job submissions (validator) and kill requests (supervisor)",
        ),
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.EVENTS_STREAM,
            subjects=[subjects.EVENTS_PREFIX + ".>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=30 * 24 * 3600,
            duplicate_window=120,
            num_replicas=r,
            allow_direct=True,
            description="Audit trail: submission verdicts and every job's history",
        ),
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.COMMANDS_STREAM,
            subjects=[subjects.NODE_COMMANDS_PREFIX + ".>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=120,
            num_replicas=r,
            description="Orders for node agents (assign, kill), one durable consumer per node",
        ),
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.LOGS_STREAM,
            subjects=[subjects.LOGS_PREFIX + ".>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=7 * 24 * 3600,
            max_bytes=LOGS_MAX_BYTES,
            num_replicas=r,
            allow_direct=True,
            description="Task output, one subject per task: outlives containers and retries",
        ),
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.METRICS_STREAM,
            subjects=[subjects.METRICS_PREFIX + ".>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=7 * 24 * 3600,
            max_bytes=METRICS_MAX_BYTES,
            max_msg_size=1 << 20,
            num_replicas=r,
            allow_direct=True,
            description="Training metrics tasks printed, batched, one subject per task",
        ),
    )
    buckets = {}
    for bucket, (history, ttl) in subjects.BUCKETS.items():
        buckets[bucket] = await _ensure_bucket(js, bucket, history, r, ttl)
    return js, buckets


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config)
    except BadRequestError as exc:
        if exc.err_code != 10058:
            raise
        # It exists with another config (an older Muster, or made with other settings): bring
        # its subjects and limits up to date, but never change how many replicas it has, so a
        # client without MUSTER_JS_REPLICAS cannot shrink a cluster's streams.
        assert config.name is not None
        current = await js.stream_info(config.name)
        config.num_replicas = current.config.num_replicas
        await js.update_stream(config)


async def _ensure_bucket(js: JetStreamContext, bucket: str, history: int, r: int, ttl: float) -> KeyValue:
    """The bucket, created if missing. Reads go by direct get (`$JS.API.DIRECT.GET.<stream>.<key>`
    names the key in the subject, so permissions can allow one key: an agent its own node's
    record); a bucket made by an older Muster is switched to it."""
    try:
        kv = await js.key_value(bucket)
    except Exception:
        kv = None
    if kv is not None:
        if not kv._direct:
            info = await js.stream_info(f"KV_{bucket}")
            info.config.allow_direct = True
            await js.update_stream(info.config)
            kv = await js.key_value(bucket)
        return kv
    try:
        return await js.create_key_value(
            KeyValueConfig(
                bucket=bucket,
                history=history,
                replicas=r,
                storage=StorageType.FILE,
                ttl=ttl or None,
                direct=True,
            )
        )
    except BadRequestError:
        return await js.key_value(bucket)  # another replica created it first


async def setup(nc: NATS, wait: float | None = None) -> tuple[JetStreamContext, dict[str, KeyValue]]:
    """A service's streams and buckets: declared (`ensure_jetstream`) on an open bus or by an
    admin; otherwise looked up, waiting up to MUSTER_SETUP_WAIT (300 s) for an admin to declare
    them (`muster up` and `muster admin init` do): no service identity may reshape them."""
    ident = identity(nc)
    if ident is None or ident.role == "admin":
        return await ensure_jetstream(nc)
    if wait is None:
        wait = settings.seconds("MUSTER_SETUP_WAIT", 300.0)
    return await open_jetstream(nc, wait=wait)


class NotSetUp(LookupError):
    """Muster's streams or buckets are not on this NATS: no service has declared them yet."""


async def open_jetstream(nc: NATS, wait: float = 0.0) -> tuple[JetStreamContext, dict[str, KeyValue]]:
    """The client side of `ensure_jetstream`: look every stream and bucket up, never create or
    change one (a client's environment must not reshape a cluster's settings). Waits up to
    `wait` seconds for services that are starting; then raises `NotSetUp` naming what is missing."""
    js = jetstream(nc)
    u = nc.connected_url
    server = f"{u.scheme}://{u.hostname}:{u.port}" if u else "NATS"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while True:
        what = ""
        try:
            for name in STREAMS:
                what = f"stream {name}"
                await js.stream_info(name)
            found = {}
            for name in subjects.BUCKETS:
                what = f"bucket {name}"
                found[name] = await js.key_value(name)
            return js, found
        except NotFoundError:
            missing = f"{what} is missing; start the services (`muster up`) or run `muster admin init`"
        except ServiceUnavailableError:
            missing = "JetStream is not enabled (start nats-server with -js)"
        if loop.time() >= deadline:
            raise NotSetUp(f"Muster is not set up on {server}: {missing}")
        await asyncio.sleep(0.25)


def header(msg: Any, name: str) -> str | None:
    return (msg.headers or {}).get(name)


async def publish_once(
    js: JetStreamContext,
    subject: str,
    data: bytes,
    msg_id: str,
    headers: dict[str, str] | None = None,
) -> api.PubAck:
    """Publish to a stream at most once per `msg_id` within the stream's duplicate window: a
    retried or replayed publish of the same fact (a restarted service, a second replica) is
    dropped by the server. Every de-duplicated publish in Muster goes through here; `headers`
    are sent with it (the id is added to them)."""
    return await js.publish(subject, data, headers={**(headers or {}), subjects.Headers.MSG_ID: msg_id})


async def durable(
    js: JetStreamContext, subject: str, name: str, stream: str, **settings: Any
) -> JetStreamContext.PullSubscription:
    """The durable pull consumer `name`, shared by every replica that uses it: explicit acks,
    redelivery after 30 s without one, never given up on. `settings` add to that. A consumer
    made before with another `max_ack_pending` (the server's default is 1,000) takes the one
    asked for now: nats-py leaves an existing consumer as it is."""
    config = ConsumerConfig(
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=30,
        max_deliver=-1,
        **settings,
    )
    sub = await js.pull_subscribe(subject, durable=name, stream=stream, config=config)
    wanted = settings.get("max_ack_pending")
    if wanted is not None:
        have = (await js.consumer_info(stream, name)).config
        if have.max_ack_pending != wanted:
            await js.add_consumer(stream, config=dataclasses.replace(have, max_ack_pending=wanted))
    return sub


async def patiently(make: Callable[[], Awaitable[Any]], wait: float = PATIENCE) -> Any:
    """`make()` (a service's consumer, made as it starts), tried again every second for up to
    `wait` seconds while the bus does not answer it (a server restarting, a cluster electing its
    leaders, JetStream not yet up after a restart): a timeout there ended the service, which
    then judged, recorded or placed nothing until it was started again."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while True:
        try:
            return await make()
        except (TimeoutError, nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError) as exc:
            if loop.time() >= deadline:
                raise
            log.warning("consumer.create_retry", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(1.0)


def renewing(nc: NATS, make: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
    """A consumer's `renew` for `consume`: a fetch that keeps failing while connected means the
    consumer (or its stream) is gone, the bus lost its state; JetStream is looked up (set up, on
    an open bus) again, then the consumer made again by `make`. Until an admin has declared the
    streams again (`muster admin init`), the renewal fails and is tried again."""

    async def renew() -> Any:
        await setup(nc, wait=0)
        return await make()

    return renew


PULL_EXPIRES = 5.0  # seconds an open pull request lives on the server before it is renewed
STATUS = "Status"  # a JetStream status message's header


class Puller:
    """Messages of a pull consumer as they come, with one pull request of `batch` kept open on
    the server: each message is handed out as soon as it arrives, and a new request goes out only
    once the last one is used up or expired. Under load that is one request per `batch`
    messages (nats-py's `fetch` costs one to three requests, a status reply and a task per
    message); idle, one per PULL_EXPIRES. nats-py (2.16) has no such streaming pull, so this
    drives its pull subscription's request subject and inbox as its own `fetch` does."""

    def __init__(self, sub: Any, batch: int, expires: float = PULL_EXPIRES):
        self.sub, self.batch, self.expires = sub, batch, expires
        self.queue: asyncio.Queue[Any] = sub._sub._pending_queue
        self.left = 0  # messages the open request may still deliver
        self.renew_at = 0.0  # (loop time) when to stop waiting for its end and ask again
        self.reconnects = -1  # the connection's count when it was asked: a reconnect loses it

    async def _ask(self) -> None:
        ask = {"batch": self.batch, "expires": int(self.expires * 1e9)}
        await self.sub._nc.publish(self.sub._nms, json.dumps(ask).encode(), self.sub._deliver)
        self.left = self.batch
        self.renew_at = asyncio.get_running_loop().time() + self.expires + 1.0
        self.reconnects = self.sub._nc.stats["reconnects"]

    def _take(self, msg: Any, into: list[Any]) -> None:
        self.queue.task_done()
        self.sub._sub._pending_size -= len(msg.data)
        status = msg.headers.get(STATUS) if msg.headers else None
        if not status:
            self.left -= 1
            into.append(msg)
        elif status in ("404", "408"):  # no messages / the request expired: ask again
            self.left = 0
        elif status != "100":  # 100: an idle heartbeat. Else the server gave up on the request
            self.left = 0  # (409: consumer deleted, leader change...; 503: no JetStream)
            raise nats.js.errors.APIError.from_msg(msg)

    def _lost(self) -> bool:
        """The connection was made again since the request went out: the server dropped it."""
        return bool(self.sub._nc.stats["reconnects"] != self.reconnects)

    async def close(self) -> None:
        """Give the open request up: unsubscribe its inbox (the server drops a pull request
        nobody listens to, so no later message is held for a reader that is gone until its ack
        wait runs out) and hand back what arrived but was not taken (nak: redelivered at once)."""
        left: list[Any] = []
        with contextlib.suppress(Exception):
            await self.sub.unsubscribe()
        while not self.queue.empty():
            with contextlib.suppress(Exception):
                self._take(self.queue.get_nowait(), left)
        for msg in left:
            with contextlib.suppress(Exception):
                await msg.nak()

    async def next(self, wait: float = 1.0) -> list[Any]:
        """What has arrived (at least one message, at most what the queue holds), waiting up to
        `wait` for the first; TimeoutError when none came. Raises the server's refusal (409)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + wait
        got: list[Any] = []
        while True:
            if self.left <= 0 or loop.time() >= self.renew_at or self._lost():
                await self._ask()
            while not got and self.queue.empty():
                timeout = min(end, self.renew_at) - loop.time()
                if timeout <= 0:
                    if loop.time() >= end:
                        raise TimeoutError
                    break  # the request should have ended by now: ask again
                try:
                    msg = await asyncio.wait_for(self.queue.get(), timeout)
                except TimeoutError:
                    continue
                self._take(msg, got)
                if self.left <= 0:
                    break
            while not self.queue.empty():
                self._take(self.queue.get_nowait(), got)
            if got:
                return got
            if loop.time() >= end:
                raise TimeoutError


async def consume(
    sub: Any,
    handle: Callable[[Any], Awaitable[None]],
    stop: asyncio.Event,
    logger: Any,
    batch: int = 64,
    parallel: int = 1,
    renew: Callable[[], Awaitable[Any]] | None = None,
) -> None:
    """The one loop that reads a pull consumer (`consume.serve` adds typed handling to it): pull
    from `sub` and handle each message until `stop`, up to `parallel` at a time (their round
    trips overlap; handlers in flight are waited for before returning). A fetch that fails
    (disconnected, server restarting) is logged once per outage and retried; nats-py resumes the
    subscription after a reconnect. `renew`, where given, makes a fresh subscription when
    fetches keep failing while connected (every 4th failure): the consumer or its stream is
    gone, the bus lost its state."""
    if parallel > 1:
        slots = asyncio.Semaphore(parallel)
        running: set[asyncio.Task[None]] = set()

        async def one(msg: Any) -> None:
            try:
                await handle(msg)
            except Exception:  # a handler that failed to ack or nak must not end the loop
                logger.error("consumer.handler_failed", subject=msg.subject, exc_info=True)
            finally:
                slots.release()

        async def take(msg: Any) -> None:
            await slots.acquire()
            task = asyncio.create_task(one(msg))
            running.add(task)
            task.add_done_callback(running.discard)

        try:
            await consume(sub, take, stop, logger, batch, renew=renew)
        finally:
            if running:
                await asyncio.wait(list(running))
        return
    puller = Puller(sub, batch)
    try:
        failures = 0
        while not stop.is_set():
            try:
                msgs = await puller.next()
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            except Exception as exc:
                failures += 1
                if failures == 1:
                    logger.warning("consumer.fetch_failed", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(0.5)
                if renew is not None and failures % 4 == 0 and puller.sub._nc.is_connected:
                    with contextlib.suppress(Exception):  # not set up again yet: tried again
                        fresh = Puller(await renew(), batch)
                        await puller.close()
                        puller = fresh
                        logger.warning("consumer.renewed", after_failures=failures)
                continue
            if failures:
                logger.info("consumer.fetch_restored")
            failures = 0
            for msg in msgs:
                try:
                    await handle(msg)
                except Exception:  # a handler that failed to ack or nak must not end the loop
                    logger.error("consumer.handler_failed", subject=msg.subject, exc_info=True)
    finally:
        await puller.close()
