"""The process runtime: the runtime contract as local subprocesses, for machines with no Docker
engine. The image is ignored (the agent warns), limits are not enforced, mounts are the host
paths themselves; each task runs in its own process group so stopping it stops its children, and
it ends with its main process, as a container does: what that left running in the group is
killed then.

Each task has a record in `state_dir` (name, labels), written before it is spawned; its
processes are found by the `MUSTER_TASK=<name>` variable in their environment, so a task spawned
just before its agent died is found too. A restarted agent cannot adopt a process (its output
pipe went with the old agent), so it finds the leftovers through these records and reaps them.

How a task ended outlives its agent: the task's command runs under a small shell (`WRAPPER`)
that records its exit code in `<name>.exit` beside the record before it exits itself, so before
the agent (or anyone) can see the exit. Whoever stops a task — its agent, its fence, a restarted
agent reaping it — first records "killed" there. The file is created once (O_EXCL): the first to
write it is the truth, so a task that ended by itself is reported with its own exit code however
its agent died, and one that was stopped is never taken for one that ended by itself. The
record and the file are removed only once the outcome is in the agent's outbox. A task holds
the read end of its own output pipe (never reading it), so its agent's death does not end it
with a broken pipe, an end the agent's death caused, before its fence has recorded the kill.

Tasks do not outlive their agent: a small fence process (`muster.services.agent.fence`) holds a pipe
from the agent and, when the agent dies in any way, SIGKILL included, kills every recorded task
that had not ended and reports how each one ended, so a task whose agent is gone never runs
beside its replacement, and one that finished is never run again.

Not hardened, and it cannot be without the isolation a container gives: a task runs as the
agent's own user, with its capabilities, its view of the file system (data roots bound what a
job names as its dirs, not what its command opens), no pids, memory or CPU limit and the
Docker socket if the agent can reach it. Use it only where every submitter may already run
commands as the agent's user (a laptop, a CI runner); give nodes shared by users Docker."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog

from muster.services.agent import fence_handle
from muster.services.agent.runtime import FoundTask, LaunchError, OutputSink, TaskLaunch

TASK_ENV = "MUSTER_TASK"  # in every task's environment: how a leftover is recognised
KILLED = "killed"  # in an exit file: stopped by the platform, not ended by itself
# The shell a task's command runs under: $1 the command, $2 its exit file. It ignores the
# signals a stop or a resize sends the task's process group (with handlers, not SIG_IGN, so the
# command still gets their default actions), waits for the command to end, writes its exit
# code unless the file exists already (noclobber: O_EXCL), and exits with that code.
WRAPPER = (
    "trap : HUP INT QUIT PIPE ALRM TERM USR1 USR2; "
    # Its own messages ("Terminated") go nowhere; the command's stderr is the task's.
    'exec 3>&2 2>/dev/null; (exec /bin/sh -c "$1" 2>&3 3>&-); code=$?; '
    '(set -C; printf "%s\\n" "$code" > "$2"); '
    "exit $code"
)

log = structlog.get_logger(service="agent")
OUTPUT_DRAIN = 10.0  # seconds the output may take to end once the task's main process has exited


class ProcessTask:
    oom_killed = False  # no memory limit is enforced on a process (memoryMB is only counted)
    vanished = False  # its end is recorded in its exit file
    can_exec = True

    def __init__(
        self, name: str, proc: asyncio.subprocess.Process, reader: asyncio.Task[None], record: Path | None
    ) -> None:
        """`record`: the task's record, beside which its exit file is (None: no state dir)."""
        self.name, self.proc, self._reader, self._record = name, proc, reader, record
        self._stopping: asyncio.Task[None] | None = None
        self.env: dict[str, str] = {}  # what it was started with: commands run in it get the same
        self.cwd: str | None = None
        self._execs: set[asyncio.subprocess.Process] = set()

    async def exec(self, command: str, output: Callable[[str], Awaitable[None]]) -> int:
        """Run `command` beside the task, with its environment and directory (an MPI daemon):
        its output to `output`, its exit code returned. Cancelled or the task stopped: killed.
        It carries the task's MUSTER_TASK mark, so a fence that kills the task kills it too.
        Its TMPDIR is a directory of its own (short: sockets are made there), removed after:
        processes share the machine's /tmp and host name, and two MPI daemons of one job making
        their session directories there at once collide (mkdir: File exists)."""
        tmp = tempfile.mkdtemp(prefix="muster-exec-")
        try:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh",
                "-c",
                command,
                env={**self.env, "TMPDIR": tmp},
                cwd=self.cwd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._execs.add(proc)
        assert proc.stdout is not None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            while chunk := await proc.stdout.read(1 << 15):
                await output(decoder.decode(chunk))
            code = await proc.wait()
        except asyncio.CancelledError:
            _kill_group(proc)
            raise
        finally:
            self._execs.discard(proc)
            shutil.rmtree(tmp, ignore_errors=True)
        return 128 - code if code < 0 else code

    async def wait(self) -> int:
        code = await self.proc.wait()
        # The task ends with its main process, as a container ends with its first one: what it
        # left running in its process group (`server &`) is killed. It held the output pipe
        # open, so the task was never reported ended, and a stop found nothing left to stop.
        self._signal(signal.SIGKILL)
        try:  # every line written before the exit is delivered before the exit is reported
            await asyncio.wait_for(asyncio.shield(self._reader), OUTPUT_DRAIN)
        except TimeoutError:  # a process that left the group (setsid) still holds the pipe
            log.warning("process.output_not_drained", task=self.name, seconds=OUTPUT_DRAIN)
            self._reader.cancel()
        return 128 - code if code < 0 else code

    async def remove(self) -> None:
        """Its outcome is reported (in the outbox): forget its exit file, then its record."""
        if self._record is not None:
            exit_file(self._record).unlink(missing_ok=True)
            self._record.unlink(missing_ok=True)

    async def stop(self, grace: float) -> None:
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(grace))
        else:  # stopping already, maybe with a longer grace (a kill's): this one's holds too
            try:
                await asyncio.wait_for(asyncio.shield(self._stopping), grace)
            except TimeoutError:
                self._signal(signal.SIGKILL)
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float) -> None:
        for proc in list(self._execs):  # what ran beside it ends with it
            _kill_group(proc)
        if self.proc.returncode is not None:
            return
        if self._record is not None:  # stopped, not ended by itself, should this agent die now
            try:
                claim(exit_file(self._record), KILLED)
            except OSError as e:  # a full disk: stopped all the same (only a fence reads the claim)
                log.warning("process.kill_not_recorded", task=self.name, error=str(e))
        self._signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), grace)
        except TimeoutError:
            self._signal(signal.SIGKILL)
            await self.proc.wait()

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    async def signal(self, sig: int) -> None:
        if self.proc.returncode is None:
            self._signal(sig)


