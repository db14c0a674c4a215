"""Attempt work directories on a node, and how long they are kept (docs/deploy.md, "What a node
keeps").

Under the agent's work root (0700: the agent's alone):

    <job id>/<attempt>/               the attempt's directory, mounted into its tasks here: the
                                      MPI hostfile and muster-rsh (and its socket), codeSync's
                                      checkout (`code/`) and its mark
    <job id>/<attempt>/<role>-<index>/  a task's directory: its working directory (without
                                      codeSync) and its env file
    <job id>/<attempt>/output/<role>-<index>.log   a task's whole output (output.py)
    <job id>/<attempt>.ended          when the attempt's last task here ended (not a place its
                                      tasks can write: the job's directory is not mounted)
    <job id>/git/                     codeSync's fetch, shared by the job's attempts here
    .trash/                           what is being removed

A directory is in use while a task of its attempt (of its job, for the job's) is live on this
agent: taken on, being started, running, adopted after a restart, an MPI daemon beside it. When
the last task of an attempt here has ended (reported, its output read to the end), the attempt
is marked ended and its directory removed RETENTION seconds later (MUSTER_WORKDIR_RETENTION;
0: at once); its job's directory goes with its last attempt's. A sweep when the agent starts
(after it has adopted what it can) and every SWEEP_EVERY seconds finds what a crashed agent
left: an attempt directory neither in use nor marked is marked then, so it is kept RETENTION
seconds from when it was found; one marked longer ago is removed, as is a job directory with no
attempt left. Nothing in use is ever removed: a directory is moved into .trash (one rename, after
checking, on the event loop, that nothing uses it) and deleted from there in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import structlog
from prometheus_client import Counter

log = structlog.get_logger(service="agent")

# Seconds an ended attempt's directory is kept for a look (its whole output, code, env file):
# an hour after the failure is reported is time to look, and a node ending a job a minute keeps
# about 60 of them, where it kept every one before.
RETENTION = float(os.environ.get("MUSTER_WORKDIR_RETENTION", "") or "3600")
SWEEP_EVERY = float(os.environ.get("MUSTER_WORKDIR_SWEEP", "") or "600")  # the sweep for leftovers
CODE = "git"  # codeSync's fetch, in the job's directory
TRASH = ".trash"
ENDED = ".ended"  # <attempt>.ended, in the job's directory
ORDERS = "assignments"  # the orders taken (services/agent/reconcile.py, `Assignments`)
AGENT_FILES = {"outbox", ORDERS, "tasks"}  # the agent's own directories at the work root
_ATTEMPT = re.compile(r"[0-9]{1,9}")
FUTURE_SLACK = 60.0  # seconds a mark may lie ahead of the clock before it is not believed

REMOVED = Counter("muster_agent_workdirs_removed_total", "Attempt work directories removed", ["node"])
REMOVE_ERRORS = Counter(
    "muster_agent_workdir_remove_errors_total", "Work directories that could not be removed (yet)", ["node"]
)

Key = tuple[str, int]  # (job id, attempt)


def attempt_dir(work_root: str | Path, job_id: str, attempt: int) -> Path:
    return Path(work_root) / job_id / str(attempt)


def task_dir(work_root: str | Path, job_id: str, attempt: int, role: str, index: int) -> Path:
    return attempt_dir(work_root, job_id, attempt) / f"{role}-{index}"


def job_code(work_root: str | Path, job_id: str) -> Path:
    """codeSync's fetch of a job on this node, shared by its attempts here."""
    return Path(work_root) / job_id / CODE


