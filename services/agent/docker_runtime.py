"""The Docker runtime: runs each task as one container on the local engine (pull with the job's
credentials, create with the task's limits, mounts, GPUs and labels on the host network, or in
another container's network namespace (--docker-network), stream its output, wait, stop) and
finds the containers a previous agent left behind.

docker-py is blocking: every call runs in `asyncio.to_thread`, and each container's log stream is
read by its own thread that hands complete lines to the event loop."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import math
import os
import re
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import docker
import docker.errors
import requests
import structlog
from docker.models.containers import Container
from docker.types import DeviceRequest
from docker.types import Mount as DockerMount

from muster.services.agent import fence_handle
from muster.services.agent.runtime import FoundTask, LaunchError, OutputSink, RegistryAuth, TaskLaunch
from muster.shared.messages import TaskCause

log = structlog.get_logger()

MiB = 1024 * 1024
DEFAULT_SHM_MB = 64
LOG_DRAIN_TIMEOUT = 10.0  # after the container exits, how long its log stream may take to end
CATCH_UP_LINES = 100  # log entries read again once a container ended (DockerTask._catch_up)
CATCH_UP_WAIT = 5  # seconds the log thread waits for the container to have ended, then reads
# The engine copies a container's stdout and stderr pipes in two goroutines, so lines written to
# both lose their relative order in the log. The task's shell sends stderr down stdout's pipe first.
MERGE_STDERR = "exec 2>&1; "
STOP_SIGNAL_TIMEOUT = 5.0  # seconds the SIGTERM to a task's processes may take before the stop goes on
WAIT_SLICE = 3  # seconds one blocking wait call may take
LOCAL_IMAGES = "muster/"  # the images deploy/ builds on a node: no registry holds them
GONE_EXIT_CODE = 137  # reported when the container vanished (docker rm -f) before we read its code


def _scrub(text: str, auth: RegistryAuth | None) -> str:
    """The engine's error text, with the registry password cut out should it ever appear."""
    if auth is not None and auth.password:
        text = text.replace(auth.password, "***")
    return text


def _explain(err: docker.errors.DockerException) -> str:
    explanation = getattr(err, "explanation", None)
    return str(explanation or err)


def _cause(err: docker.errors.DockerException) -> TaskCause:
    """Whether the engine's refusal would recur on any node: a request it rejects as invalid
    (4xx: bad mount, bad image reference, impossible limits, no such image) is a configuration
    error; anything else (5xx, timeouts, a daemon restarting, a name conflict) may pass."""
    if isinstance(err, docker.errors.InvalidRepository | docker.errors.ImageNotFound):
        return TaskCause.CONFIG
    status = getattr(err, "status_code", None)
    if status is not None and 400 <= status < 500 and status not in (408, 409, 429):
        return TaskCause.CONFIG
    return TaskCause.PLATFORM


def missed(came: list[bytes], tail: bytes) -> tuple[list[bytes], bytes | None]:
    """What of a log's `tail` (its last entries, as the engine gives them) came after the lines
    that `came` (the last of which may be a line without a newline): the complete lines, and
    the final line without a newline (None: nothing after what came, or no way to tell). What
    came is found in the tail by its last lines (the longest overlap); when it is not there,
    nothing is taken, so nothing is emitted twice."""
    *entries, last = tail.split(b"\n")
    if last:
        entries.append(last)
    start: int | None = 0 if not came else None  # nothing came: all of the tail is new
    for j in range(len(entries), 0, -1) if came else ():
        m = min(j, len(came))
        if entries[j - m : j] == came[len(came) - m :]:
            start = j
            break
    if start is None or start == len(entries):
        return [], None
    new = entries[start:]
    return (new[:-1], new[-1]) if last else (new, b"")


