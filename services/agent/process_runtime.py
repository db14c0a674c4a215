"""The process runtime: the runtime contract as local subprocesses, for machines with no Docker
engine. The image is ignored (the agent warns), limits are not enforced, mounts are the host
paths themselves; each task runs in its own process group so stopping it stops its children.

Each running task has a record in `state_dir` (pid, labels). A restarted agent cannot adopt a
process (its output pipe and exit status went with the old agent), so it finds the leftovers
through these records and reaps them; the supervisor retries their attempt."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path

import structlog

from services.agent.runtime import FoundTask, LaunchError, OutputSink, TaskLaunch

TASK_ENV = "MUSTER_TASK"  # in every task's environment: how a leftover is recognised

log = structlog.get_logger(service="agent")


class ProcessTask:
    def __init__(
        self, name: str, proc: asyncio.subprocess.Process, reader: asyncio.Task[None], record: Path | None
    ):
        self.name, self.proc, self._reader, self._record = name, proc, reader, record
        self._stopping: asyncio.Task[None] | None = None

    async def wait(self) -> int:
        code = await self.proc.wait()
        await self._reader  # every line delivered before the exit is reported
        if self._record is not None:
            self._record.unlink(missing_ok=True)
        return 128 - code if code < 0 else code

    async def stop(self, grace: float) -> None:
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(grace))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float) -> None:
        if self.proc.returncode is not None:
            return
        self._signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), grace)
        except TimeoutError:
            self._signal(signal.SIGKILL)
            await self.proc.wait()

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)


class ProcessRuntime:
    name = "process"
    can_adopt = False

    def __init__(self, state_dir: str | Path | None = None) -> None:
        self._warned: set[str] = set()
        self.state_dir = Path(state_dir) if state_dir else None
        if self.state_dir:
            self.state_dir.mkdir(parents=True, exist_ok=True)

    async def start(self, launch: TaskLaunch, output: OutputSink) -> ProcessTask:
        if launch.image not in self._warned:
            self._warned.add(launch.image)
            log.warning("process_runtime.image_ignored", image=launch.image, task=launch.name)
        workdir = launch.workdir
        if workdir:
            os.makedirs(workdir, exist_ok=True)
        for m in launch.mounts:
            if not m.read_only:
                os.makedirs(m.host, exist_ok=True)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/"),
            **launch.env,
            TASK_ENV: launch.name,
        }
        try:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh",
                "-c",
                launch.command,
                env=env,
                cwd=workdir,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                limit=1 << 20,
            )
        except OSError as exc:
            raise LaunchError(f"cannot start {launch.name}: {exc.strerror or exc}") from None
        assert proc.stdout is not None
        reader = asyncio.create_task(_pump(proc.stdout, output))
        record = None
        if self.state_dir:
            record = self.state_dir / f"{launch.name}.json"
            record.write_text(json.dumps({"name": launch.name, "pid": proc.pid, "labels": launch.labels}))
        return ProcessTask(launch.name, proc, reader, record)

    async def find(self, labels: dict[str, str]) -> list[FoundTask]:
        found = []
        for path in sorted(self.state_dir.glob("*.json")) if self.state_dir else []:
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
                continue
            if all(rec.get("labels", {}).get(k) == v for k, v in labels.items()):
                alive = _is_task(rec["pid"], rec["name"])
                found.append(FoundTask(name=rec["name"], labels=rec["labels"], running=alive, exit_code=None))
        return found

    async def attach(self, name: str, output: OutputSink | None = None) -> ProcessTask:
        raise LaunchError(f"the process runtime cannot adopt {name}")

    async def reap(self, found: FoundTask) -> None:
        path = self.state_dir / f"{found.name}.json" if self.state_dir else None
        if path is None or not path.exists():
            return
        with contextlib.suppress(OSError, ValueError, KeyError):
            pid = json.loads(path.read_text())["pid"]
            if _is_task(pid, found.name):
                os.killpg(pid, signal.SIGKILL)
        path.unlink(missing_ok=True)

    async def close(self) -> None:
        pass


def _is_task(pid: int, name: str) -> bool:
    """Whether `pid` is still the task `name` (and not a recycled pid)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{TASK_ENV}={name}".encode() in environ.split(b"\0")


async def _pump(stream: asyncio.StreamReader, output: OutputSink) -> None:
    while True:
        try:
            line = await stream.readline()
        except ValueError:  # a line over the limit: deliver what there is
            line = await stream.read(1 << 20)
        if not line:
            return
        output(line.decode("utf-8", "replace").rstrip("\n"))