class Workdirs:
    """The attempt directories of one agent's work root (module docstring). `in_use()`: the
    (job id, attempt) of every task live on the agent now."""

    def __init__(
        self,
        work_root: str | Path,
        in_use: Callable[[], set[Key]],
        node: str = "",
        retention: float | None = None,
        sweep_every: float | None = None,
    ) -> None:
        self.root = Path(work_root)
        self.in_use = in_use
        self.node = node
        self.retention = RETENTION if retention is None else max(0.0, retention)
        self.sweep_every = SWEEP_EVERY if sweep_every is None else sweep_every
        self._due: dict[Key, asyncio.TimerHandle] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._deleting: set[asyncio.Task[None]] = set()
        self.removed = 0

    def start(self) -> None:
        """Sweep now (after the agent has adopted what it can) and every `sweep_every` seconds."""
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._sweeper
            self._sweeper = None
        for handle in self._due.values():
            handle.cancel()
        self._due.clear()
        if self._deleting:
            await asyncio.wait(list(self._deleting), timeout=5)

    # ------------------------------------------------------------ an attempt ends here

    def ended(self, job_id: str, attempt: int) -> None:
        """The attempt's last task here has ended: keep its directory `retention` seconds more
        (noted on disk, for an agent that starts meanwhile), then remove it."""
        if not attempt_dir(self.root, job_id, attempt).is_dir():
            return
        now = time.time()
        with contextlib.suppress(OSError):
            _write_mark(self._mark(job_id, attempt), now)
        self._expire_at((job_id, attempt), now)

    def _mark(self, job_id: str, attempt: int) -> Path:
        return self.root / job_id / f"{attempt}{ENDED}"

    def _expire_at(self, key: Key, marked: float) -> None:
        old = self._due.pop(key, None)
        if old is not None:
            old.cancel()
        delay = max(0.0, marked + self.retention - time.time())
        if delay == 0:
            self._remove(key)
            return
        loop = asyncio.get_running_loop()
        self._due[key] = loop.call_later(delay, self._expired, key, marked)

    def _expired(self, key: Key, marked: float) -> None:
        self._due.pop(key, None)
        # Marked again since (a task of the attempt came back here and ended): that mark rules.
        again = _read_mark(self._mark(*key))
        if again is not None and again > marked:
            self._expire_at(key, again)
            return
        self._remove(key)

    def _remove(self, key: Key) -> None:
        """Move the attempt's directory (and its job's, when it was the last) into the trash,
        unless a task of it (of the job) is live here; delete it from there in a thread. On
        the event loop, so nothing is taken on between the check and the move."""
        job_id, attempt = key
        live = self.in_use()
        if key in live:
            return  # it ends again later, and is marked then
        job = self.root / job_id
        path = job / str(attempt)
        moved = [self._to_trash(path)]
        self._mark(job_id, attempt).unlink(missing_ok=True)
        if not any(j == job_id for j, _ in live) and not _attempts_in(job):
            moved.append(self._to_trash(job))
        gone = [p for p in moved if p is not None]
        if moved[0] is not None:
            self.removed += 1
            REMOVED.labels(self.node).inc()
        if gone:
            self._delete(gone)

    def _to_trash(self, path: Path) -> Path | None:
        trash = self.root / TRASH
        try:
            trash.mkdir(mode=0o700, exist_ok=True)
            target = trash / f"{path.parent.name}-{path.name}-{uuid.uuid4().hex[:8]}"
            os.rename(path, target)
            return target
        except FileNotFoundError:
            return None
        except OSError as exc:
            REMOVE_ERRORS.labels(self.node).inc()
            log.warning("agent.workdir_not_removed", path=str(path), error=str(exc))
            return None

    def _delete(self, paths: list[Path]) -> None:
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(_rmtrees, paths, self.node))
        self._deleting.add(task)
        task.add_done_callback(self._deleting.discard)

    # ------------------------------------------------------------ what an earlier agent left

    async def _sweep_forever(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception as exc:  # a sweep that fails is tried again: never fatal
                log.warning("agent.workdir_sweep_failed", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(self.sweep_every)

    async def sweep(self) -> int:
        """Empty the trash; mark what nothing uses and no mark covers; remove what was marked
        longer than `retention` ago and job directories with no attempt left. Returns how many
        attempt directories it removed."""
        found = await asyncio.to_thread(_scan, self.root)
        live = self.in_use()
        jobs_live = {job for job, _ in live}
        now = time.time()
        before = self.removed
        for job_id, attempts in found.items():
            if not attempts:  # still none (the scan ran in a thread) and nothing of the job live
                if job_id not in jobs_live and not _attempts_in(self.root / job_id):
                    path = self._to_trash(self.root / job_id)
                    if path is not None:
                        self._delete([path])
                continue
            for attempt, marked in attempts.items():
                key = (job_id, attempt)
                if key in live or key in self._due:
                    continue
                if marked is None or marked > now + FUTURE_SLACK:
                    marked = now  # left by a crashed agent (or a mark not to believe): from now
                    with contextlib.suppress(OSError):
                        _write_mark(self._mark(job_id, attempt), marked)
                self._expire_at(key, marked)
        trash = await asyncio.to_thread(_listdir, self.root / TRASH)
        if trash:
            self._delete(trash)
        await asyncio.to_thread(_forget_orders, self.root / ORDERS, live, now - self.retention)
        return self.removed - before


def _forget_orders(orders: Path, live: set[tuple[str, int]], before: float) -> None:
    """Remove the kept orders of attempts with no task live here, last written before `before`:
    only startup pruned them, so a node kept one per attempt it ever ran (its config, secret
    values included) for as long as its agent ran."""
    for path in _listdir(orders):
        stem, suffix = os.path.splitext(path.name)  # <job>.<attempt>.json, or .tmp half-written
        job_id, _, attempt = stem.rpartition(".")
        if suffix not in (".json", ".tmp") or not attempt.isdigit() or (job_id, int(attempt)) in live:
            continue
        with contextlib.suppress(OSError):
            if path.stat().st_mtime < before:
                path.unlink()


def _write_mark(path: Path, at: float) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(f"{at:.3f}\n")
    os.replace(tmp, path)


def _read_mark(path: Path) -> float | None:
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None


def _attempts_in(job: Path) -> bool:
    try:
        with os.scandir(job) as entries:
            return any(_ATTEMPT.fullmatch(e.name) and e.is_dir(follow_symlinks=False) for e in entries)
    except OSError:
        return False


def _scan(root: Path) -> dict[str, dict[int, float | None]]:
    """Job directory -> its attempt directories -> when each was marked ended (None: not)."""
    out: dict[str, dict[int, float | None]] = {}
    try:
        jobs = list(os.scandir(root))
    except OSError:
        return out
    for job in jobs:
        if job.name.startswith(".") or job.name in AGENT_FILES or not job.is_dir(follow_symlinks=False):
            continue
        attempts: dict[int, float | None] = {}
        try:
            entries = list(os.scandir(job.path))
        except OSError:
            continue
        names = {e.name for e in entries}
        for e in entries:
            if _ATTEMPT.fullmatch(e.name) and e.is_dir(follow_symlinks=False):
                mark = f"{e.name}{ENDED}"
                attempts[int(e.name)] = _read_mark(Path(job.path, mark)) if mark in names else None
        out[job.name] = attempts
    return out


def _listdir(path: Path) -> list[Path]:
    try:
        return [path / name for name in os.listdir(path)]
    except OSError:
        return []


def _rmtrees(paths: list[Path], node: str) -> None:
    for path in paths:
        failed: list[str] = []

        def note(_: object, where: str, exc: object, failed: list[str] = failed) -> None:
            failed.append(f"{where}: {exc[1] if isinstance(exc, tuple) else exc}")

        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=note)
        else:
            shutil.rmtree(path, onerror=note)
        if failed:
            REMOVE_ERRORS.labels(node).inc()
            log.warning("agent.workdir_not_removed", path=str(path), errors=failed[:3], count=len(failed))
