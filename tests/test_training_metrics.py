"""Training metrics and hang detection end to end (real nats-server, every service a process,
the process runtime): a job printing `accuracy=0.93` shows it in `muster status`, in `muster
metrics` and as the agent's gauge; a task that stops printing past noProgressTimeoutSec is
stopped as a platform failure and its whole gang runs again as a new attempt."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

from muster.shared import client, subjects
from muster.shared.messages import FailureKind, JobState, TaskCause, TaskState
from muster.shared.natsserver import free_port
from tests.test_jobs import attempt, nc, role, wait_final  # noqa: F401 - nc is a fixture


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


async def until(what, check, timeout: float = 60, logs=lambda: ""):
    """Poll `check()` (sync, may raise) until it returns something true; that value."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = await asyncio.to_thread(check)
            if last:
                return last
        except Exception as exc:  # not yet (e.g. the metrics endpoint is not up)
            last = exc
        await asyncio.sleep(0.3)
    raise AssertionError(f"{what}: not within {timeout}s (last: {last!r})\n{logs()}")


async def test_a_job_printing_accuracy_shows_it_in_status_metrics_and_the_gauge(cluster, nc):  # noqa: F811
    cluster.core()
    port = free_port()
    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "4", "--metrics-port", str(port))
    config = {
        "jobName": "trains",
        "image": "img",
        "metrics": ["accuracy:PERCENTAGE", "loss"],
        "taskRoles": [
            role(
                "main",
                1,
                "echo 'step=1 loss=0.5 accuracy=0.91'; echo 'epoch done, val_loss=9'; "
                "echo 'step: 2 loss: 0.25 accuracy: 0.93'; sleep 600",
            )
        ],
    }
    _, verdict = await client.submit(nc, json.dumps(config).encode(), timeout=30)
    assert verdict is not None and verdict.accepted, verdict
    job = verdict.job_id
    gauge = f'muster_task_metric{{job_id="{job}",metric="accuracy",task="main.0"}} 0.93'
    await until("the gauge", lambda: gauge in scrape(port), logs=cluster.logs)
    assert f'muster_task_metric{{job_id="{job}",metric="loss",task="main.0"}} 0.25' in scrape(port)

    def shown_in_status() -> str | None:
        out = cluster.cli("status", job).stdout
        return out if "93.00%" in out else None

    status = await until("muster status", shown_in_status, logs=cluster.logs)
    table = status.split("metrics (attempt 1):")[1]
    row = next(line.split() for line in table.splitlines() if line.strip().startswith("main.0"))
    assert row[:4] == ["main.0", "93.00%", "0.25", "2"], status  # TASK accuracy loss STEP
    doc = json.loads(cluster.cli("status", job, "--json").stdout)
    assert {p["name"]: p["value"] for p in doc["metrics"]["main.0"]["latest"]} == {
        "accuracy": 0.93,
        "loss": 0.25,
    }

    r = cluster.cli("metrics", job, "--json")
    assert r.returncode == 0, r.stderr
    points = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(p["task"], p["step"], p["name"], p["value"]) for p in points] == [
        ("main.0", 1, "loss", 0.5),
        ("main.0", 1, "accuracy", 0.91),
        ("main.0", 2, "loss", 0.25),
        ("main.0", 2, "accuracy", 0.93),
    ]
    table = cluster.cli("metrics", job, "--task", "main.0").stdout
    assert "accuracy" in table and "93.00%" in table and "91.00%" in table
    assert cluster.cli("metrics", job, "--task", "other").returncode == 2

    # The task ends: its label sets go (the gauge only holds running tasks).
    assert cluster.cli("kill", job).returncode == 0
    await until("the gauge removed", lambda: f'job_id="{job}"' not in scrape(port), logs=cluster.logs)
    # The series outlives the task.
    assert len(cluster.cli("metrics", job, "--json").stdout.splitlines()) == 4


async def test_a_task_silent_past_its_no_progress_timeout_restarts_its_gang(cluster, nc, tmp_path):  # noqa: F811
    cluster.core()
    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "4")
    config = {
        "jobName": "hangs",
        "image": "img",
        "retryCount": 0,
        "noProgressTimeoutSec": 5,
        "taskRoles": [
            # Attempt 1: `silent` hangs (prints once, then nothing), `chatty` keeps printing.
            role("silent", 1, 'echo "attempt $MUSTER_ATTEMPT"; test $MUSTER_ATTEMPT -gt 1 || sleep 600'),
            role(
                "chatty",
                1,
                "test $MUSTER_ATTEMPT -gt 1 && exit 0; while true; do echo tick; sleep 0.5; done",
            ),
        ],
    }
    _, verdict = await client.submit(nc, json.dumps(config).encode(), timeout=30)
    assert verdict is not None and verdict.accepted, verdict
    record = await wait_final(nc, verdict.job_id, timeout=90)
    assert record.state == JobState.SUCCEEDED, cluster.logs()
    assert (record.attempt, record.retries, record.platform_retries) == (2, 0, 1)
    first = await attempt(nc, record.job_id, 1)
    assert first.failure is not None and first.failure.kind == FailureKind.PLATFORM, first
    assert first.failure.task == "silent.0" and first.failure.cause == TaskCause.PLATFORM
    assert "no output for 5 s" in first.failure.reason and first.charged is False
    assert first.task("chatty", 0).state == TaskState.STOPPED  # the rest of the gang was stopped
    second = await attempt(nc, record.job_id, 2)
    assert all(t.state == TaskState.SUCCEEDED for t in second.tasks)
    status = cluster.cli("status", record.job_id).stdout
    assert "[platform failure]" in status and "(retry not charged)" in status


@pytest.mark.timeout(240)  # its waits are 120 s and more: they, not pytest, say what was missing
async def test_a_task_printing_fast_costs_at_most_a_batch_a_second(cluster, nc):  # noqa: F811
    cluster.core()
    port = free_port()
    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "4", "--metrics-port", str(port))
    lines = 50_000
    config = {
        "jobName": "fast",
        "image": "img",
        "metrics": ["loss"],
        "taskRoles": [
            role(
                "main",
                1,
                f"python3 -c 'for i in range({lines}): print(f\"step={{i}} loss={{i}}\")'; sleep 600",
            )
        ],
    }
    started = time.monotonic()
    _, verdict = await client.submit(nc, json.dumps(config).encode(), timeout=30)
    assert verdict is not None and verdict.accepted, verdict
    job = verdict.job_id
    gauge = f'muster_task_metric{{job_id="{job}",metric="loss",task="main.0"}} {float(lines - 1)}'
    await until("the last value", lambda: gauge in scrape(port), timeout=120, logs=cluster.logs)

    async def series() -> list[dict]:
        got, after, more = [], 0, True
        while more:
            page = await client.ask(nc, "metrics", {"job_id": job, "attempt": 1, "after": after})
            got, after, more = got + page["batches"], page["last"], page["more"]
        return got

    # The last batch reaches the stream just after the gauge shows its value.
    deadline = time.monotonic() + 30
    while True:
        got = await series()
        kept = sum(len(b["points"]) for b in got)
        if kept + sum(b["dropped"] for b in got) == lines or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.3)
    assert kept + sum(b["dropped"] for b in got) == lines  # every point kept or counted
    elapsed = time.monotonic() - started
    batches = (await nc.jetstream().stream_info(subjects.METRICS_STREAM)).state.messages
    assert 1 <= batches <= elapsed + 2, (batches, elapsed)  # at most one a second
    assert kept <= 100 * batches  # at most 100 points of a metric a batch
    assert cluster.cli("kill", job).returncode == 0
