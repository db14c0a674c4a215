"""The fence: no task outlives its agent for long enough to run beside its replacement, and a
task that ended just as its agent died is told as ended, not lost.

The agent starts it (`start_fence`) with a pipe on its standard input and writes nothing to it
until it stops: `detach` when it stops for a restart on purpose (its tasks are to be adopted),
nothing otherwise. When the pipe closes without `detach` — the agent crashed or was SIGKILLed —
the fence acts before the node can be declared lost (MUSTER_NODE_TIMEOUT):
- process runtime: at once, it kills every task the dead agent started that had not ended. It
  records "killed" in the task's exit file first, where the task's wrapper records its own exit
  code as it ends, so an exit and a kill are never taken for each other (process_runtime).
- docker runtime: it waits a little for a new agent (a quick restart adopts the containers),
  and removes the node's task containers if none has come, so the new agent, whenever it
  comes, reports them lost rather than finding them killed by no one.
And at once, it reports every task of the dead agent that had ended by itself (its exit
recorded: an exit file, an exited container; on Docker also each one that ends while the fence
waits, as it ends) with its own exit code, and sends whatever the
agent had left unsent in its outbox: into the outbox first (the next agent sends it should the
fence fail to), then to the bus, as the agent (its MUSTER_NATS_URL and MUSTER_CREDENTIALS). So
such a task's end reaches the supervisor before the node could be declared lost, however long
the agent stays away, and its gang is not run again. The tasks it killed are reported lost by
the next agent, or declared lost with the node, as before.

    python -m muster.services.agent.fence process AGENT_PID HOME STATE_DIR
    python -m muster.services.agent.fence docker AGENT_PID HOME PIDFILE WAIT_SECONDS

HOME is the agent's work root (its outbox is there).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from muster.services.agent.fence_handle import DETACH
from muster.services.agent.process_runtime import ended_at, exit_file, records, settle
from muster.services.agent.reconcile import Assignments, key_of
from muster.services.agent.reporting import OUTBOX, Reporter, keep
from muster.services.agent.runtime import (
    LABEL_ATTEMPT,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_NODE,
    LABEL_ROLE,
    FoundTask,
    noted_stop,
    stop_note,
)
from muster.services.agent.tasks import LAST_LINES
from muster.shared import bus
from muster.shared.messages import TaskCause, TaskEvent, TaskEventKind, now
from muster.shared.secrets import Masker

# Only a Docker node's fence loads the Docker SDK (and services/agent/docker_runtime.py, which
# imports it): the functions of the docker mode import them where they run.

REASON = "ended as its agent died"
POLL = 0.5  # seconds between the Docker fence's looks for containers that ended while it waits
GIVE_UP = 600.0  # seconds after its agent died that the Docker fence stops asking a failing engine


def _new_agent(pidfile: Path, old: int) -> bool:
    """Whether an agent other than `old` has started on this node and runs."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return False
    return pid != old and Path(f"/proc/{pid}").exists()


def exited(
    labels: dict[str, str],
    code: int,
    at: datetime | None,
    lines: list[str] | None = None,
    oom: bool = False,
    stopped: tuple[TaskCause, str] | None = None,
) -> TaskEvent | None:
    """The report of a task (known by its labels) that ended with exit `code` at `at`: by itself,
    or as the dead agent had `stopped` it (its cause and reason); None when its labels do not
    name a task."""
    if stopped is not None:
        cause, reason = stopped[0], f"{stopped[1]}; {REASON}"
    else:
        cause = TaskCause.OOM if oom else TaskCause.EXITED
        reason = f"out of memory; {REASON}" if oom else REASON
    try:
        return TaskEvent(
            job_id=labels[LABEL_JOB],
            attempt=int(labels[LABEL_ATTEMPT]),
            role=labels[LABEL_ROLE],
            index=int(labels[LABEL_INDEX]),
            node=labels[LABEL_NODE],
            kind=TaskEventKind.EXITED,
            cause=cause,
            exit_code=code,
            reason=reason,
            last_lines=lines or [],
            at=at or now(),
        )
    except (KeyError, ValueError):
        return None


def _fence_processes(state_dir: Path, agent: int) -> tuple[list[TaskEvent], list[Path]]:
    """Kill what is left of the dead agent's tasks (only those: a new agent may already run
    tasks, this fence may read the end of its pipe late on a loaded machine); the reports of
    those that had ended by themselves, and their records."""
    mine = [rec for rec in records(state_dir) if rec.get("agent", agent) == agent]
    codes = [settle(state_dir / f"{rec['name']}.json") for rec in mine]  # all killed first
    events, told = [], []
    for rec, code in zip(mine, codes, strict=True):
        record = state_dir / f"{rec['name']}.json"
        if code is None:  # killed here: the next agent reports it lost
            continue
        at = ended_at(exit_file(record))
        event = exited(rec["labels"], code, datetime.fromtimestamp(at, UTC) if at else None)
        if event is not None:
            events.append(event)
            told.append(record)
    return events, told


