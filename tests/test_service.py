"""A long-running service never dies silently or hangs: it rides out a NATS outage, says so, its
health reflects the real connection, and it exits non-zero when it cannot start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx

from muster.shared import bus, client
from muster.shared.natsserver import NatsServer, free_port

CONFIG = json.dumps(
    {
        "jobName": "after-outage",
        "image": "img",
        "taskRoles": [
            {"name": "m", "taskNumber": 1, "cpuNumber": 1, "memoryMB": 100, "gpuNumber": 0, "command": "x"}
        ],
    }
).encode()


def health(port: int) -> int:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code
    except httpx.HTTPError:
        return -1


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


async def test_validator_reconnects_after_a_nats_outage_and_health_follows(tmp_path):
    server = NatsServer(tmp_path / "nats").start()
    metrics_port = free_port()
    log = tmp_path / "validator.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "muster.services.validator", "--metrics-port", str(metrics_port)],
        env={**os.environ, "MUSTER_NATS_URL": server.url},
        stdout=open(log, "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    try:
        assert wait_for(lambda: health(metrics_port) == 200), log.read_text()
        assert "muster_validator_verdicts_total" in httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text

        server.stop()
        assert wait_for(lambda: health(metrics_port) == 503), log.read_text()
        assert wait_for(lambda: "nats.disconnected" in log.read_text())
        time.sleep(2)
        assert proc.poll() is None, "the validator died during the outage"

        server = NatsServer(tmp_path / "nats", port=server.port).start()  # same port, same data
        assert wait_for(lambda: health(metrics_port) == 200), log.read_text()
        assert "nats.reconnected" in log.read_text()

        nc = await bus.connect("test", server.url)
        _, verdict = await client.submit(nc, CONFIG, timeout=20)
        await nc.close()
        assert verdict is not None and verdict.accepted
    finally:
        proc.kill()
        proc.wait()
        server.stop()


def test_a_service_that_cannot_reach_nats_exits_non_zero():
    started = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "muster.services.validator"],
        env={
            **os.environ,
            "MUSTER_NATS_URL": f"nats://127.0.0.1:{free_port()}",
            "MUSTER_CONNECT_TIMEOUT": "1",
        },
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 1
    assert time.monotonic() - started < 15
    failure = [json.loads(line) for line in r.stderr.splitlines() if '"service.failed"' in line]
    assert failure and "cannot reach NATS" in failure[0]["error"]


def test_a_service_process_tunes_garbage_collection_and_a_library_user_keeps_its_own(nats_url):
    """`python -m muster.services.<name>` makes full collections rare and freezes what its build made
    (their pauses were the tail of submit→running); a process that only calls `run_service`
    (a test, an embedding program) keeps its own settings and nothing of it is frozen."""
    import asyncio
    import gc

    from muster.services.validator.service import Validator
    from muster.shared.service import GC_THRESHOLDS, run_service

    code = (
        "import gc, runpy, sys, threading\n"
        "def report():\n"
        "    import time\n"
        "    end = time.monotonic() + 50\n"  # the build's end: seconds, more on a loaded machine
        "    while not gc.get_freeze_count() and time.monotonic() < end: time.sleep(0.2)\n"
        "    print('GC', gc.get_threshold(), gc.get_freeze_count() > 0, flush=True)\n"
        "    import os; os._exit(0)\n"
        "threading.Thread(target=report, daemon=True).start()\n"
        "sys.argv = ['validator']\n"
        "runpy.run_module('muster.services.validator', run_name='__main__')\n"
    )
    env = {**os.environ, "MUSTER_NATS_URL": nats_url, "MUSTER_METRICS_PORT": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=80)
    assert f"GC {GC_THRESHOLDS} True" in out.stdout, out.stdout + out.stderr

    before, frozen = gc.get_threshold(), gc.get_freeze_count()

    async def briefly() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(run_service("validator", Validator.build, url=nats_url, stop=stop))
        await asyncio.sleep(2)
        stop.set()
        await asyncio.wait_for(task, 10)

    asyncio.run(briefly())
    assert (gc.get_threshold(), gc.get_freeze_count()) == (before, frozen)