class ProcessRuntime:
    name = "process"
    can_adopt = False

    def __init__(self, state_dir: str | Path | None = None) -> None:
        self._warned: set[str] = set()
        self.state_dir = Path(state_dir) if state_dir else None
        self._fence: subprocess.Popen[bytes] | None = None
        if self.state_dir:
            self.state_dir.mkdir(parents=True, exist_ok=True)

    def start_fence(self, home: str, pidfile: str, wait: float, bus_url: str = "") -> None:
        """Tasks die with the agent, at once: a process cannot be adopted."""
        if self.state_dir and self._fence is None:
            self._fence = fence_handle.start_fence("process", home, str(self.state_dir), bus_url=bus_url)

    def detach(self) -> None:
        fence_handle.detach(self._fence)

    containers = False  # tasks see host paths: a Mount's container path means nothing here

    async def start(self, launch: TaskLaunch, output: OutputSink) -> ProcessTask:
        if launch.image not in self._warned:
            self._warned.add(launch.image)
            log.warning("process_runtime.image_ignored", image=launch.image, task=launch.name)
        workdir = launch.workdir
        if workdir:
            os.makedirs(workdir, exist_ok=True)
        for m in launch.mounts:
            if not m.read_only and m.kind == "bind":
                os.makedirs(m.host, exist_ok=True)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/"),
            **launch.env,
            TASK_ENV: launch.name,
        }
        record = None
        argv = ["/bin/sh", "-c", launch.command]
        if self.state_dir:  # before the spawn: a task is never running without its record
            record = self.state_dir / f"{launch.name}.json"
            exit_file(record).unlink(missing_ok=True)
            # Which agent started it: a dead agent's fence kills its tasks, never a new agent's.
            record.write_text(
                json.dumps({"name": launch.name, "labels": launch.labels, "agent": os.getpid()})
            )
            argv = ["/bin/sh", "-c", WRAPPER, "muster-task", launch.command, str(exit_file(record))]
        out, into = os.pipe()  # the task's output (stdout and stderr), read here
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                env=env,
                cwd=workdir,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=into,
                stderr=into,
                start_new_session=True,
                # The task holds the read end of its output too, and never reads it: when its
                # agent dies, what it writes does not fail (EPIPE, SIGPIPE) and end it before its
                # fence has recorded it as killed: an end the agent's death caused is never
                # taken for one of its own. (A full pipe blocks it until the fence kills it.)
                pass_fds=(out,),
            )
        except OSError as exc:
            os.close(out)
            if record is not None:
                record.unlink(missing_ok=True)
            raise LaunchError(f"cannot start {launch.name}: {exc.strerror or exc}") from None
        finally:
            os.close(into)
        stream = asyncio.StreamReader(limit=1 << 20)
        await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(stream), os.fdopen(out, "rb", buffering=0)
        )
        reader = asyncio.create_task(_pump(stream, output))
        task = ProcessTask(launch.name, proc, reader, record)
        task.env, task.cwd = env, workdir
        return task

    async def find(self, labels: dict[str, str]) -> list[FoundTask]:
        """Recorded tasks; `exit_code` is the one a task recorded when it ended by itself."""
        if self.state_dir is None:
            return []
        found = []
        for rec in records(self.state_dir):
            if not all(rec["labels"].get(k) == v for k, v in labels.items()):
                continue
            path = exit_file(self.state_dir / f"{rec['name']}.json")
            code = recorded_exit(path)
            found.append(
                FoundTask(
                    name=rec["name"],
                    labels=rec["labels"],
                    running=bool(task_pids(rec["name"])),
                    exit_code=code,
                    ended_at=ended_at(path) if code is not None else None,
                )
            )
        return found

    async def attach(
        self, name: str, output: OutputSink | None = None, since: float | None = None
    ) -> ProcessTask:
        raise LaunchError(f"the process runtime cannot adopt {name}")

    async def reap(self, found: FoundTask) -> int | None:
        if self.state_dir is None:
            kill_task(found.name)
            return None
        record = self.state_dir / f"{found.name}.json"
        code = settle(record)
        exit_file(record).unlink(missing_ok=True)
        record.unlink(missing_ok=True)
        return code

    async def capacity(self) -> tuple[int, int] | None:
        """None: processes take what they use, any declaration can be honoured."""
        return None

    async def close(self) -> None:
        """The agent is stopping cleanly, its tasks stopped: the fence has nothing left to do."""
        fence_handle.close(self._fence)
        self._fence = None