def _containers(client: Any, home: str, before: float) -> list[Any]:
    """The task containers of the agent whose work root is `home` (label muster.home) created
    before `before`: never one a newer agent has started since."""
    # ignore_removed: one removed between the listing and its inspection is not an error
    found = client.containers.list(all=True, filters={"label": f"muster.home={home}"}, ignore_removed=True)
    return [c for c in found if _created(c.attrs) < before]


def _container_exited(c: Any, code: int, home: str) -> TaskEvent | None:
    """The report of container `c`, which ended with exit `code`: by itself, or as its agent had
    stopped it (`runtime.stop_note`: a drained or preempted trainer exiting 0 on SIGTERM is not
    told as succeeded)."""
    from muster.services.agent.docker_runtime import finished_at  # Docker nodes only (see above)

    state = c.attrs.get("State") or {}
    oom = bool(state.get("OOMKilled"))
    stopped = None
    with contextlib.suppress(KeyError, ValueError):
        labels = c.labels
        note = stop_note(
            home, labels[LABEL_JOB], int(labels[LABEL_ATTEMPT]), labels[LABEL_ROLE], int(labels[LABEL_INDEX])
        )
        stopped = noted_stop(note)
    return exited(c.labels, code, finished_at(state), _last_lines(c, Path(home)), oom, stopped)


def _exited_containers(client: Any, home: str, before: float) -> dict[str, TaskEvent]:
    """The reports of the dead agent's containers that had ended by themselves, by container
    (left in place: a new agent adopts them, and reads on their output from where the dead one
    stopped reading it)."""
    events = {}
    for c in _containers(client, home, before):
        if c.status == "exited":
            event = _container_exited(c, int((c.attrs.get("State") or {}).get("ExitCode", 0)), home)
            if event is not None:
                events[c.name] = event
    return events


def _remove_containers(
    client: Any,
    home: str,
    before: float,
    told: set[str],
    killed: set[str],
    came: Callable[[], bool] = lambda: False,
) -> list[TaskEvent]:
    """No agent came back: the dead agent's containers that still run are killed and all are
    removed; the reports of those that ended by themselves meanwhile (not `told` yet) are kept
    in the outbox before the containers, which held them, are gone. `killed`: the containers a
    try that failed may have killed (kept across tries: one killed then shows SIGKILL's exit
    code, which is not an exit of its own). `came`: whether a new agent has come, asked before
    each kill: from then on the containers are its to adopt (a sweep of many containers takes
    seconds, and one killed under the new agent's adoption was told as a task's exit 137)."""
    import docker

    from muster.services.agent.docker_runtime import settle_container  # Docker nodes only (see above)

    settled: list[tuple[Any, int | None]] = []
    for c in _containers(client, home, before):
        if came():
            _say("fence.agent_came", left=c.name)
            break
        if c.name in killed:
            settled.append((c, None))
            continue
        killed.add(c.name)  # until it is known to have ended by itself
        with contextlib.suppress(docker.errors.NotFound):
            code = settle_container(c)
            if code is not None:
                killed.discard(c.name)
            settled.append((c, code))
    events = [
        event
        for c, code in settled
        if code is not None and c.name not in told and (event := _container_exited(c, code, home)) is not None
    ]
    _write(Path(home), events)
    for c, _ in settled:
        with contextlib.suppress(docker.errors.NotFound):
            c.remove(force=True)
    return events


def _last_lines(container: Any, home: Path) -> list[str]:
    """What an ended container wrote last, its job's secret values cut out (as its agent would
    have: the job's order, kept on the node, names them); none when the order is not there."""
    key = key_of(FoundTask(container.name, dict(container.labels), False, None))
    order = Assignments(home / "assignments").load(key[0], key[1]) if key else None
    if order is None:
        return []
    try:
        tail = container.logs(stdout=True, stderr=True, tail=LAST_LINES)
    except Exception:
        return []
    mask = Masker.for_env(order.config.jobEnvs, order.secret_names)
    return [mask(line.decode("utf-8", "replace").removesuffix("\r")) for line in tail.splitlines()]


def _created(attrs: dict[str, Any]) -> float:
    return datetime.fromisoformat(attrs["Created"][:26].rstrip("Z") + "+00:00").timestamp()


def _write(home: Path, events: list[TaskEvent]) -> None:
    """Into the outbox, in the order they ended (the policy reads ends in order)."""
    outbox = home / OUTBOX
    outbox.mkdir(parents=True, exist_ok=True)
    for event in sorted(events, key=lambda e: e.at):
        keep(outbox, event)


