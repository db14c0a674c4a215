"""`muster up`: the local agent's flags checked, then every service, an embedded NATS and a
local agent (or simulated nodes) in this process (the mesh itself: mesh.py)."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING

from muster.services.cli.console import EXIT_INVALID, CliError, err, out
from muster.services.cli.render import gpu_text
from muster.shared import auth, bus, logs

# The models (pydantic), the mesh (mesh.py: the services) and the agent's modules are imported
# where a command needs them, not here: most commands need few of them, and importing them is
# most of a start-up otherwise (docs/BENCHMARKS.md; tests/test_cli.py checks `submit`).
if TYPE_CHECKING:
    from muster.services.agent.sim import SimSetup


def check_agent_flags(args: argparse.Namespace) -> None:
    """The local agent's flags, refused before anything starts."""
    from muster.services.agent.inventory import parse_gpus, parse_port_range

    if args.gpus is not None:
        try:
            parse_gpus(args.gpus)
        except ValueError as exc:
            raise CliError(f"--gpus {args.gpus!r}: {exc}", EXIT_INVALID) from None
    try:
        low, high = parse_port_range(args.ports)
    except ValueError:
        low = high = 0
    if not 1 <= low <= high <= 65535:
        raise CliError(
            f"--ports {args.ports!r}: expected LOW-HIGH within 1-65535, e.g. 5000-10000", EXIT_INVALID
        )
    for flag, value in (("--cpus", args.cpus), ("--memory-mb", args.memory_mb)):
        if value is not None and value < 1:
            raise CliError(f"{flag} {value}: must be ≥ 1", EXIT_INVALID)


def cmd_up(args: argparse.Namespace) -> int:
    """`muster up`; a bad flag the agent's settings refuse (a SystemExit with its line) is exit
    2, and a data dir it cannot use (not writable, a file) one line, not a traceback."""
    try:
        return _up(args)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            raise CliError(exc.code, EXIT_INVALID) from None
        raise
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise CliError(f"cannot run here: {exc.strerror or exc}{where}") from None


def _up(args: argparse.Namespace) -> int:
    from muster.services.agent.config import make_runtime, options_from_args
    from muster.services.agent.service import Agent
    from muster.services.cli.mesh import default_data_dir, up
    from muster.shared.service import tune_gc

    check_agent_flags(args)
    logs.configure("muster")
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    if not args.data_roots:
        # Jobs may mount what is under the directory `muster up` runs in (a config next to its
        # code: "codeDir": "./") and each user's own dir in the data dir.
        here = os.getcwd()
        roots = [] if here == "/" else [here]
        args.data_roots = ",".join([*roots, str(data_dir.absolute() / "users" / "{user}")])
    os.environ["MUSTER_DATA_ROOTS"] = args.data_roots  # the validator's too
    sim = None
    if args.runtime == "sim" and not args.no_agent:
        sim = sim_setup(args, str(data_dir))
    options = None if args.no_agent or sim else options_from_args(args, str(data_dir))

    def agent(metrics_port: int | None):
        if sim is not None:
            out(f"muster: {sim.describe()}")
            return sim.builder()
        assert options is not None
        options.metrics_port = metrics_port  # this process's /metrics, which has the agent's
        out(
            f"muster: local agent {options.node} at {options.address}: {options.cpus} CPUs, "
            f"{options.memory_mb} MB, GPUs: {gpu_text(options.gpus)}"
        )
        return Agent.builder(
            options,
            make_runtime(
                args.runtime,
                str(Path(options.work_root) / "tasks"),
                options.task_user,
                options.pids_limit,
                args.task_caps,
                args.docker_network,
                options.address,
            ),
        )

    tune_gc()  # a long-running process of services, as `python -m muster.services.<name>` is
    try:
        return asyncio.run(
            up(
                data_dir,
                args.port,
                lambda s: out(f"muster: {s}"),
                None if options is None and sim is None else agent,
                node=sim.prefix if sim else (options.node if options else None),
                open_bus=args.open,
                sim=sim is not None,
                metrics_port=args.metrics_port,
                portal_port=args.portal_port,
            )
        )
    except (RuntimeError, TimeoutError, ConnectionError, FileNotFoundError, auth.AuthError) as exc:
        raise CliError(str(exc)) from None


def sim_setup(args: argparse.Namespace, data_dir: str) -> SimSetup:
    """`--runtime sim`: the simulated nodes, and a node timeout the mesh's scheduler and
    supervisor (in this process) give their heartbeat period (services/agent/sim.py)."""
    from muster.services.agent import sim

    try:
        setup = sim.setup_from_args(args, data_dir)
    except SystemExit as exc:
        raise CliError(str(exc), EXIT_INVALID) from None
    timeout = sim.node_timeout_for(setup.heartbeat)
    if timeout > bus.node_timeout():
        if "MUSTER_NODE_TIMEOUT" in os.environ:
            err(
                f"muster: MUSTER_NODE_TIMEOUT={bus.node_timeout():g} is short for nodes beating every "
                f"{setup.heartbeat:g}s: they will come and go (give {timeout:g} or more)"
            )
        else:
            os.environ["MUSTER_NODE_TIMEOUT"] = f"{timeout:g}"
            out(f"muster: MUSTER_NODE_TIMEOUT={timeout:g}: nodes beat every {setup.heartbeat:g}s")
    return setup


async def cmd_ui(args: argparse.Namespace) -> int:
    """`muster ui`: the web portal for this machine's person, on 127.0.0.1, acting with the
    credentials the CLI uses (as `kubectl proxy` does); a one-time link signs the browser in."""
    import signal

    from muster.services.cli.connect import connect
    from muster.services.portal.app import serve
    from muster.services.portal.service import DEFAULT_PORT, local_portal
    from muster.shared.natsserver import free_port

    nc = await connect(args.connect_timeout)
    creds, url = bus.identity(nc), bus.nats_url()
    await nc.close()
    if args.port is not None and not 1 <= args.port <= 65535:
        raise CliError(f"--port {args.port}: expected 1-65535", EXIT_INVALID)
    port = args.port or free_port(DEFAULT_PORT)
    portal, token = local_portal(url, creds)
    try:
        runner = await serve(portal, "127.0.0.1", port)
    except OSError as exc:
        raise CliError(f"cannot serve on 127.0.0.1:{port}: {exc.strerror or exc}") from None
    who = creds.name if creds else "anyone (an open bus)"
    out(f"muster: the portal, signed in as {who}: http://127.0.0.1:{port}/jobs?token={token}")
    out("muster: the link works once; Ctrl-C to stop")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0
