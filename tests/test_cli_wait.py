"""`muster submit --wait` ends: with the scheduler's reason when the job can never run, and after
`--timeout` when it is still waiting. The real services and an agent, as separate processes."""

from __future__ import annotations

import json
import time

from tests.test_cli import VALID, write


def _job(name: str, **role) -> dict:
    return {**VALID, "jobName": name, "taskRoles": [dict(VALID["taskRoles"][0], **role)]}


def test_submit_wait_ends_on_an_unschedulable_job_and_after_its_timeout(cluster, tmp_path):
    cluster.core()
    cluster.agent("small", "--cpus", "2", "--gpus", "1xV100")

    # Never fits: more GPUs than any node has. The scheduler says so; --wait ends with its reason.
    path = write(tmp_path, "big.json", json.dumps(_job("too-big", gpuNumber=4)))
    # The services were started a moment ago: the first command waits for them to answer (2 s
    # by default, which a loaded CI machine's gateway start passed once).
    r = cluster.cli("submit", path, "--wait", "--connect-timeout", "60", timeout=90)
    assert r.returncode == 2, r.stdout + r.stderr + cluster.logs()
    last = r.stderr.strip().splitlines()[-1]
    assert "is unschedulable: can never run" in last and "GPU" in last, r.stderr

    # Fits, but not now: the node is full. --timeout bounds the whole wait.
    hog = write(tmp_path, "hog.json", json.dumps(_job("hog", cpuNumber=2, command="sleep 600")))
    assert cluster.cli("submit", hog).returncode == 0
    path = write(tmp_path, "later.json", json.dumps(_job("later", cpuNumber=1)))
    started = time.monotonic()
    r = cluster.cli("submit", path, "--wait", "--timeout", "8", timeout=90)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "still WAITING when --timeout ran out" in r.stderr.strip().splitlines()[-1], r.stderr
    assert time.monotonic() - started < 60
