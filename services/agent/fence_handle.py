"""The agent's side of its fence (services/agent/fence.py, which see): start it, stand it down,
let it act. Apart from the fence process's own code so that the runtimes that start a fence
import only this, and the fence process may import the runtimes (no circle)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

DETACH = b"detach\n"


def start_fence(mode: str, *args: str, bus_url: str = "") -> subprocess.Popen[bytes]:
    """The fence of this process (the agent); `bus_url`: where the agent is connected (the
    fence reports there, as the agent)."""
    return subprocess.Popen(
        # The agent's pid, not the fence's parent when it starts: on a loaded machine the
        # agent may die before the fence has started.
        [sys.executable, "-m", "muster.services.agent.fence", mode, str(os.getpid()), *args],
        stdin=subprocess.PIPE,
        start_new_session=True,  # a signal to the agent's process group does not reach it
        env={**os.environ, "MUSTER_NATS_URL": bus_url} if bus_url else None,
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