class DockerTask:
    """One started container: its output stream, exit code, stop and removal."""

    can_exec = True

    def __init__(
        self,
        container: Container,
        output: OutputSink | None,
        loop: asyncio.AbstractEventLoop,
        since: float | None,
        runtime: DockerRuntime | None = None,
    ):
        self.name: str = container.name
        self._runtime = runtime  # whose detach (an agent restart) leaves exec'd commands running
        self._container = container
        self._loop = loop
        self._output = output
        self._logs_done: asyncio.Future[None] = loop.create_future()
        self._wait_task: asyncio.Task[int] | None = None
        self.oom_killed = False  # known once wait() returned: the kernel killed it for memory
        self.vanished = False  # known once wait() returned: removed before its code was read
        self._thread = threading.Thread(
            target=self._pump_logs, args=(since,), name=f"logs-{self.name}", daemon=True
        )
        self._thread.start()

    # -- the log thread ------------------------------------------------------------------------

    def _pump_logs(self, since: float | None) -> None:
        buffer = b""
        recent: deque[bytes] = deque(maxlen=CATCH_UP_LINES)  # the last complete lines that came
        ended = False
        try:
            kwargs: dict[str, Any] = {"stream": True, "follow": True, "stdout": True, "stderr": True}
            if since is not None:
                kwargs["since"] = since
            for chunk in self._container.logs(**kwargs):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    recent.append(line)
                    self._emit(line)
            ended = True
        except Exception as e:  # the engine went away, the container was removed, the client closed
            log.warning("docker.logs_ended", task=self.name, error=str(e))
        finally:
            if ended:
                buffer = self._catch_up(list(recent), buffer, since)
            if buffer:
                self._emit(buffer)
            self._call(self._logs_ended)

    def _logs_ended(self) -> None:  # on the loop
        if not self._logs_done.done():
            self._logs_done.set_result(None)

    def _catch_up(self, got: list[bytes], buffer: bytes, since: float | None) -> bytes:
        """The engine can end a follow stream before the last output of a container that has
        just exited is in it (seen: the last line, without a newline, missing about once in 15
        quick tasks; a later read has it; for an adopted task, all of what it wrote after it
        was adopted, seen under load). Once the container has ended, read the log's last
        CATCH_UP_LINES entries (from `since`, where the stream started, so an adopted task's
        output the agent before read is not taken again), emit those after what came, and
        return the final partial line (or `buffer`). What came is found in the tail by its last
        lines; nothing is emitted twice when they cannot be found."""
        try:
            self._container.wait(timeout=CATCH_UP_WAIT)
            kwargs: dict[str, Any] = {"stdout": True, "stderr": True, "tail": CATCH_UP_LINES}
            if since is not None:
                kwargs["since"] = since
            tail = self._container.logs(**kwargs)
        except Exception:
            return buffer
        new, partial = missed([*got, buffer] if buffer else got, tail)
        if partial is None:  # nothing was missed
            return buffer
        if buffer:  # a line whose newline came with what was missed
            self._emit(buffer)
        for line in new:
            self._emit(line)
        return partial

    def _emit(self, raw: bytes) -> None:
        if self._output is None:
            return
        line = raw.decode("utf-8", errors="replace").removesuffix("\r")
        self._call(lambda: self._deliver(line))

    def _call(self, fn: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(fn)

    def _deliver(self, line: str) -> None:
        assert self._output is not None
        try:
            self._output(line)
        except Exception:
            log.exception("docker.output_sink_failed", task=self.name)

    # -- RunningTask -----------------------------------------------------------------------------

    async def wait(self) -> int:
        """The container's exit code, once it has ended and all its output was delivered."""
        if self._wait_task is None:
            self._wait_task = asyncio.ensure_future(self._wait())
        return await asyncio.shield(self._wait_task)

    async def _wait(self) -> int:
        try:
            while True:  # in slices: a thread blocked here must not keep a stopping agent alive
                began = time.monotonic()
                try:
                    result = await asyncio.to_thread(self._container.wait, timeout=WAIT_SLICE)
                    break
                except docker.errors.NotFound:  # a RequestException too: gone, not slow
                    raise
                except requests.exceptions.RequestException:
                    # A slice that timed out: wait on. One refused at once (the engine restarting)
                    # is tried again a second later, not in a loop of a thousand calls a second.
                    if time.monotonic() - began < WAIT_SLICE / 2:
                        await asyncio.sleep(1.0)
            code = int(result["StatusCode"])
            await asyncio.to_thread(self._container.reload)
            self.oom_killed = bool(self._container.attrs.get("State", {}).get("OOMKilled"))
        except docker.errors.NotFound:
            log.warning("docker.container_vanished", task=self.name)
            code, self.vanished = GONE_EXIT_CODE, True
        try:
            await asyncio.wait_for(asyncio.shield(self._logs_done), LOG_DRAIN_TIMEOUT)
        except TimeoutError:
            log.warning("docker.logs_not_drained", task=self.name)
        return code

    async def stop(self, grace: float) -> None:
        """SIGTERM, SIGKILL after `grace` seconds (rounded up to whole seconds, as the engine takes
        them); idempotent, tolerates a container that is already gone; returns once it has ended.

        The engine's SIGTERM goes to PID 1 only: the `/bin/sh -c` that runs the command, which
        as PID 1 ignores it, so the task's own processes would run on through the grace (a
        preempted task never told to stop, one that finishes meanwhile run again in its next
        attempt). They are sent SIGTERM first, from inside: PID 1 (for a command that traps it),
        then `kill -TERM -1` (every process of the container but PID 1 and the sender); then the
        engine's stop takes its course."""
        if grace > 0:  # no grace: killed at once, as before
            with contextlib.suppress(Exception):  # gone, not running, no `kill`: the stop below still holds
                await asyncio.wait_for(
                    asyncio.to_thread(
                        self._container.exec_run, ["/bin/sh", "-c", "kill -TERM 1; kill -TERM -1"]
                    ),
                    STOP_SIGNAL_TIMEOUT,
                )
        with contextlib.suppress(docker.errors.NotFound):
            await asyncio.to_thread(self._container.stop, timeout=max(0, math.ceil(grace)))
        await self.wait()

    async def exec(self, command: str, output: Callable[[str], Awaitable[None]]) -> int:
        """Run `command` in the container (`docker exec`: its user, environment and directory),
        e.g. an MPI daemon: its output to `output`, its exit code returned. Cancelled: killed,
        unless the agent is detaching for a restart (the command goes on, as the task does)."""
        api = self._container.client.api
        argv = ["/bin/sh", "-c", MERGE_STDERR + command]
        try:
            exec_id = (await asyncio.to_thread(api.exec_create, self._container.id, argv))["Id"]
        except docker.errors.DockerException as e:
            raise LaunchError(f"cannot exec in {self.name}: {_explain(e)}") from None
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[bytes | None] = asyncio.Queue()

        def pump() -> None:
            try:
                for chunk in api.exec_start(exec_id, stream=True):
                    loop.call_soon_threadsafe(chunks.put_nowait, chunk)
            except Exception as e:  # the container went away, the engine closed the stream
                log.warning("docker.exec_stream_ended", task=self.name, error=str(e))
            finally:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(chunks.put_nowait, None)

        threading.Thread(target=pump, name=f"exec-{self.name}", daemon=True).start()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            while (chunk := await chunks.get()) is not None:
                await output(decoder.decode(chunk))
        except asyncio.CancelledError:
            if self._runtime is not None and self._runtime.detached:
                raise  # the agent restarts: the command goes on with the task (an MPI daemon)
            with contextlib.suppress(Exception):
                pid = (await asyncio.to_thread(api.exec_inspect, exec_id)).get("Pid")
                if pid:
                    os.kill(int(pid), signal.SIGKILL)  # the engine has no "stop exec"
            raise
        info = await asyncio.to_thread(api.exec_inspect, exec_id)
        code = info.get("ExitCode")
        return int(code) if code is not None else GONE_EXIT_CODE

    async def signal(self, sig: int) -> None:
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):  # gone, or not running
            await asyncio.to_thread(self._container.kill, signal=sig)

    async def remove(self) -> None:
        """Delete the container (killing it if it still runs); a container already gone is fine."""
        with contextlib.suppress(docker.errors.NotFound):
            await asyncio.to_thread(self._container.remove, force=True)


