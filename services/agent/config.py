"""Agent settings from flags and MUSTER_AGENT_* variables, shared by `python -m muster.services.agent`
and the local agent of `muster up`, and the choice of runtime."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
from pathlib import Path

import structlog
from nats.aio.client import Client as NATS

from muster.services.agent.inventory import (
    discover_gpus,
    machine_address,
    machine_cpus,
    machine_memory_mb,
    parse_gpus,
    parse_port_range,
)
from muster.services.agent.runtime import Runtime
from muster.services.agent.service import AgentOptions, default_node_name
from muster.shared.messages import GpuSharing
from muster.shared.service import Service, serve_health

log = structlog.get_logger(service="agent")


# ------------------------------------------------------------------ node name


def compose_replica() -> int | None:
    """This process's replica number when it runs in a container that Compose created (its
    `com.docker.compose.container-number` label, read through the Docker socket); else None."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    # A container's /etc/hostname, /etc/hosts and /etc/resolv.conf come from the engine's
    # containers/<id>/ directory, on the host network too (where the host name is the host's).
    found = re.search(r"/containers/([0-9a-f]{64})/(?:hostname|hosts|resolv\.conf)\s", mounts)
    if not found:
        return None
    try:
        import docker

        client = docker.from_env(timeout=5)
        try:
            labels = client.containers.get(found.group(1)).labels
        finally:
            client.close()
    except Exception as exc:  # no socket, no permission: not a replica we can tell apart
        log.warning("agent.compose_replica_unknown", error=str(exc) or type(exc).__name__)
        return None
    number = str(labels.get("com.docker.compose.container-number", ""))
    return int(number) if number.isdigit() else None


def node_name(given: str | None) -> str:
    """The node name: `given` (--node / MUSTER_AGENT_NODE), else the host name. Replica N > 1 of
    a Compose service gets `-N` appended: `--scale agent=3` on one host (host network, so one
    host name) registers <name>, <name>-2 and <name>-3, and each keeps its name across restarts
    and re-creations, so a restarted replica adopts its own tasks."""
    name = given or default_node_name()
    replica = compose_replica()
    return f"{name}-{replica}" if replica and replica > 1 else name


# ------------------------------------------------------------------ metrics port


def metrics_ports(flag: int | None) -> tuple[int, int]:
    """The agent's /healthz and /metrics port(s), (0, 0) for none: --metrics-port N, else
    MUSTER_AGENT_METRICS_PORT (N, or LOW-HIGH: the first port of the range free to bind, so
    agents scaled on one host network each take their own), else MUSTER_METRICS_PORT."""
    if flag is not None:
        text = str(flag)
    else:
        text = os.environ.get("MUSTER_AGENT_METRICS_PORT") or os.environ.get("MUSTER_METRICS_PORT") or "0"
    try:
        low, high = parse_port_range(text.strip())
    except ValueError:
        raise SystemExit(f"metrics port {text!r}: use N, LOW-HIGH, or 0 for none") from None
    if low == 0 and high == 0:
        return 0, 0
    if not 0 < low <= high < 65536:
        raise SystemExit(f"metrics port {text!r}: use N, LOW-HIGH, or 0 for none")
    return low, high


async def serve_health_in_range(
    nc: NATS, low: int, high: int, port_file: str | None = None
) -> tuple[asyncio.base_events.Server, int]:
    """Serve /healthz and /metrics on the first port of [low, high] that binds; write the port to
    `port_file` (for a healthcheck that must find it). Binding is the test, so agents starting
    together never pick the same port."""
    for port in range(low, high + 1):
        try:
            server = await serve_health("agent", nc, port)
        except OSError:
            continue
        if port_file:
            _write_port_file(port_file, port)
        log.info("agent.metrics", port=port)
        return server, port
    raise RuntimeError(f"no free metrics port in {low}-{high}")


class WithHealth:
    """A service plus the health endpoint it owns: closed when the service ends."""

    def __init__(self, service: Service, server: asyncio.base_events.Server) -> None:
        self.service, self.server = service, server

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self.service.run(stop)
        finally:
            self.server.close()


def _write_port_file(port_file: str, port: int) -> None:
    tmp = f"{port_file}.tmp"
    Path(tmp).write_text(f"{port}\n")
    os.replace(tmp, port_file)


def clear_port_file(port_file: str | None) -> None:
    """A restarted container must not report the port its previous process had."""
    if port_file:
        with contextlib.suppress(OSError):
            os.unlink(port_file)


# ------------------------------------------------------------------ options


def check_sim_flags(args: argparse.Namespace) -> None:
    """--sim-nodes is for --runtime sim only: a real agent is one node."""
    nodes = getattr(args, "sim_nodes", 1)
    if nodes != 1 and args.runtime != "sim":
        raise SystemExit(f"--sim-nodes {nodes}: only with --runtime sim (a real agent is one node)")


def options_from_args(args: argparse.Namespace, data_dir: str = "/tmp/muster") -> AgentOptions:
    node = node_name(args.node)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", node):
        raise SystemExit(f"--node {node!r}: use letters, digits, '_' and '-'")
    declared = args.gpus is not None
    try:
        gpus = parse_gpus(args.gpus) if declared else discover_gpus() or []
    except ValueError as exc:
        raise SystemExit(f"--gpus {args.gpus!r}: {exc}") from None
    low, high = parse_port_range(args.ports)
    check_task_settings(args)
    check_sim_flags(args)
    check_network(args)
    check_output_limits()
    sharing = check_gpu_sharing(args)
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
        heartbeat=args.heartbeat or 2.0,
        overcommit=args.overcommit,
        data_roots=data_roots(args.data_roots, data_dir),
        task_user=args.task_user,
        pids_limit=args.pids_limit,
        gpu_sharing=sharing,
    )


