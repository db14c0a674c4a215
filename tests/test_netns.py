"""Three hosts on one machine: agents in their own network namespaces (ip netns, veth, a bridge,
addresses of a test network of our own, 198.18.0.0/24), a gang spread over them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from shared import bus
from shared.natsserver import NatsServer
from tests.conftest import CORE, NET, ROOT, Cluster
from tests.test_jobs import attempt, run_job, spec

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 for ip netns"
)


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
