"""What a task's output costs: every line goes to the task's output file on its node (whole, up
to a generous cap), and to the MUSTER_LOGS stream within limits per task attempt (a rate with a
burst, and a total), many lines to a message. What the limits cut is said in the stream by a
note (`[muster: N lines (M bytes) not shipped: over the limit of ...; the whole output is in
PATH on node NODE]`) and counted; a task printing as fast as it can costs the bus its burst, its
rate and at most its total, never its whole output.

A message holds whole lines joined by "\\n" (a line never holds one): readers split it again.
Lines are gathered while the event loop is busy and sent when it turns (no timer, so a lone
line goes at once), at most BATCH_BYTES to a message; a line longer than LINE_BYTES is cut in
the stream (whole in the file).

Limits come from the agent's environment (sizes in bytes, or with K/M/G/KiB/MiB/GiB; 0: none):
MUSTER_TASK_LOG_RATE (bytes a second, default 64 KiB), MUSTER_TASK_LOG_BURST (default 4 MiB),
MUSTER_TASK_LOG_MAX_BYTES (per task attempt, default 64 MiB), MUSTER_TASK_OUTPUT_MAX_BYTES (the
output file, default 4 GiB)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import structlog
from prometheus_client import Counter

log = structlog.get_logger(service="agent")

NOT_SHIPPED_LINES = Counter(
    "muster_agent_output_lines_not_shipped_total",
    "Task output lines kept on the node but not sent to MUSTER_LOGS, by the limit that cut them",
    ["node", "limit"],
)
NOT_SHIPPED_BYTES = Counter(
    "muster_agent_output_bytes_not_shipped_total",
    "Bytes of task output kept on the node but not sent to MUSTER_LOGS, by the limit that cut them",
    ["node", "limit"],
)
BATCH_BYTES = 64 * 1024  # most bytes of lines in one message
LINE_BYTES = 16 * 1024  # a longer line is cut in the stream
NOTE_EVERY = 5.0  # seconds: at most one note of cut lines so often (and one at the end)
QUEUED_BYTES = 8 * 1024 * 1024  # batches waiting for a bus that does not take them; beyond: cut
FILE_RETRY = 30.0  # seconds after a failed write of the output file before it is opened again
OUTPUT_DIR = "output"  # in the attempt's directory: <role>-<index>.log, the task's whole output

ENV = {
    "rate": "MUSTER_TASK_LOG_RATE",
    "burst": "MUSTER_TASK_LOG_BURST",
    "total": "MUSTER_TASK_LOG_MAX_BYTES",
    "file": "MUSTER_TASK_OUTPUT_MAX_BYTES",
}
UNITS = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "KI": 1024, "MI": 1024**2, "GI": 1024**3}
SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]I?)?B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`65536`, `64KiB`, `64K` (1000s), `4MiB`...: bytes. ValueError for anything else."""
    m = SIZE_RE.match(text)
    if not m:
        raise ValueError(f"expected bytes, e.g. 65536, 64KiB or 4MiB; got {text!r}")
    return int(m[1]) * UNITS[(m[2] or "").upper()]


