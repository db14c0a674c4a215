"""Agent settings that matter when several agents share one host (`--scale agent=3` on the host
network): the metrics port (a port or a range, MUSTER_AGENT_METRICS_PORT) and the node name; and
the network namespace Docker's tasks run in (--docker-network / MUSTER_DOCKER_NETWORK)."""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import time
from pathlib import Path

import httpx
import pytest

from muster.services.agent import config
from muster.services.agent.args import add_agent_arguments
from muster.services.agent.config import metrics_ports, node_name, serve_health_in_range
from muster.services.agent.service import default_node_name
from muster.shared.natsserver import free_port


@pytest.fixture(autouse=True)
def _no_metrics_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MUSTER_AGENT_METRICS_PORT", raising=False)
    monkeypatch.delenv("MUSTER_METRICS_PORT", raising=False)


def test_metrics_port_flag_then_agent_variable_then_service_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert metrics_ports(None) == (0, 0)
    monkeypatch.setenv("MUSTER_METRICS_PORT", "9100")
    assert metrics_ports(None) == (9100, 9100)
    monkeypatch.setenv("MUSTER_AGENT_METRICS_PORT", "9101-9110")
    assert metrics_ports(None) == (9101, 9110)
    assert metrics_ports(9200) == (9200, 9200)
    assert metrics_ports(0) == (0, 0)
    monkeypatch.setenv("MUSTER_AGENT_METRICS_PORT", "0")
    assert metrics_ports(None) == (0, 0)
    for bad in ("x", "9110-9101", "70000", "1-2-3"):
        monkeypatch.setenv("MUSTER_AGENT_METRICS_PORT", bad)
        with pytest.raises(SystemExit, match="metrics port"):
            metrics_ports(None)


class _Connected:
    is_connected = True


async def test_a_range_gives_each_agent_the_first_free_port_and_writes_it(tmp_path: Path) -> None:
    low = free_port()
    with socket.socket() as taken:  # something else has the first port of the range
        taken.bind(("0.0.0.0", low))
        taken.listen()
        port_file = tmp_path / "port"
        first, p1 = await serve_health_in_range(_Connected(), low, low + 5, str(port_file))  # type: ignore[arg-type]
        second, p2 = await serve_health_in_range(_Connected(), low, low + 5)  # type: ignore[arg-type]
        try:
            assert low < p1 < p2 <= low + 5
            assert port_file.read_text() == f"{p1}\n"
            for port in (p1, p2):
                r = await asyncio.to_thread(httpx.get, f"http://127.0.0.1:{port}/healthz", timeout=5)
                assert r.status_code == 200
            with pytest.raises(RuntimeError, match="no free metrics port"):
                await serve_health_in_range(_Connected(), p1, p1)  # type: ignore[arg-type]
        finally:
            first.close()
            second.close()


def test_compose_replicas_after_the_first_get_their_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "compose_replica", lambda: None)
    assert node_name(None) == default_node_name()
    assert node_name("gpu-a") == "gpu-a"
    monkeypatch.setattr(config, "compose_replica", lambda: 1)
    assert node_name("gpu-a") == "gpu-a"  # the name a single agent always had
    monkeypatch.setattr(config, "compose_replica", lambda: 3)
    assert node_name("gpu-a") == "gpu-a-3"
    assert node_name(None) == f"{default_node_name()}-3"


def test_outside_a_container_there_is_no_replica_number() -> None:
    if "/containers/" in Path("/proc/self/mountinfo").read_text():
        pytest.skip("running inside a container")
    assert config.compose_replica() is None


def test_two_agents_on_one_range_serve_health_on_ports_of_their_own(cluster, monkeypatch, tmp_path) -> None:
    low = free_port()
    monkeypatch.setenv("MUSTER_AGENT_METRICS_PORT", f"{low}-{low + 10}")
    files = [tmp_path / "a.port", tmp_path / "b.port"]
    for name, port_file in zip(("node-a", "node-b"), files, strict=True):
        monkeypatch.setenv("MUSTER_AGENT_METRICS_PORT_FILE", str(port_file))
        cluster.agent(name, "--cpus", "1")
    deadline = time.monotonic() + 30
    while not all(f.exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(f.exists() for f in files), cluster.logs()
    ports = [int(f.read_text()) for f in files]
    assert len(set(ports)) == 2 and all(low <= p <= low + 10 for p in ports), ports
    for port in ports:
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200


# ---------------------------------------------------------------- where Docker's tasks are networked


def agent_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_agent_arguments(parser)
    return parser.parse_args(list(argv))


def test_docker_network_defaults_to_host_and_takes_a_containers_namespace(monkeypatch) -> None:
    monkeypatch.delenv("MUSTER_DOCKER_NETWORK", raising=False)
    assert agent_args().docker_network == "host"
    config.check_network(agent_args("--runtime", "process"))  # host: any runtime
    monkeypatch.setenv("MUSTER_DOCKER_NETWORK", "container:holder-1")
    args = agent_args("--runtime", "docker", "--address", "10.9.0.2")
    assert args.docker_network == "container:holder-1"
    config.check_network(args)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--docker-network", "bridge"], "--docker-network (MUSTER_DOCKER_NETWORK) 'bridge': use host, or "),
        (["--docker-network", "none"], "--docker-network (MUSTER_DOCKER_NETWORK) 'none'"),
        (["--docker-network", "container:"], "--docker-network (MUSTER_DOCKER_NETWORK) 'container:'"),
        (["--docker-network", "container:a b"], "'container:a b'"),
        (
            ["--docker-network", "container:h", "--runtime", "process", "--address", "10.9.0.2"],
            "--docker-network container:h: only with --runtime docker",
        ),
        (["--docker-network", "container:h", "--runtime", "docker"], "give --address"),
    ],
)
def test_a_bad_docker_network_is_refused_naming_the_option(monkeypatch, argv: list[str], said: str) -> None:
    monkeypatch.delenv("MUSTER_DOCKER_NETWORK", raising=False)
    monkeypatch.delenv("MUSTER_AGENT_ADDRESS", raising=False)
    with pytest.raises(SystemExit, match=re.escape(said)):
        config.check_network(agent_args(*argv))
