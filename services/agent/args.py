"""The agent's flags (and their MUSTER_AGENT_* variables), shared by `python -m muster.services.agent` and
`muster up`. Only argparse here: the CLI builds its parser from this without importing the agent."""

from __future__ import annotations

import argparse
import os


def add_agent_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument(
        "--node",
        default=env("MUSTER_AGENT_NODE"),
        help="node name (default: host name); replica N > 1 of a Compose service appends -N",
    )
    p.add_argument("--address", default=env("MUSTER_AGENT_ADDRESS"), help="address peers reach tasks at")
    p.add_argument(
        "--gpus",
        default=env("MUSTER_AGENT_GPUS") or None,  # set but empty (compose's default): discover
        help="declared GPUs, e.g. 8xV100 or 4xV100,2xT4 (default: discovered through NVML, else none)",
    )
    p.add_argument("--cpus", type=int, default=env("MUSTER_AGENT_CPUS"), help="CPUs to offer")
    p.add_argument(
        "--memory-mb", type=int, default=env("MUSTER_AGENT_MEMORY_MB"), help="memory (MB) to offer"
    )
    p.add_argument(
        "--gpu-devices",
        choices=("auto", "on", "off"),
        default=env("MUSTER_AGENT_GPU_DEVICES", "auto"),
        help="request GPU devices from Docker (auto: only for GPUs discovered through NVML)",
    )
    p.add_argument(
        "--gpu-sharing",
        choices=("timeslice", "mps"),
        default=env("MUSTER_AGENT_GPU_SHARING", "timeslice"),
        help="how tasks holding part of one GPU share it: timeslice (the same device, not isolated) or "
        "mps (NVIDIA MPS: each task's thread percentage and pinned memory limit from its share; needs "
        "nvidia-cuda-mps-control), see docs/gpus.md",
    )
    p.add_argument(
        "--runtime",
        choices=("auto", "docker", "process", "sim"),
        default=env("MUSTER_AGENT_RUNTIME", "auto"),
        help="auto: docker when an engine answers, else process; sim: simulated nodes for benchmarks "
        "(tasks only wait, see --sim-nodes)",
    )
    p.add_argument(
        "--sim-nodes",
        type=int,
        default=int(env("MUSTER_SIM_NODES", "1")),
        help="with --runtime sim: how many simulated nodes this process holds, named NODE-00000.. "
        "(--node is the prefix, default sim; defaults --gpus 8xV100 --cpus 64 --memory-mb 262144)",
    )
    p.add_argument("--ports", default=env("MUSTER_AGENT_PORTS", "5000-10000"), help="port range for tasks")
    p.add_argument("--work-root", default=env("MUSTER_AGENT_WORK_ROOT"), help="per-task scratch directories")
    p.add_argument(
        "--output-root", default=env("MUSTER_OUTPUT_ROOT"), help="outputDir default: ROOT/<jobName>"
    )
    p.add_argument("--default-fs-uri", default=env("MUSTER_DEFAULT_FS_URI", ""), help="PAI_DEFAULT_FS_URI")
    p.add_argument(
        "--heartbeat",
        type=float,
        default=float(env("MUSTER_AGENT_HEARTBEAT") or 0) or None,
        help="seconds between a node's heartbeats (default 2; sim: N/250, at least 2: 250 beats a second)",
    )
    p.add_argument(
        "--data-roots",
        default=env("MUSTER_DATA_ROOTS"),
        help="where jobs' dataDir/codeDir/outputDir/authFile may point: absolute dirs, comma-separated; "
        "{user} is the submitter (default: DATA_DIR/users/{user})",
    )
    p.add_argument(
        "--task-user",
        default=env("MUSTER_TASK_USER", "auto"),
        help="Docker: the user tasks run as: auto (the image's non-root USER, else 1000:1000), UID[:GID], "
        "or root",
    )
    p.add_argument(
        "--pids-limit",
        type=int,
        default=int(env("MUSTER_TASK_PIDS_LIMIT", "4096")),
        help="Docker: most processes in one task's container",
    )
    p.add_argument(
        "--task-caps",
        default=env("MUSTER_TASK_CAPS"),
        help="Docker: the capabilities a task keeps, comma-separated (all others dropped; default: "
        "CHOWN,DAC_OVERRIDE,FOWNER,SETUID,SETGID,KILL, see services/agent/docker_runtime.py)",
    )
    p.add_argument(
        "--docker-network",
        default=env("MUSTER_DOCKER_NETWORK", "host"),
        help="Docker: the network namespace tasks run in: host (default), or container:NAME, a running "
        "container's (e.g. one per simulated host on a bridge network; give its address as --address)",
    )
    p.add_argument(
        "--overcommit",
        action="store_true",
        default=env("MUSTER_AGENT_OVERCOMMIT", "") in ("1", "true", "yes"),
        help="offer more CPUs/memory than the Docker engine has (tasks share them; each gets at most all)",
    )
