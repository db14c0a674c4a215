"""Three hosts on one machine: agents in their own network namespaces (ip netns, veth, a bridge,
addresses of a test network of our own, 198.18.0.0/24), a gang spread over them; an MPI job with
Muster's default Open MPI settings on hosts that look like Docker hosts."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from muster.shared import bus
from muster.shared.natsserver import NatsServer
from tests.conftest import CORE, NET, ROOT, Cluster, sh
from tests.test_jobs import attempt, run_job, spec
from tests.test_mpi import EXAMPLE, _mpi_on_this_machine, check_ranks, example

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


@pytest.mark.skipif(_mpi_on_this_machine() is not None, reason=str(_mpi_on_this_machine()))
@pytest.mark.parametrize("rooms", [(3,), (2, 1)], ids=["one-host", "two-hosts"])
async def test_an_mpi_job_with_the_default_settings_on_hosts_with_a_docker_bridge(hosts, tmp_path, rooms):
    """Each host also has what every Docker host has: docker0 at 172.17.0.1/16, the same address
    on every host, with no carrier, and dockerd's rule that masquerades what leaves from its
    network by another interface. The MPI example as shipped (no Open MPI setting of the
    job's), its three workers on one host (the whole gang at one address) or over two: the
    ranks all-reduce and the job SUCCEEDS. (With a /32 of the one address, which Open MPI took
    for every interface, the ranks waited in MPI_Allreduce for ever.)"""
    for ns, _ in hosts:
        for step in (("add", "docker0", "type", "bridge"), ("set", "docker0", "up")):
            sh("ip", "netns", "exec", ns, "ip", "link", *step)
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", "172.17.0.1/16", "dev", "docker0")
        masquerade = ("-s", "172.17.0.0/16", "!", "-o", "docker0", "-j", "MASQUERADE")  # dockerd's
        sh("ip", "netns", "exec", ns, "iptables", "-t", "nat", "-A", "POSTROUTING", *masquerade)
    with NatsServer(tmp_path / "nats", host=f"{NET}.254") as server:
        cluster = Cluster(server.url, tmp_path)
        try:
            for module in CORE:
                cluster.start(module)
            for (ns, address), room in zip(hosts, rooms, strict=False):
                cluster.agent(
                    ns, "--address", address, "--cpus", str(room), prefix=("ip", "netns", "exec", ns)
                )
            config = example()
            config["codeDir"] = str(EXAMPLE)
            assert "jobEnvs" not in config
            nc = await bus.connect("test", server.url)
            try:
                await bus.open_jetstream(nc, wait=60)  # the services have declared the streams
                record = await run_job(nc, config, timeout=100)
                a = await attempt(nc, record.job_id)
                launcher = next(t for t in a.tasks if (t.role, t.index) == ("worker", 0))
                assert record.state.value == "SUCCEEDED", (record.reason, launcher.last_lines, cluster.logs())
                assert len({t.node for t in a.tasks}) == len(rooms), a.tasks
                check_ranks(a.tasks, slots=1, addresses=dict(hosts))
            finally:
                await nc.close()
        finally:
            cluster.stop_all()
