"""The process runtime: the runtime contract as local subprocesses, for machines with no Docker
engine. The image is ignored (the agent warns), limits are not enforced, mounts are the host
paths themselves; each task runs in its own process group so stopping it stops its children."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import structlog

from services.agent.runtime import LaunchError, OutputSink, TaskLaunch

log = structlog.get_logger(service="agent")


class ProcessTask:
    def __init__(self, name: str, proc: asyncio.subprocess.Process, reader: asyncio.Task[None]):
        self.name, self.proc, self._reader = name, proc, reader
        self._stopping: asyncio.Task[None] | None = None

    async def wait(self) -> int:
        code = await self.proc.wait()
        await self._reader  # every line delivered before the exit is reported
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

    def __init__(self) -> None:
        self._warned: set[str] = set()

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
        return ProcessTask(launch.name, proc, reader)

    async def close(self) -> None:
        pass


async def _pump(stream: asyncio.StreamReader, output: OutputSink) -> None:
    while True:
        try:
            line = await stream.readline()
        except ValueError:  # a line over the limit: deliver what there is
            line = await stream.read(1 << 20)
        if not line:
            return
        output(line.decode("utf-8", "replace").rstrip("\n"))
