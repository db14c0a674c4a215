import os
from collections.abc import Awaitable, Callable

import structlog
from nats.aio.client import Client as NATS

from muster.services.agent import sim
from muster.services.agent.args import add_agent_arguments
from muster.services.agent.config import (
    WithHealth,
    clear_port_file,
    make_runtime,
    metrics_ports,
    options_from_args,
    serve_health_in_range,
)
from muster.services.agent.service import Agent, AgentOptions
from muster.shared import auth, bus
from muster.shared.service import Service, base_parser, run_main

if __name__ == "__main__":
    parser = base_parser("Muster node agent: runs the tasks placed on this machine.")
    add_agent_arguments(parser)
    # Unset, the port comes from MUSTER_AGENT_METRICS_PORT (a port or a range), see metrics_ports.
    parser.set_defaults(metrics_port=None)
    args = parser.parse_args()
    low, high = metrics_ports(args.metrics_port)
    args.metrics_port = 0  # served below, on the first free port of low-high
    port_file = os.environ.get("MUSTER_AGENT_METRICS_PORT_FILE") or None
    clear_port_file(port_file)
    data_dir = os.environ.get("MUSTER_DATA_DIR", "/tmp/muster")

    served: list[AgentOptions] = []  # the agent's options, told the metrics port once it is bound

    def agent_builder() -> Callable[[NATS], Awaitable[Service]]:
        options = options_from_args(args, data_dir)
        served.append(options)
        # A directory of credentials (compose's demo agents): this node's own identity.
        creds_dir = os.environ.get("MUSTER_CREDENTIALS_DIR")
        if creds_dir and not os.environ.get("MUSTER_CREDENTIALS"):
            os.environ["MUSTER_CREDENTIALS"] = os.path.join(creds_dir, f"agent-{options.node}.creds")
        return Agent.builder(
            options,
            make_runtime(
                args.runtime,
                os.path.join(options.work_root, "tasks"),
                options.task_user,
                options.pids_limit,
                args.task_caps,
                args.docker_network,
                options.address,
            ),
        )

    def sim_builder() -> Callable[[NATS], Awaitable[Service]]:
        """Many simulated nodes on one connection, as the one sim identity (services/agent/sim.py)."""
        setup = sim.setup_from_args(args, data_dir)
        creds_dir = os.environ.get("MUSTER_CREDENTIALS_DIR")
        if creds_dir and not os.environ.get("MUSTER_CREDENTIALS"):
            os.environ["MUSTER_CREDENTIALS"] = os.path.join(creds_dir, f"{auth.SIM_IDENTITY}.creds")
        log = structlog.get_logger(service="sim")
        log.info("sim.nodes", nodes=setup.describe())
        if sim.node_timeout_for(setup.heartbeat) > bus.node_timeout():
            log.warning(
                "sim.node_timeout_too_short",
                heartbeat=setup.heartbeat,
                node_timeout=bus.node_timeout(),
                detail=f"give the scheduler and supervisor MUSTER_NODE_TIMEOUT="
                f"{sim.node_timeout_for(setup.heartbeat):g} or more, or these nodes come and go",
            )
        return setup.builder()

    def build():
        build_agent = sim_builder() if args.runtime == "sim" else agent_builder()

        async def build_with_health(nc: NATS) -> Service:
            if not low:
                return await build_agent(nc)
            server, port = await serve_health_in_range(nc, low, high, port_file)
            for options in served:
                options.metrics_port = port
            try:
                return WithHealth(await build_agent(nc), server)
            except BaseException:
                server.close()
                raise

        return build_with_health

    run_main("agent", build, args)
