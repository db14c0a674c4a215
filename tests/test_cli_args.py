"""Bad arguments and closed pipes get one line of explanation, never a traceback."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime

import pytest

from muster.shared import bus, client, subjects
from muster.shared.jobconfig import check_job
from muster.shared.messages import AttemptRecord, JobRecord, JobState, TaskStatus
from muster.shared.natsserver import free_port
from tests.test_cli import VALID, muster, write


def _env(url: str) -> dict[str, str]:
    return {**os.environ, "MUSTER_NATS_URL": url}


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, named",
    [
        (("kill", "j", "--grace", "-1"), "--grace"),
        (("logs", "j", "--task", ">"), "--task"),
        (("logs", "j", "--task", "main.*"), "--task"),
        (("logs", "j", "--attempt", "0"), "--attempt"),
        (("submit", "x.json", "--timeout", "-5"), "--timeout"),
        (("status", "--connect-timeout", "0"), "--connect-timeout"),
        (("status", "--since", "yesterday"), "--since"),
        (("status", "--state", "running,dreaming"), "--state"),
        (("status", "--user", "../alice"), "--user"),
        (("status", "--limit", "0"), "--limit"),
        (("up", "--gpus", "4xV100,foo"), "--gpus"),
        (("up", "--ports", "9000-x"), "--ports"),
        (("up", "--cpus", "-2"), "--cpus"),
        (("up", "--port", "70000"), "--port"),
        (("frobnicate",), "frobnicate"),
    ],
)
def test_a_bad_argument_gets_one_line_naming_it_and_exit_2(args, named, tmp_path):
    # `up` must refuse before it starts anything: a free port and a private data dir in case not.
    extra = ("--data-dir", str(tmp_path / "data")) if args[0] == "up" else ()
    if args[0] == "up" and "--port" not in args:
        extra += ("--port", str(free_port()))
    env = {k: v for k, v in os.environ.items() if k != "MUSTER_NATS_URL"}
    r = muster(*args, *extra, env=env, timeout=30)
    line = _one_line(r.stderr)
    assert r.returncode == 2 and named in line, r.stderr
    assert not (tmp_path / "data").exists()


@pytest.fixture
async def one_job(nats_url, procs):
    """A job record at attempt 1 in a bus the services declared (only the gateway runs)."""
    procs.start("muster.services.gateway")
    nc = await bus.connect("test", nats_url)
    js, buckets = await bus.ensure_jetstream(nc)
    config, errors = check_job(
        {**VALID, "taskRoles": [dict(VALID["taskRoles"][0], name="worker", taskNumber=2)]}
    )
    assert not errors
    record = JobRecord(
        job_id="j1",
        job_name="cli-demo",
        state=JobState.RUNNING,
        submission_id="s1",
        user="u",
        config=config,
        submitted_at=datetime.now(UTC),
        attempt=1,
    )
    await buckets[subjects.JOBS_BUCKET].put("j1", record.to_bytes())
    tasks = [TaskStatus(role="worker", role_no=0, index=i, node="n1") for i in (0, 1)]
    await buckets[subjects.ATTEMPTS_BUCKET].put(
        "j1.1", AttemptRecord(job_id="j1", attempt=1, tasks=tasks).to_bytes()
    )
    await js.publish(subjects.task_logs("j1", 1, "worker", 1, "n1"), b"hello from worker 1")
    for _ in range(100):  # the gateway answers once it has started
        try:
            await client.ask(nc, "ping", timeout=0.5)
            break
        except TimeoutError:
            await asyncio.sleep(0.2)
    yield _env(nats_url)
    await nc.close()


def test_logs_of_a_task_or_attempt_the_job_does_not_have_exit_2(one_job):
    env = one_job
    r = muster("logs", "j1", "--task", "worker.1", env=env)
    assert (r.returncode, r.stdout.strip()) == (0, "[worker.1] hello from worker 1"), r.stderr
    for args, said in (
        (("--task", "ps.0"), ("no task ps.0", "worker.0-1")),
        (("--task", "ps"), ("no task ps", "worker.0-1")),
        (("--task", "worker.2"), ("no task worker.2", "worker.0-1")),
        (("--attempt", "2"), ("no attempt 2", "1")),
    ):
        r = muster("logs", "j1", *args, env=env)
        line = _one_line(r.stderr)
        assert r.returncode == 2 and all(s in line for s in said), r.stderr


def _into_closed_pipe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run muster with its standard output a pipe nobody reads any more (`muster status | head -0`)."""
    read, write_end = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "muster.services.cli.main", *args],
            env=env or os.environ.copy(),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)


def test_output_into_a_closed_pipe_exits_quietly(one_job, tmp_path):
    for args in (("validate", write(tmp_path, "j.json", json.dumps(VALID))), ("status",), ("logs", "j1")):
        r = _into_closed_pipe(*args, env=one_job)
        assert (r.returncode, r.stderr) == (141, ""), (args, r.stderr)
