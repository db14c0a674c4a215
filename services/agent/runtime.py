"""The runtime seam of the agent: what it takes to start one task, and the interface every
runtime (docker, process, sim) implements. The agent decides *what* runs; a runtime only runs it."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from muster.shared.messages import TaskCause
from muster.shared.shapes import REASON

# Labels on every container (and recorded for every process) so a restarted agent can find them.
LABEL_JOB = "muster.job"
LABEL_ATTEMPT = "muster.attempt"
LABEL_ROLE = "muster.role"
LABEL_INDEX = "muster.index"
LABEL_NODE = "muster.node"
LABEL_PORTS = "muster.ports"
LABEL_HOME = "muster.home"  # the agent's work root: which agent installation on the node owns it


def stop_note(work_root: str | Path, job_id: str, attempt: int, role: str, index: int) -> Path:
    """Where an agent notes that it stopped a task on purpose, before it signals it (a container's
    exit code cannot say who ended it): a task that ends while no agent watches it (the agent
    restarted in its grace, or died) is then told as the stop it was, not as an exit of its own
    (a drained or preempted trainer exiting 0 on SIGTERM was told as succeeded). In the job's
    directory, which no task mounts: a task cannot write it."""
    return Path(work_root) / job_id / f"{attempt}.{role}-{index}.stopped"


def note_stop(path: Path, cause: TaskCause, reason: str) -> bool:
    """Note a stop (its cause and reason as the task's end will say them); False if it could not
    be written (a full disk: the stop goes on, only an end no agent sees is told wrong)."""
    try:
        path.write_text(json.dumps({"cause": cause.value, "reason": reason[:REASON]}))
        return True
    except OSError:
        return False


def noted_stop(path: Path) -> tuple[TaskCause, str] | None:
    """The stop noted at `path`, or None (none, or not one an agent wrote)."""
    try:
        said = json.loads(path.read_text())
        return TaskCause(said["cause"]), str(said["reason"])[:REASON]
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Mount:
    host: str  # a host path; for kind "volume", a Docker named volume
    container: str
    read_only: bool = False
    kind: str = "bind"  # "bind" (a host path) or "volume" (a Docker named volume: datasets)


@dataclass(frozen=True)
class RegistryAuth:
    """Credentials from a job's authFile. The password never appears in repr, logs or errors."""

    server: str
    username: str
    password: str = field(repr=False)


@dataclass
class TaskLaunch:
    name: str  # unique on the node: muster-<job>-<attempt>-<role>-<index>
    image: str
    command: str  # run by /bin/sh -c, so $VAR references expand in the task
    env: dict[str, str] = field(repr=False)  # jobEnvs hold secrets: never in a repr or a log
    cpus: int
    memory_mb: int
    shm_mb: int | None = None
    gpus: list[int] = field(default_factory=list)  # device indexes on this node
    mounts: list[Mount] = field(default_factory=list)
    workdir: str | None = None
    auth: RegistryAuth | None = None
    labels: dict[str, str] = field(default_factory=dict)
    # The job's `extras`, as submitted: hints for a runtime that reads them (sim: `extras.sim`).
    extras: dict[str, Any] = field(default_factory=dict, repr=False)
    # Docker: run in the host's IPC namespace (an MPS client: NVIDIA MPS in containers needs it).
    ipc_host: bool = False


# Called with each line the task writes (stdout and stderr merged, without the newline).
OutputSink = Callable[[str], None]


# Called with each piece of output of a command run in a task (`RunningTask.exec`).
ExecOutput = Callable[[str], Awaitable[None]]


class RunningTask(Protocol):
    """A started (or adopted) task: all the agent asks of it. Every runtime's handle has all of
    it; what a runtime cannot do, it says (`can_exec`) rather than lacks."""

    name: str

    @property
    def oom_killed(self) -> bool:
        """Whether the kernel killed it for using more memory than its limit (known once `wait`
        returned)."""
        ...

    @property
    def vanished(self) -> bool:
        """Whether it was removed under the agent before its end could be read (`docker rm -f`,
        a fence): the platform's doing, not the task's (known once `wait` returned)."""
        ...

    @property
    def can_exec(self) -> bool:
        """Whether `exec` can run a command in it (mpirun's daemons, through muster-rsh)."""
        ...

    async def wait(self) -> int:
        """Block until the task ends; its exit code (128+N when killed by signal N)."""
        ...

    async def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds. Idempotent; returns once it has ended."""
        ...

    async def signal(self, sig: int) -> None:
        """Send `sig` to the task (an elastic job's opt-in resize signal); nothing if it ended."""
        ...

    async def exec(self, command: str, output: ExecOutput) -> int:
        """Run `command` (by /bin/sh -c) in the running task, its output to `output`; its exit
        code. Only where `can_exec`."""
        ...

    async def remove(self) -> None:
        """Remove what is left of the ended task (its record, its container). Idempotent; the
        agent calls it once it has reported the end."""
        ...


@dataclass
class FoundTask:
    """A task found by its labels after an agent restart; `exit_code` is None while it runs (or
    when nothing recorded how it ended), `ended_at` when it ended (wall-clock seconds), if known."""

    name: str
    labels: dict[str, str]
    running: bool
    exit_code: int | None
    ended_at: float | None = None


class Runtime(Protocol):
    name: str
    can_adopt: bool  # whether a restarted agent can take over a task this runtime started

    async def start(self, launch: TaskLaunch, output: OutputSink) -> RunningTask:
        """Start the task. Raises `LaunchError` when it cannot start (bad image, pull failure...)."""
        ...

    async def find(self, labels: dict[str, str]) -> list[FoundTask]:
        """Tasks (running or exited, not yet removed) whose labels include all of `labels`."""
        ...

    async def attach(
        self, name: str, output: OutputSink | None = None, since: float | None = None
    ) -> RunningTask:
        """Take over a found task (only when `can_adopt`); `output` gets what it writes from
        `since` (wall-clock seconds: when the last agent stopped reading it), else from now."""
        ...

    async def reap(self, found: FoundTask) -> int | None:
        """Stop a found task at once (SIGKILL) and remove what is left of it. Idempotent.
        Returns its exit code when it had ended by itself (before it was stopped here), None
        when it was stopped here or nothing says how it ended."""
        ...

    def start_fence(self, home: str, pidfile: str, wait: float, bus_url: str = "") -> None:
        """Start the fence that stops the tasks of the agent whose work root is `home` if it
        dies without detaching, and reports how they ended on the bus at `bus_url`
        (`muster.services.agent.fence`); `wait`: how long a docker fence waits for a new agent."""
        ...

    def detach(self) -> None:
        """The agent stops for a restart: its tasks are to be left running and adopted."""
        ...

    async def capacity(self) -> tuple[int, int] | None:
        """(CPUs, memory MB) a task may be given at most, or None when there is no such bound."""
        ...

    async def close(self) -> None: ...


class LaunchError(Exception):
    """The task could not be started; the message is safe to show (it never holds a secret).
    `cause` says whether it would recur on any node (CONFIG: invalid mount, bad image
    reference, impossible limits) or may not (PLATFORM: pull timeout, daemon restarting)."""

    def __init__(self, message: str, cause: TaskCause = TaskCause.PLATFORM):
        super().__init__(message)
        self.cause = cause