def settle_container(container: Container) -> int | None:
    """Stop `container` for good (blocking): its exit code when it had ended by itself, None
    when it still ran and was killed here. The engine refuses to kill a container that is not
    running (409), so one that ended by itself is never taken for one killed here; and one that
    ended in the instant before the kill reached it shows its own exit code, not SIGKILL's.
    Raises NotFound when it is gone; `attrs` is read again after."""
    try:
        container.kill()
        killed = True
    except docker.errors.APIError as e:
        if isinstance(e, docker.errors.NotFound) or e.status_code != 409:
            raise
        killed = False  # not running: it had ended by itself
    try:
        code = int(container.wait(timeout=LOG_DRAIN_TIMEOUT)["StatusCode"])
        container.reload()
    except (requests.exceptions.RequestException, docker.errors.APIError) as e:
        if isinstance(e, docker.errors.NotFound):
            raise
        return None
    if never_started(container.attrs.get("State") or {}):
        return None
    return None if killed and code == GONE_EXIT_CODE else code


def never_started(state: dict[str, Any]) -> bool:
    """A container created and never started (the engine says it exited 0)."""
    return state.get("Status") == "created" or str(state.get("StartedAt") or "").startswith("0001-")


def finished_at(state: dict[str, Any]) -> datetime | None:
    """When a container ended, from its State (None when it never did)."""
    text = str(state.get("FinishedAt") or "")
    if not text or text.startswith("0001-"):
        return None
    try:
        return datetime.fromisoformat(text[:26].rstrip("Z") + "+00:00")
    except ValueError:
        return None


