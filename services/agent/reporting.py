"""Task events out of the agent, never lost: each is written to an outbox on disk, then published
(with a message id, so a second copy is harmless) by one sender in the order they were made, and
removed once JetStream has it. An outcome reached while the bus is away, or just before the
agent dies, is reported when the bus is back, by the agent's fence (muster.services.agent.fence) when
the agent died, or by the next agent."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from pathlib import Path

import structlog
from nats.js import JetStreamContext
from nats.js.errors import BadRequestError

from muster.shared import bus, subjects
from muster.shared.messages import TaskEvent

log = structlog.get_logger(service="agent")
OUTBOX = "outbox"  # under the agent's work root
_seq = itertools.count()


def keep(outbox: Path, event: TaskEvent) -> tuple[Path, bytes]:
    """Write `event` into `outbox`, whole or not at all (a reader never sees half of it): named
    so that entries sort in the order they were made."""
    task = f"{event.job_id}.{event.attempt}.{event.role}.{event.index}"
    path = outbox / f"{time.time_ns():020d}-{next(_seq):06d}-{task}.{event.kind}.json"
    data = event.to_bytes()
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_bytes(data)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk: no half entry left behind
        raise
    return path, data


class Reporter:
    def __init__(self, js: JetStreamContext, outbox: Path):
        self.js, self.outbox = js, outbox
        outbox.mkdir(parents=True, exist_ok=True)
        self.queue: asyncio.Queue[tuple[Path | None, bytes, TaskEvent | None]] = asyncio.Queue()
        self.unsent = 0  # queued, not yet published
        self.idle = asyncio.Event()
        self.idle.set()
        self.sender: asyncio.Task[None] | None = None
        # What is still in the outbox from an earlier run: sent first, in the order it was made.
        for path in sorted(outbox.glob("*.json")):
            self._queue(path, _read(path), None)

    def start(self) -> None:
        if self.sender is None:
            self.sender = asyncio.create_task(self._send_all())

    def report(self, event: TaskEvent) -> None:
        """Keep `event` on disk and queue it for publishing; returns at once. A disk that takes
        nothing (full) is said, and the event goes from memory only: it raised into whatever
        reported it (a task's start or end), which then died unseen and left the task running
        in the agent's books for ever."""
        try:
            path: Path | None
            path, data = keep(self.outbox, event)
        except OSError as exc:
            log.error(
                "agent.outbox_unwritable",
                task=f"{event.job_id}.{event.attempt}.{event.role}.{event.index}",
                kind=str(event.kind),
                error=str(exc) or type(exc).__name__,
            )
            path, data = None, event.to_bytes()
        self._queue(path, data, event)

    def _queue(self, path: Path | None, data: bytes, event: TaskEvent | None) -> None:
        """`event`: the entry decoded, when it was made here (one read back from disk is not)."""
        self.queue.put_nowait((path, data, event))
        self.unsent += 1
        self.idle.clear()

    async def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for everything queued to be published."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.idle.wait(), timeout)
        return not self.unsent

    async def close(self) -> None:
        if self.sender is not None:
            self.sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.sender

    async def _send_all(self) -> None:
        while True:
            path, data, event = await self.queue.get()
            try:
                await self._send(path, data, event)
            finally:
                self.unsent -= 1
                if not self.unsent:
                    self.idle.set()

    async def _send(self, path: Path | None, data: bytes, event: TaskEvent | None) -> None:
        if event is None:
            try:
                event = TaskEvent.from_bytes(data)
            except ValueError as exc:
                log.warning("agent.outbox_bad_entry", path=str(path), error=str(exc)[:200])
                _forget(path)
                return
        subject = subjects.task_event(
            event.job_id, event.attempt, event.role, event.index, event.kind, event.node
        )
        msg_id = f"{event.kind}:{event.job_id}.{event.attempt}.{event.role}.{event.index}"
        delay, failing = 0.2, False
        while True:
            try:
                await bus.publish_once(self.js, subject, data, msg_id)
                break
            except BadRequestError as exc:  # the server refuses it: retrying cannot help
                log.error("agent.report_refused", subject=subject, error=str(exc))
                break
            except Exception as exc:
                if not failing:
                    log.warning("agent.report_waiting", subject=subject, error=str(exc) or type(exc).__name__)
                failing = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        if failing:
            log.info("agent.report_sent", subject=subject)
        _forget(path)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _forget(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