def check_gpu_sharing(args: argparse.Namespace) -> GpuSharing:
    """--gpu-sharing (MUSTER_AGENT_GPU_SHARING): mps is refused at start where the MPS control
    binary is missing, rather than failing every shared task later."""
    text = getattr(args, "gpu_sharing", "timeslice") or "timeslice"
    try:
        sharing = GpuSharing(text)
    except ValueError:
        raise SystemExit(f"--gpu-sharing {text!r}: use timeslice or mps") from None
    if sharing is GpuSharing.MPS and args.runtime != "sim":
        from muster.services.agent.gpushare import mps_available

        why = mps_available()
        if why is not None:
            raise SystemExit(f"--gpu-sharing mps: {why}")
    return sharing


def check_output_limits() -> None:
    """MUSTER_TASK_LOG_* and MUSTER_TASK_OUTPUT_MAX_BYTES (services/agent/output.py), refused
    when the agent starts rather than at a task's first line."""
    from muster.services.agent.output import OutputLimits

    try:
        OutputLimits.from_env()
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def check_task_settings(args: argparse.Namespace) -> None:
    """--task-user, --pids-limit and --task-caps, refused when the agent starts rather than at
    every container create."""
    user = getattr(args, "task_user", "auto")
    if user not in ("auto", "root") and not re.fullmatch(
        r"[A-Za-z0-9_][A-Za-z0-9_.-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]*)?", user
    ):
        raise SystemExit(f"--task-user {user!r}: use auto, root, UID[:GID] or NAME[:GROUP]")
    pids = getattr(args, "pids_limit", 4096)
    if pids < 1:  # the engine reads 0 and -1 as no limit at all
        raise SystemExit(f"--pids-limit {pids}: must be at least 1")
    task_caps(getattr(args, "task_caps", None))


def docker_network(text: str | None) -> str:
    """--docker-network / MUSTER_DOCKER_NETWORK checked (default host)."""
    from muster.services.agent.docker_runtime import NETWORK_HOST, parse_network

    if text is None:
        return NETWORK_HOST
    try:
        return parse_network(text)
    except ValueError as exc:
        raise SystemExit(f"--docker-network (MUSTER_DOCKER_NETWORK) {exc}") from None


def check_network(args: argparse.Namespace) -> None:
    """A --docker-network other than host is for Docker tasks only, and needs --address: the
    address tasks are reached at is that namespace's, not this machine's."""
    network = docker_network(getattr(args, "docker_network", None))
    if network == "host":
        return
    if args.runtime not in ("docker", "auto"):
        raise SystemExit(
            f"--docker-network {network}: only with --runtime docker "
            f"(--runtime {args.runtime} runs tasks in the agent's own network)"
        )
    if not args.address:
        raise SystemExit(
            f"--docker-network {network}: give --address (MUSTER_AGENT_ADDRESS), the address tasks "
            "are reached at in that container's network; this machine's own is not it"
        )


def task_caps(text: str | None) -> tuple[str, ...] | None:
    """--task-caps parsed (None: the default, TASK_CAPS)."""
    if text is None:
        return None
    from muster.services.agent.docker_runtime import parse_caps

    try:
        return parse_caps(text)
    except ValueError as exc:
        raise SystemExit(f"--task-caps: {exc}") from None


def data_roots(text: str | None, data_dir: str) -> list[str]:
    from muster.shared.hostpaths import RootsError, parse_roots

    if not text:
        return [os.path.join(os.path.abspath(data_dir), "users", "{user}")]
    try:
        return parse_roots(text)
    except RootsError as exc:
        raise SystemExit(f"--data-roots: {exc}") from None


def make_runtime(
    choice: str,
    state_dir: str | None = None,
    task_user: str = "auto",
    pids_limit: int = 4096,
    caps: str | None = None,
    network: str | None = None,
    address: str | None = None,
) -> Runtime:
    """The runtime `choice` names; task_user, pids_limit and caps (--task-caps text, None for the
    default) harden Docker's containers. The process runtime cannot apply them: its tasks run
    as the agent's user, with its capabilities and no limits (see process_runtime). `network`
    (--docker-network, None: host) is where Docker's tasks are networked; with container:NAME,
    NAME must be a container of the engine, and `address` (--address) should be one of its."""
    from muster.services.agent.process_runtime import ProcessRuntime

    if choice == "sim":
        from muster.services.agent.sim_runtime import SimRuntime

        return SimRuntime()
    if choice in ("auto", "docker"):
        from muster.services.agent.docker_runtime import DockerRuntime

        tasks_network = docker_network(network)
        if DockerRuntime.available():
            runtime = DockerRuntime(
                task_user=task_user, pids_limit=pids_limit, caps=task_caps(caps), network=tasks_network
            )
            try:
                addresses = runtime.network_addresses()
            except ValueError as exc:
                raise SystemExit(f"--docker-network {tasks_network}: {exc}") from None
            if tasks_network != "host" and address not in addresses:
                log.warning(
                    "agent.address_not_in_task_network",
                    address=address,
                    network=tasks_network,
                    addresses=addresses,
                    detail="peers reach tasks at --address: give one of the container's addresses "
                    "(none: it is not running yet, or has no network)",
                )
            return runtime
        if choice == "docker":
            raise SystemExit("--runtime docker: no Docker engine answers")
        if tasks_network != "host":
            raise SystemExit(
                f"--docker-network {tasks_network}: no Docker engine answers, and the process "
                "runtime runs tasks in the agent's own network"
            )
        log.warning("agent.no_docker", detail="no Docker engine answers: using the process runtime")
    return ProcessRuntime(state_dir)