# Capabilities a task keeps (all others are dropped; --task-caps / MUSTER_TASK_CAPS to change).
# Docker's default set less MKNOD (device nodes), NET_RAW (raw sockets: spoofing on the host
# network tasks share), NET_BIND_SERVICE (ports below 1024 of the host: a task could pose as
# the node's sshd or DNS), SYS_CHROOT, AUDIT_WRITE, SETFCAP, SETPCAP and FSETID. Kept:
# - CHOWN, DAC_OVERRIDE, FOWNER: a task run as root (--task-user root) manages its own files
#   (images whose setup chowns or writes files owned by another user);
# - SETUID, SETGID: tools that drop to another user (apt's _apt, su-exec/gosu entrypoints);
# - KILL: signal its own processes run as other users of the image.
# They are in the bounding set only: a task run as a non-root user (the default) has none in
# effect, and no-new-privileges keeps setuid binaries from raising any.
DEFAULT_TASK_CAPS = "CHOWN,DAC_OVERRIDE,FOWNER,SETUID,SETGID,KILL"
# Linux capabilities (capabilities(7)), to refuse a misspelt one when the agent starts rather
# than in every container create.
LINUX_CAPS = frozenset(
    [
        "CHOWN",
        "DAC_OVERRIDE",
        "DAC_READ_SEARCH",
        "FOWNER",
        "FSETID",
        "KILL",
        "SETGID",
        "SETUID",
        "SETPCAP",
        "LINUX_IMMUTABLE",
        "NET_BIND_SERVICE",
        "NET_BROADCAST",
        "NET_ADMIN",
        "NET_RAW",
        "IPC_LOCK",
        "IPC_OWNER",
        "SYS_MODULE",
        "SYS_RAWIO",
        "SYS_CHROOT",
        "SYS_PTRACE",
        "SYS_PACCT",
        "SYS_ADMIN",
        "SYS_BOOT",
        "SYS_NICE",
        "SYS_RESOURCE",
        "SYS_TIME",
        "SYS_TTY_CONFIG",
        "MKNOD",
        "LEASE",
        "AUDIT_WRITE",
        "AUDIT_CONTROL",
        "SETFCAP",
        "MAC_OVERRIDE",
        "MAC_ADMIN",
        "SYSLOG",
        "WAKE_ALARM",
        "BLOCK_SUSPEND",
        "AUDIT_READ",
        "PERFMON",
        "BPF",
        "CHECKPOINT_RESTORE",
    ]
)