def records(state_dir: Path | None) -> list[dict[str, Any]]:
    """The task records in `state_dir`; unreadable ones are removed."""
    out = []
    for path in sorted(state_dir.glob("*.json")) if state_dir else []:
        try:
            rec = json.loads(path.read_text())
            if isinstance(rec.get("name"), str) and isinstance(rec.get("labels"), dict):
                out.append(rec)
                continue
        except (OSError, ValueError, AttributeError):
            pass
        path.unlink(missing_ok=True)
    return out


def exit_file(record: Path) -> Path:
    """Where the task of `record` (STATE_DIR/<name>.json) records how it ended."""
    return record.with_suffix(".exit")


def claim(path: Path, text: str) -> bool:
    """Write `text` to `path` unless it exists (O_EXCL, as the wrapper's noclobber): whether
    this was the first writer."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{text}\n")
    return True


def recorded_exit(path: Path, patience: float = 0.5) -> int | None:
    """The exit code a task recorded in `path` when it ended by itself; None when it recorded
    none: it still runs, never started, or was stopped (KILLED). A file just created and not
    yet written (its writer is between open and write) is read again for up to `patience`
    seconds."""
    deadline = time.monotonic() + patience
    while True:
        try:
            text = path.read_text().strip()
        except OSError:
            return None
        if text or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    try:
        return int(text)
    except ValueError:
        return None  # KILLED, or a writer that died before it wrote


def ended_at(path: Path) -> float | None:
    """When the task of exit file `path` ended: the file was written as it ended."""
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def settle(record: Path) -> int | None:
    """Stop the task of `record` for good: its exit code when it had ended by itself (anything
    left of it is killed all the same), else None once it is recorded as KILLED and killed."""
    name = record.stem
    try:
        ended_by_itself = not claim(exit_file(record), KILLED)
    except OSError:  # the kill cannot be recorded (a full disk): killed all the same, its end unknown
        ended_by_itself = False
    code = recorded_exit(exit_file(record)) if ended_by_itself else None
    kill_task(name)
    return code


def task_pids(name: str) -> list[int]:
    """The processes of task `name`: those with MUSTER_TASK=<name> in their environment."""
    mark = f"{TASK_ENV}={name}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if mark in environ.split(b"\0"):
                pids.append(int(entry))
    return pids


def kill_task(name: str) -> None:
    """SIGKILL every process group of task `name` (each task runs in a session of its own)."""
    for pid in task_pids(name):
        with contextlib.suppress(OSError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)


async def _pump(stream: asyncio.StreamReader, output: OutputSink) -> None:
    while True:
        try:
            line = await stream.readline()
        except ValueError:  # a line over the limit: deliver what there is
            line = await stream.read(1 << 20)
        if not line:
            return
        output(line.decode("utf-8", "replace").rstrip("\n"))
