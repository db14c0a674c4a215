"""Agent settings from flags and MUSTER_AGENT_* variables, shared by `python -m services.agent`
and the local agent of `muster up`, and the choice of runtime."""

from __future__ import annotations

import argparse
import os
import re

import structlog

from services.agent.inventory import (
    discover_gpus,
    machine_address,
    machine_cpus,
    machine_memory_mb,
    parse_gpus,
    parse_port_range,
)
from services.agent.runtime import Runtime
from services.agent.service import AgentOptions, default_node_name

log = structlog.get_logger(service="agent")


def add_agent_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument("--node", default=env("MUSTER_AGENT_NODE"), help="node name (default: host name)")
    p.add_argument("--address", default=env("MUSTER_AGENT_ADDRESS"), help="address peers reach tasks at")
    p.add_argument(
        "--gpus",
        default=env("MUSTER_AGENT_GPUS"),
        help="declared GPUs, e.g. 8xV100 or 4xV100,2xT4 (default: discovered through NVML, else none)",
    )
    p.add_argument("--cpus", type=int, default=_int(env("MUSTER_AGENT_CPUS")), help="CPUs to offer")
    p.add_argument(
        "--memory-mb", type=int, default=_int(env("MUSTER_AGENT_MEMORY_MB")), help="memory (MB) to offer"
    )
    p.add_argument(
        "--gpu-devices",
        choices=("auto", "on", "off"),
        default=env("MUSTER_AGENT_GPU_DEVICES", "auto"),
        help="request GPU devices from Docker (auto: only for GPUs discovered through NVML)",
    )
    p.add_argument(
        "--runtime",
        choices=("auto", "docker", "process"),
        default=env("MUSTER_AGENT_RUNTIME", "auto"),
        help="auto: docker when an engine answers, else process",
    )
    p.add_argument("--ports", default=env("MUSTER_AGENT_PORTS", "5000-10000"), help="port range for tasks")
    p.add_argument("--work-root", default=env("MUSTER_AGENT_WORK_ROOT"), help="per-task scratch directories")
    p.add_argument(
        "--output-root", default=env("MUSTER_OUTPUT_ROOT"), help="outputDir default: ROOT/<jobName>"
    )
    p.add_argument("--default-fs-uri", default=env("MUSTER_DEFAULT_FS_URI", ""), help="PAI_DEFAULT_FS_URI")
    p.add_argument("--heartbeat", type=float, default=float(env("MUSTER_AGENT_HEARTBEAT", "2")))
    p.add_argument(
        "--overcommit",
        action="store_true",
        default=env("MUSTER_AGENT_OVERCOMMIT", "") in ("1", "true", "yes"),
        help="offer more CPUs/memory than the Docker engine has (tasks share them; each gets at most all)",
    )


def _int(value: str | None) -> int | None:
    return int(value) if value else None


def options_from_args(args: argparse.Namespace, data_dir: str = "/tmp/muster") -> AgentOptions:
    node = args.node or default_node_name()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", node):
        raise SystemExit(f"--node {node!r}: use letters, digits, '_' and '-'")
    declared = args.gpus is not None
    gpus = parse_gpus(args.gpus) if declared else discover_gpus() or []
    low, high = parse_port_range(args.ports)
    return AgentOptions(
        node=node,
        address=args.address or machine_address(),
        cpus=args.cpus or machine_cpus(),
        memory_mb=args.memory_mb or machine_memory_mb(),
        gpus=gpus,
        gpu_devices=not declared if args.gpu_devices == "auto" else args.gpu_devices == "on",
        port_low=low,
        port_high=high,
        work_root=args.work_root or os.path.join(data_dir, "work", node),
        output_root=args.output_root or os.path.join(data_dir, "output"),
        default_fs_uri=args.default_fs_uri,
        heartbeat=args.heartbeat,
        overcommit=args.overcommit,
    )


def make_runtime(choice: str, state_dir: str | None = None) -> Runtime:
    from services.agent.process_runtime import ProcessRuntime

    if choice in ("auto", "docker"):
        from services.agent.docker_runtime import DockerRuntime

        if DockerRuntime.available():
            return DockerRuntime()
        if choice == "docker":
            raise SystemExit("--runtime docker: no Docker engine answers")
        log.warning("agent.no_docker", detail="no Docker engine answers: using the process runtime")
    return ProcessRuntime(state_dir)