def parse_caps(text: str) -> tuple[str, ...]:
    """A comma-separated capability list (CAP_ prefix optional, any case; empty: none kept)."""
    caps = []
    for entry in (e.strip().upper().removeprefix("CAP_") for e in text.split(",")):
        if not entry:
            continue
        if entry not in LINUX_CAPS:
            raise ValueError(f"capability {entry!r}: not a Linux capability (see capabilities(7))")
        caps.append(entry)
    return tuple(dict.fromkeys(caps))


TASK_CAPS = parse_caps(os.environ.get("MUSTER_TASK_CAPS", DEFAULT_TASK_CAPS))

# Where tasks' containers are networked (--docker-network / MUSTER_DOCKER_NETWORK):
# - "host" (the default): the host's network namespace, where the agent's --address and the
#   ports it hands out are the host's own;
# - "container:NAME": the network namespace of the (running) container NAME, e.g. a holder that
#   only sleeps on a bridge network: tasks are reached at its address, which the agent must
#   advertise (--address), and its ports are theirs. Several hosts on one machine, one holder
#   each (tests/test_mpi.py), or a namespace a node's network plugin set up.
# Nothing else: on a bridge (or any network of Docker's own) each task would get an address and
# ports of its own that the agent neither knows nor advertises, and peers could not reach it.
NETWORK_HOST = "host"
CONTAINER_NETWORK = re.compile(r"container:([A-Za-z0-9][A-Za-z0-9_.-]*)")


def parse_network(text: str) -> str:
    """--docker-network checked: "host" or "container:NAME" (ValueError, saying why, else)."""
    value = text.strip()
    if value == NETWORK_HOST or CONTAINER_NETWORK.fullmatch(value):
        return value
    raise ValueError(
        f"{text!r}: use host, or container:NAME to run tasks in the network namespace of the "
        "container NAME (other networks would give each task an address and ports the agent "
        "does not know)"
    )


DEFAULT_TASK_USER = os.environ.get("MUSTER_DEFAULT_TASK_USER", "1000:1000")


def _give(path: str, user: str) -> None:
    """Let `user` (UID[:GID]) write in `path` (the agent runs as root under Docker)."""
    uid, _, gid = user.partition(":")
    if not uid.isdigit():  # a name only the image can resolve: let anyone write there
        with contextlib.suppress(OSError):
            os.chmod(path, 0o1777)
        return
    with contextlib.suppress(OSError):
        os.chown(path, int(uid), int(gid) if gid.isdigit() else -1)
        for name in os.listdir(path):
            os.chown(os.path.join(path, name), int(uid), int(gid) if gid.isdigit() else -1)


