"""Three hosts on one machine: agents in their own network namespaces (ip netns, veth, a bridge,
addresses of a test network of our own, 198.18.0.0/24), a gang spread over them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from shared import bus
from shared.natsserver import NatsServer
from tests.conftest import CORE, ROOT, Cluster
from tests.test_jobs import attempt, run_job, spec

NET = "198.18.0"
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 for ip netns"
)


def sh(*cmd: str, check: bool = True) -> None:
    subprocess.run(cmd, check=check, capture_output=True)


@pytest.fixture
def hosts():
    tag = f"m{os.getpid() % 10000}"
    bridge = f"{tag}br"
    names = [f"{tag}h{i}" for i in (1, 2, 3)]
    sh("ip", "link", "add", bridge, "type", "bridge")
    sh("ip", "addr", "add", f"{NET}.254/24", "dev", bridge)
    sh("ip", "link", "set", bridge, "up")
    # Docker's FORWARD policy would drop bridged traffic when br_netfilter is loaded.
    if shutil.which("iptables"):
        sh("iptables", "-I", "FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT", check=False)
    for i, ns in enumerate(names, start=1):
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", f"{tag}v{i}", "type", "veth", "peer", "name", f"{tag}p{i}")
        sh("ip", "link", "set", f"{tag}v{i}", "master", bridge, "up")
        sh("ip", "link", "set", f"{tag}p{i}", "netns", ns)
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{NET}.{i}/24", "dev", f"{tag}p{i}")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", f"{tag}p{i}", "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
    try:
        yield [(ns, f"{NET}.{i}") for i, ns in enumerate(names, start=1)]
    finally:
        for i, ns in enumerate(names, start=1):
            sh("ip", "netns", "del", ns, check=False)
            sh("ip", "link", "del", f"{tag}v{i}", check=False)
        if shutil.which("iptables"):
            sh("iptables", "-D", "FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT", check=False)
        sh("ip", "link", "del", bridge, check=False)


async def test_a_gang_spread_over_three_hosts_gets_their_addresses_and_completes(hosts, tmp_path):
    with NatsServer(tmp_path / "nats", host=f"{NET}.254") as server:
        cluster = Cluster(server.url, tmp_path)
        try:
            for module in CORE:
                cluster.start(module)
            for ns, address in hosts:
                cluster.agent(ns, "--address", address, "--cpus", "2", prefix=("ip", "netns", "exec", ns))
            config = json.loads(
                "\n".join(
                    line
                    for line in (ROOT / "examples/ps-worker/job.json").read_text().splitlines()
                    if not line.strip().startswith("//")
                )
            )
            config["codeDir"] = str(Path(ROOT / "examples/ps-worker"))
            nc = await bus.connect("test", server.url)
            try:
                record = await run_job(nc, config, timeout=120)
                a = await attempt(nc, record.job_id)
                assert record.state.value == "SUCCEEDED", (a.tasks, cluster.logs())
                assert {t.node for t in a.tasks} == {ns for ns, _ in hosts}  # 5 one-CPU tasks, 2 CPUs each
                endpoints = (await spec(nc, record.job_id)).endpoints
                assert {e.host for e in endpoints} == {address for _, address in hosts}
                assert all(e.host == dict(hosts)[e.node] for e in endpoints)
                said = sorted(line for t in a.tasks for line in t.last_lines)
                assert said == sorted(
                    [f"ps {i}: sum of 3 workers = 6" for i in range(2)]
                    + [f"worker {i}: every ps agrees the sum is 6" for i in range(3)]
                )
            finally:
                await nc.close()
        finally:
            cluster.stop_all()