def shown_size(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size and n % (size // 16) == 0:
            return f"{n / size:g} {unit}"
    return f"{n} bytes"


@dataclass(frozen=True)
class OutputLimits:
    """Per task attempt (0: no limit): `rate` bytes a second to the stream after a `burst`,
    `total` bytes to the stream in all, `file` bytes to the output file."""

    rate: int = 64 * 1024
    burst: int = 4 * 1024 * 1024
    total: int = 64 * 1024 * 1024
    file: int = 4 * 1024**3

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OutputLimits:
        """The limits the agent's environment sets; ValueError naming the variable for a bad one."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for field, name in ENV.items():
            text = env.get(name, "").strip()
            if not text:
                continue
            try:
                values[field] = parse_size(text)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        return cls(**values)

    def said(self, limit: str) -> str:
        if limit == "rate":
            return f"{shown_size(self.rate)}/s (burst {shown_size(self.burst)}) per task"
        if limit == "total":
            return f"{shown_size(self.total)} per task attempt"
        if limit == "line":
            return f"{shown_size(LINE_BYTES)} a line"
        return f"{shown_size(QUEUED_BYTES)} waiting for the bus"


class Budget:
    """Which of one task's lines go to the stream: a token bucket (rate, burst) and a total.
    Pure: the caller gives the time."""

    def __init__(self, limits: OutputLimits, now: float) -> None:
        self.limits = limits
        self.tokens = float(limits.burst)
        self.at = now
        self.shipped = 0

    def take(self, size: int, now: float) -> str | None:
        """None: ship `size` bytes (and count them); else the limit that cuts them."""
        lim = self.limits
        if lim.total and self.shipped + size > lim.total:
            return "total"
        if lim.rate:
            self.tokens = min(float(max(lim.burst, size)), self.tokens + (now - self.at) * lim.rate)
            self.at = now
            if self.tokens < size:
                return "rate"
            self.tokens -= size
        self.shipped += size
        return None


Publish = Callable[[str, bytes], Awaitable[None]]


class Shipper:
    """One task attempt's output: to its file, and within its `Budget` to `subject`."""

    def __init__(
        self,
        publish: Publish,
        subject: str,
        node: str,
        path: Path | None,
        limits: OutputLimits,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.publish, self.subject, self.node, self.path = publish, subject, node, path
        self.limits, self.clock = limits, clock
        self.budget = Budget(limits, clock())
        self.lines: list[bytes] = []  # the batch being gathered
        self.size = 0
        self.sealed: collections.deque[bytes] = collections.deque()
        self.queued = 0
        self.sender: asyncio.Task[None] | None = None
        self.cut: dict[str, list[int]] = {}  # limit -> [lines, bytes] not yet said in a note
        self.total_said = False
        self.note_timer: asyncio.TimerHandle | None = None
        self.file: IO[bytes] | None = None
        self.written = 0
        # A write that failed (a full disk): when, why, and the lines not kept since; the file
        # is opened again FILE_RETRY seconds later (it stayed shut for the task's whole life).
        self.file_error: tuple[float, str] | None = None
        self.file_skipped = 0
        self.closed = False

    @property
    def file_failed(self) -> bool:
        return self.path is None or self.file_error is not None

    # ------------------------------------------------------------ lines in

    def line(self, text: str) -> None:
        if self.closed:
            return
        data = text.encode("utf-8", "replace")
        self._keep(data)
        size = len(data) + 1
        if len(data) > LINE_BYTES:
            self._count("line", 0, len(data) - LINE_BYTES)
            data = data[:LINE_BYTES] + f" [muster: {len(data) - LINE_BYTES} bytes cut]".encode()
            size = len(data) + 1
        limit = self.budget.take(size, self.clock())
        if limit is None and self.queued + size > QUEUED_BYTES:
            limit = "bus"
        if limit is not None:
            self._count(limit, 1, size)
            if limit == "total" and not self.total_said:
                self.total_said = True
                self._queue(self._note("from here on, output is", "total").encode())
            return
        self._queue(data)

    def _keep(self, data: bytes) -> None:
        """The line to the output file (the task's whole output, up to the file's cap). After a
        write that failed, the lines are counted and the file opened again FILE_RETRY seconds
        later, where a line says how many were not kept and why."""
        if self.path is None:
            return
        if self.file_error is not None and self.clock() - self.file_error[0] < FILE_RETRY:
            self.file_skipped += 1
            return
        try:
            if self.file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.file = open(self.path, "ab", buffering=BATCH_BYTES)  # noqa: SIM115 (closed in close)
                self.written = self.file.tell()
            if self.file_error is not None:
                said = f"[muster: {self.file_skipped} lines or more not kept here: {self.file_error[1]}]\n"
                self.file.write(said.encode())
                self.file_error, self.file_skipped = None, 0
            cap = self.limits.file
            if cap and self.written + len(data) + 1 > cap:
                if self.written <= cap:
                    self.file.write(f"[muster: output beyond {shown_size(cap)} is not kept]\n".encode())
                    self.written = cap + 1
                return
            self.file.write(data + b"\n")
            self.written += len(data) + 1
        except OSError as exc:
            if self.file_error is None:
                log.warning("agent.output_file_failed", path=str(self.path), error=str(exc))
            self.file_error = (self.clock(), str(exc))
            self.file_skipped += 1
            if self.file is not None:  # what its buffer held is lost with it
                with contextlib.suppress(OSError):
                    self.file.close()
                self.file = None

    def _count(self, limit: str, lines: int, size: int) -> None:
        """Cut: said in the next note, and counted then (a flood cuts lines by the million)."""
        held = self.cut.setdefault(limit, [0, 0])
        held[0] += lines
        held[1] += size
        if self.note_timer is None and not self.closed:
            with contextlib.suppress(RuntimeError):  # no loop: the note comes at close
                self.note_timer = asyncio.get_running_loop().call_later(NOTE_EVERY, self._notes)

    def _note(self, what: str, limit: str) -> str:
        kept = self.path is not None and not self.file_failed
        where = (
            f"{self.path} on node {self.node}" if kept else f"nowhere (no output file on node {self.node})"
        )
        over = self.limits.said(limit)
        return f"[muster: {what} not shipped: over the limit of {over}; the whole output is in {where}]"

    def _notes(self) -> None:
        self.note_timer = None
        for limit, (lines, size) in sorted(self.cut.items()):
            NOT_SHIPPED_LINES.labels(self.node, limit).inc(lines)
            NOT_SHIPPED_BYTES.labels(self.node, limit).inc(size)
            what = f"{lines} lines ({size} bytes)" if lines else f"{size} bytes of long lines"
            self._queue(self._note(what, limit).encode())
        self.cut.clear()

    # ------------------------------------------------------------ messages out

    def _queue(self, data: bytes) -> None:
        if self.lines and self.size + len(data) + 1 > BATCH_BYTES:
            self._seal()
        self.lines.append(data)
        self.size += len(data) + 1
        if self.sender is None or self.sender.done():
            with contextlib.suppress(RuntimeError):
                self.sender = asyncio.get_running_loop().create_task(self._send())

    def _seal(self) -> None:
        batch = b"\n".join(self.lines)
        self.sealed.append(batch)
        self.queued += len(batch)
        self.lines, self.size = [], 0

    async def _send(self) -> None:
        await asyncio.sleep(0)  # what the loop delivers meanwhile joins the batch
        while self.lines or self.sealed:
            if self.lines:
                self._seal()
            batch = self.sealed.popleft()
            try:
                await self.publish(self.subject, batch)
            except Exception as exc:
                log.warning("agent.output_unsent", subject=self.subject, error=str(exc) or type(exc).__name__)
            finally:
                self.queued -= len(batch)

    def flush(self) -> None:
        """What the file holds so far to disk (the agent stops; the task goes on)."""
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.flush()

    async def close(self) -> None:
        """The task ended: say what was cut, send what is left, close the file."""
        if self.closed:
            return
        if self.note_timer is not None:
            self.note_timer.cancel()
        self._notes()
        self.closed = True
        with contextlib.suppress(Exception):
            if self.sender is not None:
                await self.sender
            if self.lines or self.sealed:
                await self._send()
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None


def output_path(work_root: str, job_id: str, attempt: int, role: str, index: int) -> Path:
    """Where a task's whole output is kept on its node: in its attempt's directory."""
    return Path(work_root) / job_id / str(attempt) / OUTPUT_DIR / f"{role}-{index}.log"
