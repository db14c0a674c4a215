"""The monitoring files in deploy/: Prometheus's config and alert rules pass `promtool check`, the
Grafana dashboard's every query parses (as promtool reads it), and the NATS metrics collector
reads a real nats-server's monitoring port and says so when a server does not answer. The live
check of the dashboard's queries against a real Prometheus scraping a compose stack is in
tests/test_compose.py (test_prometheus_sees_the_cluster). Needs Debian's `prometheus` package
(promtool) for the config checks; skipped without it."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
import yaml

from muster.shared.natsmetrics import NatsCollector
from muster.shared.natsserver import NatsServer, free_port

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "muster.json"


def dashboard_queries(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel, with Grafana's variables replaced by
    what they stand for (every training job; a 1-minute rate window)."""
    doc = json.loads(path.read_text())
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                expr = target["expr"].replace("$__rate_interval", "1m")
                out.append((panel["title"], re.sub(r"\$\w+", ".*", expr)))

    walk(doc["panels"])
    return out


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("no promtool: apt-get install -y prometheus")
    return path


def test_prometheus_config_and_rules_pass_promtool(tmp_path: Path) -> None:
    tool = promtool()
    # The config names the paths compose mounts it at: put the files there, under tmp_path.
    etc = tmp_path / "etc"
    (etc / "rules").mkdir(parents=True)
    shutil.copytree(DEPLOY / "prometheus-agents", etc / "agents")
    shutil.copy(DEPLOY / "prometheus-rules.yml", etc / "rules" / "muster.yml")
    config = etc / "prometheus.yml"
    config.write_text((DEPLOY / "prometheus.yml").read_text().replace("/etc/prometheus/", f"{etc}/"))
    for args in (["check", "rules", str(DEPLOY / "prometheus-rules.yml")], ["check", "config", str(config)]):
        proc = subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "WARNING" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    # Every alert the brief asks for is there.
    rules = yaml.safe_load((DEPLOY / "prometheus-rules.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert {
        "MusterNodeLost",
        "MusterJobWaitingTooLong",
        "MusterServiceDown",
        "MusterConsumerLag",
        "MusterGpuIdleWhileJobsWait",
    } <= alerts


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    """promtool parses each query as a recording rule's expression: a typo fails here, with no
    Prometheus running."""
    tool = promtool()
    queries = dashboard_queries()
    assert len(queries) >= 20
    rules = [{"record": f"dashboard:query_{i}", "expr": expr} for i, (_, expr) in enumerate(queries)]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The data source the provisioning declares is the one every panel names.
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasources["datasources"][0]["uid"]
    doc = json.loads(DASHBOARD.read_text())
    assert {p["datasource"]["uid"] for p in doc["panels"] if p["type"] != "row"} == {uid}
    titles = {p["title"] for p in doc["panels"]}
    assert {"GPUs by model", "Jobs by state", "Submit → placed", "Training metrics"} <= titles


def collected(collector: NatsCollector) -> dict[tuple[str, str], float]:
    registry = prometheus_client.CollectorRegistry()
    registry.register(collector)  # type: ignore[arg-type]
    return {
        (s.name, s.labels.get("server", "")): s.value for family in registry.collect() for s in family.samples
    }


async def test_nats_collector_reads_a_real_server_and_reports_a_dead_one(tmp_path: Path) -> None:
    monitor, dead = free_port(), free_port()
    with NatsServer(tmp_path / "nats", monitor_port=monitor):
        collector = NatsCollector([f"http://127.0.0.1:{monitor}", f"http://127.0.0.1:{dead}"], timeout=2)
        stop = asyncio.Event()
        poll = asyncio.create_task(collector.poll(stop, every=0.2))
        try:
            for _ in range(100):  # up to 20 s: the first poll's answers
                if collector.last.get(f"127.0.0.1:{monitor}") is not None:
                    break
                await asyncio.sleep(0.2)
            got = collected(collector)
        finally:
            stop.set()
            await asyncio.wait_for(poll, 10)
    live, gone = f"127.0.0.1:{monitor}", f"127.0.0.1:{dead}"
    assert got[("muster_nats_server_up", live)] == 1.0
    assert got[("muster_nats_server_up", gone)] == 0.0
    assert ("muster_nats_server_connections", gone) not in got
    assert got[("muster_nats_server_subscriptions", live)] > 0
    assert ("muster_nats_server_in_messages_total", live) in got
    assert ("muster_nats_server_jetstream_streams", live) in got


def test_cluster_gauges_follow_the_schedulers_view() -> None:
    """The scheduler's gauges (services/scheduler/metrics.py, pure): GPUs by node and model,
    allocated as the attempts hold them, jobs by state and VC, the queue and its oldest job,
    nodes by status."""
    from datetime import timedelta

    from test_scheduler_view import T0, attempt, job, node, put_attempt, put_job, put_node

    from muster.services.scheduler.metrics import families, snapshot
    from muster.services.scheduler.view import View
    from muster.shared.messages import GpuDevice, JobState, TaskState

    v = View(node_timeout=5)
    put_node(v, node("a", gpus=4))
    mixed = node("b", gpus=0).model_copy(
        update={"gpus": [GpuDevice(index=0, model="T4"), GpuDevice(index=1, model="V100")]}
    )
    put_node(v, mixed)
    put_node(v, node("gone", gpus=2, at=T0 - timedelta(seconds=60)))
    put_job(v, job("run", tasks=2, gpus=1, state=JobState.RUNNING, attempt=1))
    put_attempt(v, attempt("run", 1, ("a", [0], TaskState.RUNNING), ("b", [1], TaskState.RUNNING)))
    put_job(v, job("wait", at=T0 - timedelta(seconds=90)))
    put_job(v, job("done", state=JobState.SUCCEEDED))
    snap = snapshot(v, T0)
    assert snap.gpus == {("a", "V100"): [4, 1], ("b", "T4"): [1, 0], ("b", "V100"): [1, 1]}
    assert snap.jobs[("RUNNING", "default")] == 1 and snap.jobs[("WAITING", "default")] == 1
    assert snap.jobs[("SUCCEEDED", "default")] == 1 and snap.jobs[("FAILED", "default")] == 0
    assert snap.queue == {"default": 1} and snap.oldest_wait == 90.0
    assert snap.nodes == {"alive": 2, "lost": 1, "drained": 0, "restarting": 0}
    assert snap.heartbeat_age["gone"] == 60.0
    names = {s.name: s for f in families(snap) for s in f.samples if s.labels.get("node") == "b"}
    assert {"muster_gpus", "muster_gpus_allocated", "muster_gpus_free"} <= set(names)


def test_muster_up_serves_metrics_of_everything_it_runs(tmp_path: Path) -> None:
    """`muster up --metrics-port P`: one /metrics with every service's metrics, the cluster's
    gauges (its scheduler leads), and its embedded NATS server's (from the monitoring port); its
    supervisor's /sd/agents tells Prometheus where the local agent's metrics are (here too)."""
    import os
    import signal
    import sys
    import time

    import httpx

    port, metrics = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "MUSTER_NATS_URL"}
    cmd = [sys.executable, "-m", "muster.services.cli.main", "up", "--data-dir", str(tmp_path / "data")]
    cmd += ["--port", str(port), "--metrics-port", str(metrics), "--runtime", "process", "--node", "sd-n1"]
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    wanted = (
        "muster_scheduler_leader 1.0",
        'muster_jobs{state="WAITING",vc="default"} 0.0',
        'muster_nats_connected{service="muster-up"} 1.0',
        'muster_nats_reconnects_total{service="validator"} 0.0',
        "muster_nats_server_jetstream_streams{",
        'muster_consumer_pending_messages{consumer="validator"} 0.0',
    )
    text, nats_up = "", None
    try:
        deadline = time.monotonic() + 90  # a loaded machine starts the mesh slowly
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                text = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=5).text
            except httpx.TransportError:
                text = ""
            nats_up = re.search(r'muster_nats_server_up\{server="127\.0\.0\.1:\d+"\} 1\.0', text)
            if all(w in text for w in wanted) and nats_up:
                break
            time.sleep(0.5)
        assert all(w in text for w in wanted) and nats_up, (
            [w for w in wanted if w not in text],
            (tmp_path / "up.log").read_text()[-3000:],
        )
        assert httpx.get(f"http://127.0.0.1:{metrics}/healthz", timeout=5).status_code == 200
        targets = []
        while time.monotonic() < deadline and not targets:
            targets = httpx.get(f"http://127.0.0.1:{metrics}/sd/agents", timeout=5).json()
            time.sleep(0.2)
        assert len(targets) == 1 and targets[0]["labels"] == {"node": "sd-n1"}, targets
        assert targets[0]["targets"][0].endswith(f":{metrics}"), targets
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_agent_targets_list_each_node_that_serves_metrics() -> None:
    from muster.services.supervisor.service import agent_targets
    from muster.shared.messages import NodeInfo

    def node(name: str, address: str, port: int | None) -> NodeInfo:
        info = dict(cpus=4, memory_mb=4096, runtime="docker", agent_id="a")
        return NodeInfo(node=name, address=address, metrics_port=port, **info)

    nodes = [node("gpu-02", "10.0.0.2", 9101), node("sim-1", "10.0.0.9", None)]
    nodes.append(node("gpu-01", "fd00::1", 9102))
    assert agent_targets(nodes) == [
        {"targets": ["[fd00::1]:9102"], "labels": {"node": "gpu-01"}},
        {"targets": ["10.0.0.2:9101"], "labels": {"node": "gpu-02"}},
    ]
    # A record claiming a port no machine has does not decode: the mirrors skip it.
    with pytest.raises(ValueError, match="metrics_port"):
        node("bad", "10.0.0.3", 70000)
