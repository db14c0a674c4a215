"""Jobs in real Docker containers from the local base image: a PyTorch gang all-reduces over
gloo, with torch bind-mounted from this environment (nothing can be pulled here)."""

from __future__ import annotations

import asyncio
import json
import sysconfig
from pathlib import Path

import docker
import pytest

from muster.shared.messages import JobState
from tests.conftest import ROOT
from tests.test_jobs import attempt, nc, run_job  # noqa: F401 - nc is a fixture

pytestmark = pytest.mark.docker


def example(name: str) -> dict:
    text = (ROOT / "examples" / name / "job.json").read_text()
    return json.loads("\n".join(line for line in text.splitlines() if not line.strip().startswith("//")))


async def test_pytorch_gloo_allreduce_in_docker_containers(base_image, cluster, nc):  # noqa: F811
    torch = pytest.importorskip("torch")
    site = str(Path(torch.__file__).resolve().parents[1])
    assert site == sysconfig.get_paths()["purelib"] or Path(site).is_dir()
    cluster.core()
    cluster.agent(
        "box",
        "--runtime",
        "docker",
        "--address",
        "127.0.0.1",
        "--cpus",
        "4",
        "--overcommit",
        "--memory-mb",
        "16384",
    )
    config = example("pytorch-allreduce")
    config.update(
        image=base_image,
        codeDir=str(ROOT / "examples" / "pytorch-allreduce"),
        dataDir=site,  # mounted read-write at the same path: torch for the container's python3
        jobEnvs={"PYTHONPATH": site},
    )
    record = await run_job(nc, config, timeout=240)
    a = await attempt(nc, record.job_id)
    assert record.state == JobState.SUCCEEDED, (a.tasks, cluster.logs())
    lines = sorted(line for t in a.tasks for line in t.last_lines if "all_reduce" in line)
    assert lines == [f"rank {r}/3: all_reduce sum 6 ok (master 127.0.0.1)" for r in range(3)]

    # They really ran in containers, labelled with their job; the agent removes them afterwards
    # (it may still be at it: a sparse list, no inspect of a container going away, until none).
    engine = docker.from_env()
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while True:
            left = engine.containers.list(
                all=True, sparse=True, filters={"label": f"muster.job={record.job_id}"}, ignore_removed=True
            )
            if not left or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.5)
        assert left == []
    finally:
        engine.close()
    assert "runtime=docker" in cluster.logs() or '"runtime": "docker"' in cluster.logs()
