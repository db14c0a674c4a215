"""The fence of the process runtime: `python -m services.agent.fence STATE_DIR`, started by the
agent with a pipe on its standard input. When the pipe closes — the agent exited or was killed,
SIGKILL included — it kills every task recorded in STATE_DIR, so no task outlives its agent and
runs beside the attempt that replaces it."""

from __future__ import annotations

import sys
from pathlib import Path

from services.agent.process_runtime import kill_task, records


def main(state_dir: str) -> None:
    while sys.stdin.buffer.read(4096):
        pass  # nothing is ever written: only the end of the pipe matters
    for rec in records(Path(state_dir)):
        kill_task(rec["name"])


if __name__ == "__main__":
    main(sys.argv[1])