async def _send(home: Path, timeout: float) -> bool:
    """Publish everything in the agent's outbox within about `timeout` seconds: whether all of
    it went (what did not stays for the next agent)."""
    if not any((home / OUTBOX).glob("*.json")):
        return True
    try:
        nc = await bus.connect("fence", connect_timeout=timeout, quiet=True)
    except Exception as exc:
        print(f"fence: cannot report: {exc}", file=sys.stderr)
        return False
    reporter = Reporter(nc.jetstream(), home / OUTBOX)
    try:
        reporter.start()
        return await reporter.flush(timeout)
    finally:
        await reporter.close()
        with contextlib.suppress(Exception):
            await nc.close()


def report(home: Path, events: list[TaskEvent], timeout: float) -> bool:
    """Keep `events` in the agent's outbox, then send the outbox."""
    _write(home, events)
    return asyncio.run(_send(home, timeout))


def _fence_docker(
    home: str,
    pidfile: Path,
    wait: float,
    agent: int,
    died: float,
    timeout: float,
    engine: Callable[[], Any] | None = None,
) -> None:
    """Report the dead agent's containers that had ended at once, and those that end while it
    waits as they end; then, if no new agent has come within `wait` seconds, stop and remove
    them all. A new agent writes its pid file before
    it adopts or starts anything: once there is one, everything is its to do.

    A look the engine fails (it restarts, it times out, it is not up yet) is logged and made
    again `POLL` seconds later, the removal too, until `GIVE_UP` seconds after the agent died:
    a fence that ended at the first error left the dead agent's tasks running beside whatever
    the node ran next. `engine`: how to reach it (the tests' seam)."""
    import docker

    connect = engine or (lambda: docker.from_env(timeout=10))
    client: Any = None
    told: dict[str, TaskEvent] = {}
    killed: set[str] = set()
    failures = 0
    try:
        while not _new_agent(pidfile, agent):
            left = died + wait - time.time()
            try:
                client = client or connect()
                # What ends while the fence waits is reported as it ends (every POLL seconds),
                # not once the wait is over: the node may be declared lost soon after the wait,
                # and a report that comes after that changes nothing.
                found = _exited_containers(client, home, died)
                new = {k: e for k, e in found.items() if k not in told and k not in killed}
                if new:
                    report(Path(home), list(new.values()), timeout)
                    _say("fence.reported", agent=agent, tasks=sorted(new))
                    told |= new
                if left <= 0:
                    came = functools.partial(_new_agent, pidfile, agent)
                    removed = _remove_containers(client, home, died, set(told), killed, came)
                    _say("fence.removed_containers", agent=agent, waited=wait, reported=len(removed))
                    return
            except Exception as exc:  # whatever the engine said, look again
                failures += 1
                error = f"{type(exc).__name__}: {exc}"
                _say("fence.look_failed", agent=agent, failures=failures, error=error)
                if time.time() - died > GIVE_UP:
                    _say("fence.gave_up", agent=agent, after_s=round(time.time() - died))
                    return
                _close(client)
                client = None
            time.sleep(POLL if left <= 0 else min(POLL, left))
    finally:
        _close(client)


def _close(client: Any) -> None:
    """Let a Docker client go (a failed one is made again at the next look)."""
    if client is not None:
        with contextlib.suppress(Exception):
            client.close()


def _say(event: str, **fields: Any) -> None:
    """One JSON line on stderr (the agent's log), as the services log."""
    print(json.dumps({"service": "fence", **fields, "event": event}), file=sys.stderr, flush=True)


def main(argv: list[str]) -> None:
    mode, agent, args = argv[0], int(argv[1]), argv[2:]
    said = b""
    while chunk := sys.stdin.buffer.read(64):
        said += chunk
    if DETACH in said:
        return
    died = time.time()
    timeout = float(os.environ.get("MUSTER_NODE_TIMEOUT", "5"))
    if mode == "process":
        home = Path(args[0])
        events, told = _fence_processes(Path(args[1]), agent)
        if events:
            _say("fence.reported", agent=agent, tasks=[r.stem for r in told])
        if report(home, events, timeout):
            for record in told:  # on the bus: a new agent has nothing more to say of them
                record.with_suffix(".exit").unlink(missing_ok=True)
                record.unlink(missing_ok=True)
    elif mode == "docker":
        root, pidfile, wait = args[0], Path(args[1]), float(args[2])
        try:
            _fence_docker(root, pidfile, wait, agent, died, timeout)
        finally:  # whatever the engine did, what the agent left unsent goes
            asyncio.run(_send(Path(root), timeout))


if __name__ == "__main__":
    main(sys.argv[1:])
