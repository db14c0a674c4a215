"""MPI without ssh: how `mpirun` in an MPI job's launcher task starts its daemons (orted) in the
job's other tasks, through the node agents (docs/mpi.md).

The launcher's `plm_rsh_agent` is `muster-rsh` (services/agent/muster_rsh.py), which the agent
writes into every MPI attempt's directory. It connects to the attempt's socket there (`rsh.sock`;
the directory is mounted only into that attempt's tasks on this node, so whoever connects is one
of them) and says `{"host": H, "command": C}`. This agent (the caller) finds the workers task H
names in the attempt's cluster spec (H is its host alias, one per task: `mpi.host_alias`) and
asks that task's agent (the peer) on the bus: `ExecRequest` on `muster.exec.req.<peer>.<caller>`.
The peer runs C inside that task (`docker exec`, or a process with the task's environment) and
streams `ExecReply`s back on `muster.exec.out.<caller>.<peer>`: started, output, alive every
ALIVE seconds, exit code.

Who may: the bus lets an agent publish only under its own node, so the peer knows the caller's
node; it runs a command only in a task of its own, of an MPI job's workers role, of an attempt
whose launcher task the spec places on the caller's node. One job's tasks never reach another's.

Bounded: the peer has START_WAIT for its task to be started, the caller OPEN_WAIT for a first
answer and IDLE_WAIT between answers; a caller that goes away (mpirun killed muster-rsh) cancels
the session, and the peer stops what it runs when the session is cancelled or the task ends.
Every message either side receives may be garbage or forged: it is dropped and counted.

Agent restarts (Docker: the tasks go on, the next agent adopts them) must not end a job's
mpirun. Once a daemon has started, its muster-rsh only stands in for an ssh session that mpirun
watches for a failed exit; mpirun itself talks to the daemon over TCP, and takes an ssh child's
clean exit (0) after launch as nothing. So muster-rsh is told when its daemon has started, and
from then on exits 0 if its agent goes away (a crash, before a restart adopts the tasks). An
agent that leaves for a restart tells each muster-rsh whose daemon has started that it is
detached (it exits 0) and asks no peer to cancel; as a peer it leaves the daemons it runs in
its tasks running and says nothing. A caller whose peer falls silent after the start (the
peer's agent restarted) detaches its muster-rsh the same way. A daemon that really dies is
mpirun's to notice, as under ssh."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import stat
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from prometheus_client import Counter

from muster.services.agent.runtime import RunningTask
from muster.services.agent.sharing import Specs
from muster.shared import mpi, shapes, subjects
from muster.shared.messages import (
    EXEC_SESSION_RE,
    MAX_EXEC_CHUNK,
    MAX_EXEC_COMMAND,
    Assignment,
    ClusterSpec,
    Endpoint,
    ExecReply,
    ExecRequest,
)


# The seam between this module and the agent's tasks (services/agent/tasks.py, which starts
# Rsh and, through launch.py, imports this module): what Rsh reads of them, declared here and
# met by tasks.Tasks and tasks.LocalTask, so this module does not import tasks.py.
class ExecTask(Protocol):
    """A task this agent runs, as Rsh sees it."""

    @property
    def assignment(self) -> Assignment: ...
    @property
    def cluster(self) -> ClusterSpec | None: ...  # the spec it was started with (None: adopted)
    @property
    def handle(self) -> RunningTask | None: ...
    @property
    def name(self) -> str: ...


class ExecTasks(Protocol):
    """The tasks this agent runs, by (job id, attempt, role, index), and their cluster specs."""

    @property
    def live(self) -> Mapping[tuple[str, int, str, int], ExecTask]: ...
    @property
    def specs(self) -> Specs: ...
    def of_attempt(self, job_id: str, attempt: int) -> Sequence[ExecTask]: ...


log = structlog.get_logger(service="agent")

SCRIPT_NAME = "muster-rsh"
SOCKET_NAME = "rsh.sock"
SCRIPT = (Path(__file__).with_name("muster_rsh.py")).read_text()
ALIVE = 5.0  # seconds between the peer's `alive` while a command runs
IDLE_WAIT = 30.0  # the caller gives up after this long without a word from the peer
OPEN_WAIT = 90.0  # ... and this long for the first one (the peer may wait for its task to start)
START_WAIT = 60.0  # the peer waits this long for the task to be started
TAKE_WAIT = 5.0  # ... and this long for the task to be known here at all
SPEC_WAIT = 10.0  # for the attempt's cluster spec, when the task does not hold it
ASK_WAIT = 10.0  # for muster-rsh to say what it wants
MAX_SESSIONS = 256  # commands a peer runs at once, all attempts together
DETACHED = -1  # `_call`'s code for a session left to go on without its muster-rsh

EXEC_MESSAGES = Counter(
    "muster_agent_exec_messages_total",
    "MPI exec messages this agent received, by kind (bad: undecodable or refused)",
    ["kind"],
)


def install(attempt_dir: Path) -> Path:
    """Write `muster-rsh` into the attempt's directory (replaced whole); its path."""
    path = attempt_dir / SCRIPT_NAME
    if not path.exists() or path.read_text() != SCRIPT:
        tmp = path.with_name(f".{SCRIPT_NAME}.tmp")
        tmp.write_text(SCRIPT)
        tmp.chmod(0o755)
        os.replace(tmp, path)
    return path


