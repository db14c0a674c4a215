"""Chaos: 50 jobs of mixed shapes while a loop SIGKILLs and restarts random services, agents
included, every couple of seconds. Every job must reach the final state its commands imply, no
GPU may be held by two live tasks, no two attempts of a job may overlap, and no process of a
finished job may remain."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest

from shared import bus, client, subjects
from shared.messages import AttemptRecord, JobRecord, JobState
from tests.conftest import Cluster
from tests.test_jobs import role

SERVICES = ("services.validator", "services.scheduler", "services.registry", "services.supervisor")
AGENTS = {
    f"c{i}": ("--cpus", "4", "--gpus", "2xT4", "--address", "127.0.0.1", "--heartbeat", "0.5")
    for i in range(3)
}


class ChaosCluster(Cluster):
    def env(self) -> dict[str, str]:
        # Restarts lose tasks: give platform retries room, and keep their backoff short.
        return {**super().env(), "MUSTER_PLATFORM_RETRIES": "50", "MUSTER_RETRY_BACKOFF": "0.2"}


def jobs(rng: random.Random) -> list[tuple[dict, JobState]]:
    out = []
    for i in range(50):
        kind = i % 5
        pause = f"sleep {rng.choice(['0.5', '1', '2'])}"
        if kind == 0:  # a plain gang that succeeds
            config = {"taskRoles": [role("w", rng.randint(1, 3), f"{pause}; exit 0")]}
            expected = JobState.SUCCEEDED
        elif kind == 1:  # GPU tasks, gpuType honoured
            config = {"gpuType": "T4", "taskRoles": [role("g", rng.randint(1, 2), f"{pause}; exit 0", gpu=1)]}
            expected = JobState.SUCCEEDED
        elif kind == 2:  # ps/worker ended by killAllOnCompletedTaskNumber
            config = {
                "killAllOnCompletedTaskNumber": 2,
                "taskRoles": [role("ps", 1, "sleep 600"), role("worker", 2, f"{pause}; exit 0")],
            }
            expected = JobState.SUCCEEDED
        elif kind == 3:  # a user failure with one retry: two attempts, then FAILED
            config = {"retryCount": 1, "taskRoles": [role("w", 2, f"{pause}; exit 3")]}
            expected = JobState.FAILED
        else:  # fails once, succeeds on its retry
            config = {"retryCount": 1, "taskRoles": [role("w", 1, f"{pause}; test $MUSTER_ATTEMPT -gt 1")]}
            expected = JobState.SUCCEEDED
        out.append(({"jobName": f"chaos-{i}", "image": "img", **config}, expected))
    return out


@pytest.mark.timeout(600)
async def test_chaos_every_job_ends_right_while_services_are_killed(nats_url, tmp_path):
    cluster = ChaosCluster(nats_url, tmp_path)
    procs: dict[str, object] = {}
    for module in SERVICES:
        procs[module] = cluster.start(module)
    procs["services.scheduler#2"] = cluster.start("services.scheduler")
    for node, args in AGENTS.items():
        procs[node] = cluster.agent(node, *args)

    def restart(name: str) -> None:
        proc = procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        if name in AGENTS:
            procs[name] = cluster.agent(name, *AGENTS[name])
        else:
            procs[name] = cluster.start(name.split("#")[0])

    rng = random.Random(4)
    plan = jobs(rng)
    nc = await bus.connect("test", nats_url)
    kills: list[str] = []
    try:
        ids = []
        for config, _ in plan:
            _sid, verdict = await client.submit(nc, json.dumps(config).encode(), timeout=60)
            assert verdict is not None and verdict.accepted, verdict
            ids.append(verdict.job_id)
            if rng.random() < 0.1:  # kills start while jobs are still being submitted
                name = rng.choice(list(procs))
                restart(name)
                kills.append(name)
        kv = await nc.jetstream().key_value(subjects.JOBS_BUCKET)
        deadline = time.monotonic() + 240
        next_kill = time.monotonic() + 2
        while True:
            records = [JobRecord.from_bytes((await kv.get(j)).value) for j in ids]
            if all(r.state.final for r in records):
                break
            if time.monotonic() > deadline:
                stuck = [r for r in records if not r.state.final]
                logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("*.log")))
                said = [line for line in logs.splitlines() if any(r.job_id in line for r in stuck)]
                raise AssertionError(
                    f"{[(r.job_name, r.state, r.reason) for r in stuck]}\n" + "\n".join(said)
                )
            if time.monotonic() > next_kill and len(kills) < 40:
                name = rng.choice(list(procs))
                restart(name)
                kills.append(name)
                next_kill = time.monotonic() + rng.uniform(1.5, 3)
            await asyncio.sleep(0.2)

        wrong = [
            (r.job_name, r.state, expected, r.reason)
            for r, (_, expected) in zip(records, plan, strict=True)
            if r.state != expected
        ]
        assert not wrong, (wrong, kills)
        assert len(set(kills)) >= 5, kills  # every kind of service was killed at least once

        attempts = await _attempts(nc, records)
        _no_gpu_held_twice(attempts)
        _no_overlapping_attempts(attempts)
        assert "inconsistent_view" not in cluster.logs()
        await _no_process_left(ids, "\n".join(p.read_text() for p in sorted(tmp_path.glob("*.log"))))
    finally:
        await nc.close()
        cluster.stop_all()


async def _attempts(nc, records: list[JobRecord]) -> list[AttemptRecord]:
    kv = await nc.jetstream().key_value(subjects.ATTEMPTS_BUCKET)
    out = []
    for r in records:
        for n in range(1, r.attempt + 1):
            try:
                out.append(AttemptRecord.from_bytes((await kv.get(f"{r.job_id}.{n}")).value))
            except Exception:
                continue  # an attempt number fenced but never placed (its leader died): it ran nothing
    return out


def _no_gpu_held_twice(attempts: list[AttemptRecord]) -> None:
    """Tasks holding the same GPU of the same node never ran at the same time."""
    held: dict[tuple[str, int], list[tuple]] = {}
    for a in attempts:
        for t in a.tasks:
            if t.started_at is None:
                continue
            end = t.ended_at or a.ended_at
            assert end is not None, (a.key, t.key)
            for g in t.gpus:
                held.setdefault((t.node, g), []).append((t.started_at, end, f"{a.key}/{t.key}"))
    for gpu, spans in held.items():
        spans.sort()
        for (_s1, e1, who1), (s2, _, who2) in itertools.pairwise(spans):
            assert s2 >= e1 - timedelta(milliseconds=1), f"GPU {gpu} held by {who1} and {who2} at once"


def _no_overlapping_attempts(attempts: list[AttemptRecord]) -> None:
    """Attempt n+1 of a job starts its tasks only after every task of attempt n has ended."""
    by_job: dict[str, list[AttemptRecord]] = {}
    for a in attempts:
        by_job.setdefault(a.job_id, []).append(a)
    for runs in by_job.values():
        runs.sort(key=lambda a: a.attempt)
        for before, after in itertools.pairwise(runs):
            ends = [t.ended_at for t in before.tasks if t.ended_at]
            starts = [t.started_at for t in after.tasks if t.started_at]
            if ends and starts:
                assert min(starts) >= max(ends) - timedelta(milliseconds=1), (before.key, after.key)


async def _no_process_left(ids: list[str], logs: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            env = dict(e.decode(errors="replace").split("=", 1) for e in environ if b"=" in e)
            if env.get("MUSTER_JOB_ID") in ids:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                status = Path(f"/proc/{pid}/stat").read_text().split()
                task, job = env.get("MUSTER_TASK"), env.get("MUSTER_JOB_ID")
                left.append((pid, task, job, cmd, status[2], status[3]))
        if not left:
            return
        if time.monotonic() > deadline:
            tasks = {x[1] for x in left} | {x[2] for x in left}
            said = [line for line in logs.splitlines() if any(t and t in line for t in tasks)]
            raise AssertionError(f"processes of finished jobs remain: {left}\n" + "\n".join(said))
        await asyncio.sleep(0.5)