class DockerRuntime:
    """The Runtime that runs tasks as containers of the local Docker engine."""

    name = "docker"
    can_adopt = True

    def __init__(
        self,
        client: docker.DockerClient | None = None,
        task_user: str = "auto",
        pids_limit: int = 4096,
        caps: tuple[str, ...] | None = None,
        network: str = NETWORK_HOST,
    ):
        # Each running task holds two engine connections (its log stream and its wait).
        self._client = client if client is not None else docker.from_env(max_pool_size=64)
        self.task_user, self.pids_limit = task_user, pids_limit
        self.caps = TASK_CAPS if caps is None else caps
        self.network = parse_network(network)
        # The agent probes free ports in its own namespace: only right on the host network.
        self.tasks_in_agent_network = self.network == NETWORK_HOST
        self.detached = False  # the agent stops for a restart: its tasks (and their execs) go on
        self.cpu_cap: int | None = None  # the engine's CPUs, once `capacity` has asked
        self._fence: subprocess.Popen[bytes] | None = None

    @classmethod
    def available(cls, timeout: float = 2.0) -> bool:
        """Whether a Docker engine answers a ping within `timeout` seconds."""
        try:
            client = docker.from_env(timeout=timeout)
        except Exception:
            return False
        try:
            return bool(client.ping())
        except Exception:
            return False
        finally:
            client.close()

    async def start(self, launch: TaskLaunch, output: OutputSink) -> DockerTask:
        await self._ensure_image(launch.image, launch.auth)
        await self._check_volumes(launch)
        await self._remove_leftover(launch.name)
        t0 = time.monotonic()
        user = await asyncio.to_thread(self._user_for, launch.image)
        kwargs = self._create_kwargs(launch, self.cpu_cap, user, self.pids_limit, self.caps, self.network)
        try:
            container = await asyncio.to_thread(self._client.containers.create, launch.image, **kwargs)
        except docker.errors.DockerException as e:
            raise LaunchError(
                f"cannot create container {launch.name} from {launch.image}: {_explain(e)}", _cause(e)
            ) from None
        try:
            await asyncio.to_thread(container.start)
        except docker.errors.DockerException as e:
            with contextlib.suppress(docker.errors.DockerException):
                await asyncio.to_thread(container.remove, force=True)
            raise LaunchError(
                f"cannot start container {launch.name} from {launch.image}: {_explain(e)}", _cause(e)
            ) from None
        log.info(
            "docker.started", task=launch.name, image=launch.image, seconds=round(time.monotonic() - t0, 3)
        )
        return DockerTask(container, output, asyncio.get_running_loop(), since=None, runtime=self)

    async def attach(
        self, name: str, output: OutputSink | None = None, since: float | None = None
    ) -> DockerTask:
        """A task for an existing container (found after an agent restart): wait, stop and remove
        work as for a started one; `output` gets the lines written from `since` (when the last
        agent stopped reading: none written while no agent ran is lost), else from now."""
        try:
            container = await asyncio.to_thread(self._client.containers.get, name)
        except docker.errors.NotFound:
            raise LaunchError(f"no container named {name}") from None
        start = time.time() if since is None else since
        return DockerTask(container, output, asyncio.get_running_loop(), since=start, runtime=self)

    async def find(self, labels: dict[str, str]) -> list[FoundTask]:
        """Containers in any state whose labels include all of `labels`."""
        filters = {"label": [f"{k}={v}" for k, v in labels.items()]}
        containers = await asyncio.to_thread(
            self._client.containers.list, all=True, filters=filters, ignore_removed=True
        )
        found = []
        for c in containers:
            state = c.attrs.get("State", {})
            running = bool(state.get("Running")) or bool(state.get("Paused"))
            # Created but never started (its agent died in between): it has not ended, whatever
            # exit code the engine shows (0).
            exit_code = None if running or never_started(state) else int(state.get("ExitCode", 0))
            ended = finished_at(state) if not running else None
            found.append(
                FoundTask(
                    name=c.name,
                    labels=dict(c.labels),
                    running=running,
                    exit_code=exit_code,
                    ended_at=ended.timestamp() if ended else None,
                )
            )
        return found

    async def reap(self, found: FoundTask) -> int | None:
        """Kill and remove a found container: its exit code when it had ended by itself."""
        try:
            container = await asyncio.to_thread(self._client.containers.get, found.name)
            code = await asyncio.to_thread(settle_container, container)
        except docker.errors.NotFound:
            return None
        with contextlib.suppress(docker.errors.NotFound):
            await asyncio.to_thread(self._client.api.remove_container, found.name, force=True)
        return code

    def network_addresses(self) -> list[str]:
        """The IPv4 addresses tasks have in the --docker-network's namespace: for container:NAME,
        NAME's, on each of its networks ([] when it has none or is not running); for host, [].
        Blocking (called when the agent starts). ValueError, saying why, when NAME is not a
        container of this engine."""
        found = CONTAINER_NETWORK.fullmatch(self.network)
        if found is None:
            return []
        name = found.group(1)
        try:
            holder = self._client.containers.get(name)
        except docker.errors.NotFound:
            raise ValueError(f"no container {name!r} on this Docker engine (start it first)") from None
        except docker.errors.DockerException as e:
            raise ValueError(f"cannot look up container {name!r}: {_explain(e)}") from None
        settings = holder.attrs.get("NetworkSettings") or {}
        networks = settings.get("Networks") or {}
        return [n["IPAddress"] for n in networks.values() if n.get("IPAddress")]

    def _user_for(self, image: str) -> str | None:
        """Who a task of `image` runs as: the agent's --task-user, or (auto) the image's own
        USER when it is not root, else DEFAULT_TASK_USER; None keeps the image's."""
        if self.task_user == "root":
            return "0:0"
        if self.task_user != "auto":
            return self.task_user
        try:
            configured = (self._client.images.get(image).attrs.get("Config") or {}).get("User") or ""
        except docker.errors.DockerException:
            configured = ""
        if configured and configured.split(":")[0] not in ("root", "0"):
            return None
        return DEFAULT_TASK_USER

    def start_fence(self, home: str, pidfile: str, wait: float, bus_url: str = "") -> None:
        """If the agent dies without detaching and no new agent comes within `wait` seconds,
        its task containers are stopped, reported and removed (see `muster.services.agent.fence`)."""
        if self._fence is None:
            self._fence = fence_handle.start_fence("docker", home, pidfile, f"{wait:g}", bus_url=bus_url)

    def detach(self) -> None:
        self.detached = True
        fence_handle.detach(self._fence)

    async def close(self) -> None:
        fence_handle.close(self._fence)
        self._fence = None
        await asyncio.to_thread(self._client.close)

    async def capacity(self) -> tuple[int, int]:
        """CPUs and memory (MB) the engine can give a container: a declaration above them
        could not be honoured."""
        info = await asyncio.to_thread(self._client.info)
        self.cpu_cap = int(info.get("NCPU", 0)) or None
        return int(info.get("NCPU", 0)), int(info.get("MemTotal", 0)) // MiB

    # -- steps of start ----------------------------------------------------------------------------

    async def _check_volumes(self, launch: TaskLaunch) -> None:
        """A dataset's named volume must exist (the engine would make an empty one)."""
        for m in launch.mounts:
            if m.kind != "volume":
                continue
            try:
                await asyncio.to_thread(self._client.volumes.get, m.host)
            except docker.errors.NotFound:
                raise LaunchError(
                    f"Docker volume {m.host} (mounted at {m.container}) does not exist on this node",
                    TaskCause.CONFIG,
                ) from None
            except docker.errors.APIError as e:
                raise LaunchError(f"cannot look up Docker volume {m.host}: {_explain(e)}", _cause(e)) from e

    async def _ensure_image(self, image: str, auth: RegistryAuth | None) -> None:
        try:
            await asyncio.to_thread(self._client.images.get, image)
            return
        except docker.errors.ImageNotFound:
            pass
        except docker.errors.DockerException as e:
            raise LaunchError(
                f"cannot look up image {image}: {_scrub(_explain(e), auth)}", _cause(e)
            ) from None
        auth_config = None
        if auth is not None:
            auth_config = {"username": auth.username, "password": auth.password, "serveraddress": auth.server}
        log.info("docker.pulling", image=image, registry=auth.server if auth else None)
        t0 = time.monotonic()
        error: str | None = None
        cause = TaskCause.PLATFORM
        try:
            await asyncio.to_thread(self._client.images.pull, image, auth_config=auth_config)
        except docker.errors.DockerException as e:
            error, cause = f"cannot pull image {image}: {_explain(e)}", _cause(e)
        if error is not None:  # raised outside the handler: the request's auth header is not chained
            if image.startswith(LOCAL_IMAGES):
                error += f" ({image} is built on each node, not pulled: deploy/build-*-image.sh)"
            raise LaunchError(_scrub(error, auth), cause)
        log.info("docker.pulled", image=image, seconds=round(time.monotonic() - t0, 1))

    async def _remove_leftover(self, name: str) -> None:
        """Remove a container with this name (left by a crashed agent), so the name is free."""
        try:
            await asyncio.to_thread(self._client.api.remove_container, name, force=True)
            log.warning("docker.removed_leftover", task=name)
        except docker.errors.NotFound:
            pass
        except docker.errors.DockerException as e:
            raise LaunchError(f"cannot remove leftover container {name}: {_explain(e)}") from None

    @staticmethod
    def _create_kwargs(
        launch: TaskLaunch,
        cpu_cap: int | None = None,
        user: str | None = None,
        pids_limit: int = 4096,
        caps: tuple[str, ...] = TASK_CAPS,
        network: str = NETWORK_HOST,
    ) -> dict[str, Any]:
        """The container: limits as declared, all capabilities dropped but `caps`, no new
        privileges (setuid binaries give none), at most `pids_limit` processes, not privileged,
        no device but its GPUs, run as `user` (None: the image's own, non-root USER), in the
        `network` namespace (host, or container:NAME; no published ports, host name or DNS
        settings of its own: the engine refuses those with container:NAME, and on the host
        network they mean nothing)."""
        env = dict(launch.env)
        if launch.gpus:
            # The engine exposes the chosen host devices; inside the container they count from 0,
            # whatever host indexes the agent rendered for the process runtime.
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(str(i) for i in launch.gpus)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(launch.gpus)))
        mounts = []
        for i, m in enumerate(launch.mounts):
            if m.kind == "volume":
                mounts.append(
                    DockerMount(target=m.container, source=m.host, type="volume", read_only=m.read_only)
                )
                continue
            if not os.path.isabs(m.host):  # checked before anything is made relative to our cwd
                raise LaunchError(
                    f"mount {m.host!r} -> {m.container}: the host path must be absolute", TaskCause.CONFIG
                )
            created = not m.read_only and not os.path.exists(m.host)
            if not m.read_only:
                os.makedirs(m.host, exist_ok=True)
            # The attempt's own directory, and writable mount points made here, are the task's
            # to write in; a directory that was there keeps its owner (make it writable for
            # the task user, or run tasks as another with --task-user).
            if user and (i == 0 or created):
                _give(m.host, user)
            mounts.append(DockerMount(target=m.container, source=m.host, type="bind", read_only=m.read_only))
        if user and launch.mounts:
            env.setdefault("HOME", launch.mounts[0].container)  # a uid with no passwd entry has none
        kwargs: dict[str, Any] = {
            "name": launch.name,
            "command": ["/bin/sh", "-c", MERGE_STDERR + launch.command],
            "environment": env,
            "network_mode": network,
            "labels": dict(launch.labels),
            "working_dir": launch.workdir,
            "mounts": mounts,
            "shm_size": (launch.shm_mb or DEFAULT_SHM_MB) * MiB,
            "cap_drop": ["ALL"],
            "cap_add": list(caps),
            "security_opt": ["no-new-privileges:true"],
            "pids_limit": pids_limit,
            "privileged": False,
        }
        if user:
            kwargs["user"] = user
        if launch.ipc_host:
            kwargs["ipc_mode"] = "host"
        if launch.cpus > 0:
            # The engine refuses a limit above the CPUs it has: a node declared with more
            # (--overcommit) gives a task at most all of them.
            cpus = min(launch.cpus, cpu_cap) if cpu_cap else launch.cpus
            kwargs["nano_cpus"] = int(cpus * 1e9)
        if launch.memory_mb > 0:
            kwargs["mem_limit"] = launch.memory_mb * MiB
            kwargs["memswap_limit"] = launch.memory_mb * MiB  # no swap beyond the limit
        if launch.gpus:
            kwargs["device_requests"] = [
                DeviceRequest(device_ids=[str(i) for i in launch.gpus], capabilities=[["gpu"]])
            ]
        return kwargs
