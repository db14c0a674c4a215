"""The fence: no task outlives its agent for long enough to run beside its replacement.

The agent starts it (`start_fence`) with a pipe on its standard input and writes nothing to it
until it stops: `detach` when it stops for a restart on purpose (its tasks are to be adopted),
nothing otherwise. When the pipe closes without `detach` — the agent crashed or was SIGKILLed —
the fence acts before the node can be declared lost (MUSTER_NODE_TIMEOUT):
- process runtime: it kills every recorded task at once (a process cannot be adopted);
- docker runtime: it waits a little for a new agent (a quick restart adopts the containers),
  and removes the node's task containers if none has come, so the new agent, whenever it comes,
  reports them lost rather than finding them killed by no one.

    python -m services.agent.fence process STATE_DIR
    python -m services.agent.fence docker HOME PIDFILE WAIT_SECONDS
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

DETACH = b"detach\n"


def start_fence(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "services.agent.fence", *args],
        stdin=subprocess.PIPE,
        start_new_session=True,  # a signal to the agent's process group does not reach it
    )


def detach(fence: subprocess.Popen[bytes] | None) -> None:
    """The agent stops on purpose and its tasks are to be adopted: stand down."""
    if fence is not None and fence.stdin is not None:
        with contextlib.suppress(OSError):
            fence.stdin.write(DETACH)
            fence.stdin.flush()


def close(fence: subprocess.Popen[bytes] | None) -> None:
    if fence is not None and fence.stdin is not None:
        with contextlib.suppress(OSError):
            fence.stdin.close()


def _new_agent(pidfile: Path, old: int) -> bool:
    """Whether an agent other than `old` has started on this node and runs."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return False
    return pid != old and Path(f"/proc/{pid}").exists()


def _remove_containers(home: str, before: float) -> None:
    """The task containers of the agent whose work root is `home` (label muster.home) created
    before `before`: never one a newer agent has started since."""
    import docker

    client = docker.from_env(timeout=10)
    try:
        for c in client.containers.list(all=True, filters={"label": f"muster.home={home}"}):
            created = datetime.fromisoformat(c.attrs["Created"][:26].rstrip("Z") + "+00:00").timestamp()
            if created < before:
                with contextlib.suppress(docker.errors.DockerException):
                    c.remove(force=True)
    finally:
        client.close()


def main(argv: list[str]) -> None:
    agent = os.getppid()
    said = b""
    while chunk := sys.stdin.buffer.read(64):
        said += chunk
    if DETACH in said:
        return
    died = time.time()
    if argv[0] == "process":
        from services.agent.process_runtime import kill_task, records

        # Only what the dead agent started: a new agent may already run tasks (this fence may
        # read the end of its pipe late, on a loaded machine).
        for rec in records(Path(argv[1])):
            if rec.get("agent", agent) == agent:
                kill_task(rec["name"])
    elif argv[0] == "docker":
        home, pidfile, wait = argv[1], Path(argv[2]), float(argv[3])
        time.sleep(wait)
        # A new agent writes its pid file before it adopts or starts anything.
        if not _new_agent(pidfile, agent):
            _remove_containers(home, died)


if __name__ == "__main__":
    main(sys.argv[1:])