def _target(spec: ClusterSpec, shape: mpi.MpiShape, host: str) -> Endpoint | None:
    """The workers task the hostfile line names: by its host alias (`mpi.host_alias`, what the
    platform's hostfile says), else the first task at that address, in spec order (a host list
    the job wrote itself, `mpirun -H 10.0.0.2,...`)."""
    workers = sorted((e for e in spec.endpoints if e.role == shape.workers), key=lambda e: e.index)
    named = next((e for e in workers if mpi.host_alias(e.role, e.index) == host), None)
    return named or next((e for e in workers if host in (e.host, e.address)), None)


def _session_in(data: bytes) -> str | None:
    """The session a payload that is not a valid exec request names, if it names a valid one."""
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    session = doc.get("session") if isinstance(doc, dict) else None
    return session if isinstance(session, str) and re.fullmatch(EXEC_SESSION_RE, session) else None


class Rsh:
    def __init__(self, nc: NATS, node: str, tasks: ExecTasks):
        self.nc, self.node, self.tasks = nc, node, tasks
        self.servers: dict[tuple[str, int], asyncio.AbstractServer] = {}
        self.waiting: dict[str, asyncio.Queue[ExecReply]] = {}  # caller: session -> its replies
        self.running: dict[tuple[str, str], asyncio.Task[None]] = {}  # peer: (caller, session)
        self.subs: list[Any] = []
        self.clients: set[asyncio.Task[None]] = set()  # muster-rsh connections being served
        self.leaving = asyncio.Event()  # the agent stops for a restart; its tasks go on
        self.log = log.bind(node=node)

    async def start(self) -> None:
        self.subs = [
            await self.nc.subscribe(subjects.exec_request(self.node), cb=self._on_request),
            await self.nc.subscribe(subjects.exec_reply(self.node), cb=self._on_reply),
        ]

    async def detach(self, wait: float = 2.0) -> None:
        """The agent stops for a restart and its tasks go on: every session whose daemon has
        started is left running (each muster-rsh told so, no peer asked to cancel), and the
        daemons run here for other nodes are neither stopped nor reported ended. Waits up to
        `wait` seconds for the muster-rsh connections to be told."""
        self.leaving.set()
        if self.clients:
            await asyncio.wait(list(self.clients), timeout=wait)

    async def close(self) -> None:
        for sub in self.subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for key in list(self.servers):
            self.forget(*key)
        for run in list(self.running.values()):
            run.cancel()

    # ------------------------------------------------------------ caller: the launcher's node

    async def serve(self, job_id: str, attempt: int, attempt_dir: Path) -> None:
        """Listen on the attempt's socket (before its launcher task starts)."""
        if (job_id, attempt) in self.servers:
            return
        path = attempt_dir / SOCKET_NAME
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fd = os.open(attempt_dir, os.O_RDONLY)
        try:  # through the directory's descriptor: the path may be longer than a socket's may
            sock.bind(f"/proc/self/fd/{fd}/{SOCKET_NAME}")
        finally:
            os.close(fd)
        path.chmod(0o777)  # the task's user (not the agent's) connects; the work root (0700) guards it
        sock.listen(64)

        async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            me = asyncio.current_task()
            if me is not None:
                self.clients.add(me)
            try:
                await self._client(job_id, attempt, reader, writer)
            finally:
                self.clients.discard(me)  # type: ignore[arg-type]

        self.servers[(job_id, attempt)] = await asyncio.start_unix_server(client, sock=sock)

    def forget(self, job_id: str, attempt: int) -> None:
        """The launcher ended: no more daemons for this attempt."""
        server = self.servers.pop((job_id, attempt), None)
        if server is not None:
            server.close()

    async def _client(
        self, job_id: str, attempt: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        def say(**what: Any) -> None:
            writer.write(json.dumps(what).encode() + b"\n")

        try:
            try:
                ask = json.loads(await asyncio.wait_for(reader.readline(), ASK_WAIT))
                host, command = ask["host"], ask["command"]
                if (
                    not isinstance(host, str)
                    or not isinstance(command, str)
                    or len(command) > MAX_EXEC_COMMAND
                ):
                    raise ValueError
            except (TimeoutError, ValueError, KeyError, TypeError):
                say(error="expected one line {host, command} (at most 64 KiB)")
                return
            code, error = await self._call(job_id, attempt, host, command, say, writer, reader)
            if code == DETACHED:
                say(detached=error)
            else:
                say(**({"error": error} if error else {"exit": code}))
        except (ConnectionError, OSError):
            pass  # muster-rsh went away
        finally:
            with contextlib.suppress(Exception):
                await writer.drain()
                writer.close()

    async def _call(
        self,
        job_id: str,
        attempt: int,
        host: str,
        command: str,
        say: Any,
        writer: asyncio.StreamWriter,
        reader: asyncio.StreamReader,
    ) -> tuple[int, str]:
        """Run `command` in the workers task at `host`: (exit code, ""), (0, why not), or
        (DETACHED, why) once it started and this agent leaves or its peer falls silent."""
        mine = self.tasks.of_attempt(job_id, attempt)
        shape = mpi.shape(mine[0].assignment.config) if mine else None
        if shape is None:
            return 0, f"attempt {attempt} of job {job_id} is not an MPI attempt running here"
        spec = await self._spec(mine[0])
        if spec is None:
            return 0, f"no cluster spec for attempt {attempt} of job {job_id}"
        target = _target(spec, shape, host)
        if target is None:
            return 0, f"{host} names no task of role {shape.workers} in this job (no alias, no address)"
        session = uuid.uuid4().hex
        replies: asyncio.Queue[ExecReply] = asyncio.Queue()
        self.waiting[session] = replies
        peer = f"node {target.node}'s agent"
        ask = ExecRequest(
            kind="open",
            session=session,
            job_id=job_id,
            attempt=attempt,
            role=target.role,
            index=target.index,
            command=command,
        )
        gone = asyncio.ensure_future(reader.read(1))  # EOF: muster-rsh was killed
        leaving = asyncio.ensure_future(self.leaving.wait())
        ended = started = False
        where = f"task {target.role}.{target.index}"
        try:
            await self.nc.publish(subjects.exec_request(target.node, self.node), ask.to_bytes())
            wait = OPEN_WAIT
            while True:
                got = asyncio.ensure_future(replies.get())
                done, _ = await asyncio.wait(
                    {got, gone, leaving}, timeout=wait, return_when=asyncio.FIRST_COMPLETED
                )
                if got not in done:
                    got.cancel()
                    if gone in done:
                        return 0, "muster-rsh went away"
                    if started:  # the daemon runs on: mpirun watches it, not this session
                        ended = True
                        why = (
                            f"node {self.node}'s agent restarts" if leaving in done else f"{peer} fell silent"
                        )
                        self.log.info("agent.exec_detached", job_id=job_id, task=where, reason=why)
                        return DETACHED, f"{why}; the command in {where} goes on"
                    if leaving in done:
                        return 0, f"node {self.node}'s agent stopped before {peer} started the command"
                    return 0, f"no word from {peer} for {wait:g} s ({where})"
                reply = got.result()
                wait = IDLE_WAIT
                if reply.kind == "started":
                    started = True
                    say(started=True)  # from now on its muster-rsh outlives this agent
                    await writer.drain()
                elif reply.kind == "out":
                    say(out=reply.data)
                    await writer.drain()
                elif reply.kind == "exit":
                    ended = True
                    return reply.code, ""
                elif reply.kind == "error":
                    ended = True
                    return 0, f"{peer} refused: {reply.error}"
        finally:
            gone.cancel()
            leaving.cancel()
            self.waiting.pop(session, None)
            if not ended:
                with contextlib.suppress(Exception):
                    cancel = ExecRequest(kind="cancel", session=session)
                    await self.nc.publish(subjects.exec_request(target.node, self.node), cancel.to_bytes())

    async def _spec(self, task: ExecTask) -> ClusterSpec | None:
        if task.cluster is not None:
            return task.cluster
        a = task.assignment
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(self.tasks.specs.wait(a.job_id, a.attempt), SPEC_WAIT)
        return None

    async def _on_reply(self, msg: Msg) -> None:
        try:
            reply = ExecReply.from_bytes(msg.data)
        except ValueError:
            EXEC_MESSAGES.labels("bad").inc()
            return
        queue = self.waiting.get(reply.session)  # a session id is a secret random 128 bits
        if queue is None:
            EXEC_MESSAGES.labels("stray").inc()
            return
        EXEC_MESSAGES.labels(reply.kind).inc()
        queue.put_nowait(reply)

    # ------------------------------------------------------------ peer: a workers task's node

    async def _on_request(self, msg: Msg) -> None:
        caller = subjects.sender(msg.subject)
        try:
            ask = ExecRequest.from_bytes(msg.data)
        except ValueError as exc:
            EXEC_MESSAGES.labels("bad").inc()
            session = _session_in(msg.data)
            if session is not None:  # its caller waits for an answer: the refusal is one
                why = f"not an exec request: {shapes.refusal(exc)}"
                await self._reply(caller, ExecReply(kind="error", session=session, error=why))
            return
        EXEC_MESSAGES.labels(ask.kind).inc()
        key = (caller, ask.session)
        if ask.kind == "cancel":
            run = self.running.get(key)
            if run is not None:
                run.cancel()
            return
        if key in self.running:
            return  # a repeated ask
        if len(self.running) >= MAX_SESSIONS:
            await self._reply(caller, ExecReply(kind="error", session=ask.session, error="too many sessions"))
            return
        self.running[key] = asyncio.create_task(self._run(caller, ask))

    async def _reply(self, caller: str, reply: ExecReply) -> None:
        with contextlib.suppress(Exception):
            await self.nc.publish(subjects.exec_reply(caller, self.node), reply.to_bytes())

    async def _refusal(self, caller: str, ask: ExecRequest) -> tuple[ExecTask | None, str]:
        key = (ask.job_id, ask.attempt, ask.role, ask.index)
        task = self.tasks.live.get(key)
        # The agent reports a task's endpoint just before it takes the task on: an ask right
        # after the rendezvous may come first. A task that is not here by then never will be.
        deadline = asyncio.get_running_loop().time() + TAKE_WAIT
        while task is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
            task = self.tasks.live.get(key)
        if task is None:
            return None, f"no task {ask.role}.{ask.index} of attempt {ask.attempt} of {ask.job_id} here"
        shape = mpi.shape(task.assignment.config)
        if shape is None:
            return None, "not an MPI job"
        if ask.role != shape.workers:
            return None, f"role {ask.role} hosts no ranks (the workers role is {shape.workers})"
        spec = await self._spec(task)
        launcher = (
            next((e for e in spec.endpoints if e.role == shape.launcher and e.index == 0), None)
            if spec
            else None
        )
        if launcher is None or launcher.node != caller:
            return None, f"the attempt's launcher does not run on node {caller}"
        return task, ""

    async def _run(self, caller: str, ask: ExecRequest) -> None:
        def reply(kind: str, **fields: Any) -> ExecReply:
            return ExecReply(kind=kind, session=ask.session, **fields)  # type: ignore[arg-type]

        key = (ask.job_id, ask.attempt, ask.role, ask.index)
        alive: asyncio.Task[None] | None = None
        try:
            task, why = await self._refusal(caller, ask)
            why = why[:500]  # names from the ask: bounded in the log and the answer
            if task is None:
                EXEC_MESSAGES.labels("refused").inc()
                self.log.warning("agent.exec_refused", caller=caller, job_id=ask.job_id, reason=why)
                await self._reply(caller, reply("error", error=why))
                return
            loop = asyncio.get_running_loop()
            deadline = loop.time() + START_WAIT
            # Polled: a task's start has no event of its own to wait on.
            while task.handle is None and key in self.tasks.live and loop.time() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.2)
            handle = task.handle
            if handle is None or not handle.can_exec or key not in self.tasks.live:
                why = "the task is not running" if handle is None else "the task ended"
                if handle is not None and not handle.can_exec:
                    why = "this node's runtime cannot run commands in a task"
                await self._reply(caller, reply("error", error=why))
                return
            await self._reply(caller, reply("started"))
            me = asyncio.current_task()
            assert me is not None
            alive = asyncio.create_task(self._alive(caller, ask.session, key, me))

            async def output(text: str) -> None:
                for i in range(0, len(text), MAX_EXEC_CHUNK):
                    await self._reply(caller, reply("out", data=text[i : i + MAX_EXEC_CHUNK]))

            self.log.info("agent.exec_started", caller=caller, task=task.name)
            code = await handle.exec(ask.command, output)
            self.log.info("agent.exec_ended", caller=caller, task=task.name, exit_code=code)
            await self._reply(caller, reply("exit", code=code))
        except asyncio.CancelledError:  # cancelled by the caller, the task ended, or we leave
            if self.leaving.is_set():  # for a restart: the command goes on in the task (Docker)
                self.log.info("agent.exec_left_running", caller=caller, job_id=ask.job_id)
                return
            self.log.info("agent.exec_cancelled", caller=caller, job_id=ask.job_id)
            await self._reply(caller, reply("error", error="stopped: cancelled, or the task ended"))
        except Exception as exc:
            self.log.warning("agent.exec_failed", caller=caller, job_id=ask.job_id, error=str(exc)[:200])
            await self._reply(caller, reply("error", error=f"{type(exc).__name__}: {exc}"[:1000]))
        finally:
            if alive is not None:
                alive.cancel()
            self.running.pop((caller, ask.session), None)

    async def _alive(self, caller: str, session: str, key: Any, run: asyncio.Task[None]) -> None:
        """Say the session lives every ALIVE seconds; stop it once its task has ended here."""
        while True:
            await asyncio.sleep(ALIVE)
            if key not in self.tasks.live:
                run.cancel()
                return
            await self._reply(caller, ExecReply(kind="alive", session=session))
