"""How the `muster` command and `shared/client.py` reach the bus: they never shape streams or
buckets (only services and `muster admin init` do), say what is missing on a bare NATS, fail fast
on an unreachable one, and take a list of servers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from muster.shared import bus, client, subjects
from muster.shared.natsserver import free_port
from tests.test_cli import VALID, muster, write


def _env(url: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "MUSTER_NATS_URL": url, **extra}


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# ---------------------------------------------------------------- only services shape the bus


async def test_a_cli_call_leaves_the_logs_stream_and_its_logs_alone(nats_url, tmp_path):
    nc = await bus.connect("test", nats_url)
    try:
        js, _ = await bus.ensure_jetstream(nc)  # what every service does when it starts
        for i in range(5):
            await js.publish(subjects.task_logs("j1", 1, "main", 0, "n1"), f"line {i} ".encode() * 100)
        before = await js.stream_info(subjects.LOGS_STREAM)

        path = write(tmp_path, "j.json", json.dumps(VALID))
        env = _env(nats_url, MUSTER_LOGS_MAX_BYTES="2048", MUSTER_JS_REPLICAS="1")
        for args in (("submit", path, "--timeout", "1"), ("status",), ("logs", "nope")):
            muster(*args, env=env)  # no validator runs: the submission only waits in its stream

        after = await js.stream_info(subjects.LOGS_STREAM)
        assert after.config.max_bytes == before.config.max_bytes == bus.LOGS_MAX_BYTES
        assert after.state.messages == before.state.messages == 5
    finally:
        await nc.close()


async def test_on_a_bare_nats_the_cli_says_what_is_missing_and_creates_nothing(nats_url, tmp_path, procs):
    env = _env(nats_url)
    path = write(tmp_path, "j.json", json.dumps(VALID))
    for args in (("status",), ("submit", path), ("kill", "x"), ("logs", "x")):
        r = muster(*args, env=env)
        line = _one_line(r.stderr)
        assert r.returncode == 1, (args, r.stderr)
        assert f"Muster is not set up on {nats_url}: stream {subjects.SUBMISSIONS_STREAM} is missing" in line
        assert "muster admin init" in line and "muster up" in line

    nc = await bus.connect("test", nats_url)
    try:
        assert [s async for s in _streams(nc)] == []
        with pytest.raises(bus.NotSetUp, match=subjects.SUBMISSIONS_STREAM):
            await client.submit(nc, json.dumps(VALID).encode(), timeout=0.5)
        assert [s async for s in _streams(nc)] == []

        # `muster admin init` is the one client path that declares them, from its own settings.
        r = muster("admin", "init", env=_env(nats_url, MUSTER_LOGS_MAX_BYTES="4096"))
        assert r.returncode == 0, r.stderr
        info = await nc.jetstream().stream_info(subjects.LOGS_STREAM)
        assert info.config.max_bytes == 4096
        procs.start("muster.services.gateway")  # what answers users' questions
        r = muster("status", "--connect-timeout", "20", env=env)
        assert (r.returncode, r.stdout.strip()) == (0, "no jobs"), r.stderr
    finally:
        await nc.close()


async def _streams(nc):
    for info in await nc.jetstream().streams_info():
        yield info.config.name


# ---------------------------------------------------------------- reaching NATS


def test_an_unreachable_nats_fails_fast_naming_the_url():
    url = f"nats://127.0.0.1:{free_port()}"
    started = time.monotonic()
    r = muster("status", env=_env(url))
    took = time.monotonic() - started
    line = _one_line(r.stderr)
    assert r.returncode == 1 and url in line, r.stderr
    # The default 2 s of trying, plus the CLI's own start (~0.5 s idle, several on a loaded
    # machine): not the minutes nats-py's own reconnect loop would take.
    assert took < 15, f"took {took:.1f}s to give up"


def test_a_server_list_whose_first_server_is_down_works_for_the_cli_and_up(nats_url, tmp_path):
    servers = f"nats://127.0.0.1:{free_port()}, {nats_url}"
    env = _env(servers)
    up = subprocess.Popen(
        [sys.executable, "-m", "muster.services.cli.main", "up", "--no-agent"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "up.log", "wb"),  # noqa: SIM115
        text=True,
    )
    try:
        assert "joining NATS at" in up.stdout.readline()
        r = muster("submit", write(tmp_path, "j.json", json.dumps(VALID)), env=env)
        assert r.returncode == 0 and "accepted" in r.stdout, r.stderr + (tmp_path / "up.log").read_text()
        r = muster("status", env=env)
        assert r.returncode == 0 and "cli-demo" in r.stdout, r.stderr
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(20) == 0
