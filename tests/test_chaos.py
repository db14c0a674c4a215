"""Chaos: jobs of mixed shapes (MUSTER_CHAOS_JOBS, 50 by default; 200 or more on demand) on two
replicas of every service and three agents with declared GPUs, while a loop SIGKILLs and restarts
random services and agents every couple of seconds — agents sometimes staying down longer than
the node timeout. Every job must reach the final state its commands imply with exact retry
counts, no GPU may be held by two tasks at once (checked from what the tasks themselves record),
no two attempts of a job may overlap, no process of a finished job may remain, and no task that
ran to its end may be taken for lost or run again for it: every run records its start and its
end (with its exit code), and each run that ended is on its attempt's record as it ended. On the
process runtime and on Docker (MUSTER_CHAOS_DOCKER_JOBS, 25 by default: containers start slower).

Its verdict must not change under load: before calling a fault fix done, run it (with
tests/test_trust.py, tests/test_lifecycle.py and tests/test_outcomes.py) beside two
`yes >/dev/null` processes, twice."""

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

import docker
import pytest

from muster.shared import bus, client, subjects
from muster.shared.messages import AttemptRecord, FailureKind, JobRecord, JobState, TaskCause
from tests.conftest import Cluster
from tests.test_jobs import role

SERVICES = (
    "muster.services.validator",
    "muster.services.scheduler",
    "muster.services.registry",
    "muster.services.supervisor",
    "muster.services.gateway",
)
JOBS = int(os.environ.get("MUSTER_CHAOS_JOBS", "50"))
DOCKER_JOBS = int(os.environ.get("MUSTER_CHAOS_DOCKER_JOBS", "25"))
NODE_TIMEOUT = 5.0
AGENTS = {
    f"c{i}": ("--cpus", "4", "--gpus", "2xT4", "--address", "127.0.0.1", "--heartbeat", "0.5")
    for i in range(3)
}


class ChaosCluster(Cluster):
    def env(self) -> dict[str, str]:
        # Restarts lose tasks: give platform retries room, and keep their backoff short.
        return {
            **super().env(),
            "MUSTER_PLATFORM_RETRIES": "50",
            "MUSTER_RETRY_BACKOFF": "0.2",
            "MUSTER_NODE_TIMEOUT": str(NODE_TIMEOUT),
        }


def recorded(command: str, runs: Path) -> str:
    """`command`, run so that it records its start and, once it has ended by itself, its exit
    code (a run killed before its end records no end)."""
    me = "$MUSTER_JOB_ID $MUSTER_ATTEMPT $MUSTER_TASK_ROLE.$MUSTER_TASK_INDEX"
    return f"echo start {me} >> {runs}; ({command}); code=$?; echo end {me} $code >> {runs}; exit $code"


def jobs(rng: random.Random, shared: Path, image: str, n: int) -> list[tuple[dict, JobState]]:
    """`n` jobs whose tasks write what they did in files of `shared` (the GPU ledger, runs)."""
    ledger = shared / "gpu-ledger"
    out = []
    for i in range(n):
        kind = i % 5
        pause = f"sleep {rng.choice(['0.5', '1', '2'])}"
        if kind == 0:  # a plain gang that succeeds
            config = {"taskRoles": [role("w", rng.randint(1, 3), f"{pause}; exit 0")]}
            expected = JobState.SUCCEEDED
        elif kind == 1:  # GPU tasks, gpuType honoured; each records when it held which GPUs where
            line = '"$(date +%s.%N) $PWD $CUDA_VISIBLE_DEVICES"'
            command = f"echo + {line} >> {ledger}; {pause}; echo - {line} >> {ledger}"
            config = {"gpuType": "T4", "taskRoles": [role("g", rng.randint(1, 2), command, gpu=1)]}
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
        for r in config["taskRoles"]:
            r["command"] = recorded(r["command"], shared / "runs")
        out.append(({"jobName": f"chaos-{i}", "image": image, "outputDir": str(shared), **config}, expected))
    return out


@pytest.mark.timeout(600 + 6 * JOBS)
async def test_chaos_every_job_ends_right_while_services_are_killed(nats_url, tmp_path):
    await _chaos(nats_url, tmp_path, "img", JOBS, ())


@pytest.mark.docker
@pytest.mark.timeout(600 + 10 * DOCKER_JOBS)
async def test_chaos_on_docker_every_job_ends_right_while_services_are_killed(base_image, nats_url, tmp_path):
    runtime = ("--runtime", "docker", "--overcommit")
    try:
        await _chaos(nats_url, tmp_path, base_image, DOCKER_JOBS, runtime)
    finally:  # what fences of agents killed at the end have not removed yet
        engine = docker.from_env()
        try:
            for c in engine.containers.list(all=True, filters={"label": "muster.job"}, ignore_removed=True):
                if c.labels.get("muster.home", "").startswith(str(tmp_path)):
                    c.remove(force=True)
        finally:
            engine.close()


async def _chaos(nats_url: str, tmp_path: Path, image: str, n: int, runtime: tuple[str, ...]) -> None:
    cluster = ChaosCluster(nats_url, tmp_path)
    agents = {node: (*runtime, *args) for node, args in AGENTS.items()}
    procs: dict[str, object] = {}
    for module in SERVICES:
        procs[module] = cluster.start(module)
        procs[f"{module}#2"] = cluster.start(module)
    for node, args in agents.items():
        procs[node] = cluster.agent(node, *args)

    down: dict[str, float] = {}  # agents kept down past the node timeout, and until when

    def restart(name: str) -> None:
        proc = procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        if name in agents and rng.random() < 0.3:
            down[name] = time.monotonic() + NODE_TIMEOUT + rng.uniform(1, 3)
        elif name in agents:
            procs[name] = cluster.agent(name, *agents[name])
        else:
            procs[name] = cluster.start(name.split("#")[0])

    def bring_back() -> None:
        for name, until in list(down.items()):
            if time.monotonic() >= until:
                procs[name] = cluster.agent(name, *agents[name])
                del down[name]

    rng = random.Random(4)
    shared = tmp_path / "shared"  # the jobs' outputDir: where their tasks record what they did
    shared.mkdir()
    shared.chmod(0o777)  # Docker tasks run as a non-root user
    plan = jobs(rng, shared, image, n)
    nc = await bus.connect("test", nats_url)
    kills: list[str] = []
    try:
        ids = []
        for config, _ in plan:
            _sid, verdict = await client.submit(nc, json.dumps(config).encode(), timeout=60)
            assert verdict is not None and verdict.accepted, verdict
            ids.append(verdict.job_id)
            bring_back()
            if rng.random() < 0.1:  # kills start while jobs are still being submitted
                name = rng.choice([n for n in procs if n not in down])
                restart(name)
                kills.append(name)
        kv = await nc.jetstream().key_value(subjects.JOBS_BUCKET)
        deadline = time.monotonic() + 240 + 4 * n
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
            bring_back()
            if time.monotonic() > next_kill and len(kills) < 40 * n // 50:
                name = rng.choice([n for n in procs if n not in down])
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

        attempts = await _all_ended(nc, records)
        _exact_retries(records, plan, attempts)
        _no_gpu_held_twice(attempts)
        _no_gpu_held_twice_by_the_tasks((shared / "gpu-ledger").read_text().splitlines(), attempts)
        _no_overlapping_attempts(attempts)
        _runs_that_ended_are_recorded_as_ended(
            (shared / "runs").read_text().splitlines(), attempts, cluster.logs()
        )
        assert "inconsistent_view" not in cluster.logs()
        await _no_process_left(ids, "\n".join(p.read_text() for p in sorted(tmp_path.glob("*.log"))))
    finally:
        await nc.close()
        cluster.stop_all()


def _runs_that_ended_are_recorded_as_ended(
    lines: list[str], attempts: list[AttemptRecord], logs: str
) -> None:
    """From the tasks' own records: every run that ended by itself (its end line) is on its
    attempt's record as it ended — its exit code, never lost with its agent or node — or as
    stopped on purpose once its attempt had ended; and a task that exited 0 ran again only
    because another task failed its attempt or its gang was stopped for another job, never for
    its own end."""
    by_key = {(a.job_id, a.attempt): a for a in attempts}
    starts: dict[tuple[str, str], list[int]] = {}
    ended: list[tuple[str, int, str, int]] = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 4 and parts[0] == "start":
            starts.setdefault((parts[1], parts[3]), []).append(int(parts[2]))
        elif len(parts) == 5 and parts[0] == "end":
            ended.append((parts[1], int(parts[2]), parts[3], int(parts[4])))
    assert ended, "no run recorded its end"
    wrong = []
    for job, n, task, code in ended:
        a = by_key[(job, n)]
        role_name, index = task.rsplit(".", 1)
        t = a.task(role_name, int(index))
        exact = t.cause in (TaskCause.EXITED, TaskCause.OOM) and t.exit_code == code
        # Stopped on purpose once its attempt had ended (its end raced the kill order).
        stopped = t.cause == TaskCause.KILLED and a.ended_at is not None
        stopped = stopped and t.ended_at is not None and a.ended_at <= t.ended_at
        if not (exact or stopped):
            wrong.append(f"{job}.{n} {task} exited {code}, recorded {t.cause} {t.exit_code} ({t.reason})")
        again = [m for m in starts.get((job, task), []) if m > n]
        # A gang stopped for another job (lending, preemption) runs whole again, a task of it
        # that had exited 0 too: the stop is refused on a record that holds an ended task
        # (tests/test_cycle.py), so only an end still on its way to the record (its agent down,
        # or milliseconds) can race it.
        for_own_end = a.failure is None or a.failure.task == task
        if code == 0 and again and for_own_end and a.preempted_by is None:
            wrong.append(f"{job}.{n} {task} exited 0 and ran again in attempt {again}: {a.rule}")
    said = [line for line in logs.splitlines() if any(w.split()[0].split(".")[0] in line for w in wrong)]
    assert not wrong, "\n".join(wrong + said[-50:])


async def _all_ended(nc, records: list[JobRecord], timeout: float = 60) -> list[AttemptRecord]:
    """The jobs' attempts once every task of them has ended: a job is final as soon as its
    policy says so, and the rest of its gang is stopped after (a kill order, then a report)."""
    deadline = time.monotonic() + timeout
    while True:
        attempts = await _attempts(nc, records)
        running = [f"{a.key}/{t.key}" for a in attempts for t in a.tasks if not t.state.ended]
        if not running:
            return attempts
        assert time.monotonic() < deadline, f"tasks of finished jobs never ended: {running}"
        await asyncio.sleep(0.5)


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


def _exact_retries(
    records: list[JobRecord], plan: list[tuple[dict, JobState]], attempts: list[AttemptRecord]
) -> None:
    """Every run whose command failed was charged to retryCount, and nothing else was."""
    by_job: dict[str, list[AttemptRecord]] = {}
    for a in attempts:
        by_job.setdefault(a.job_id, []).append(a)
    for r, (config, _) in zip(records, plan, strict=True):
        user = [
            a
            for a in by_job.get(r.job_id, [])
            if a.failure is not None and a.failure.kind == FailureKind.USER
        ]
        charged = [a for a in by_job.get(r.job_id, []) if a.charged]
        assert r.retries == len(charged), (r.job_name, r.retries, [a.key for a in charged])
        expected = {1: 2} if "exit 3" in json.dumps(config) else {}  # always fails: 2 runs, 1 retry
        if r.state == JobState.FAILED:
            assert len(user) == expected.get(config.get("retryCount", 0), 1), (
                r.job_name,
                [a.key for a in user],
            )
        # A run charged to retryCount is exactly a run whose command failed, and the last one
        # (which ended the job) is not charged.
        assert len(user) == r.retries + (r.state == JobState.FAILED), (
            r.job_name,
            r.retries,
            [a.key for a in user],
        )


def _no_gpu_held_twice_by_the_tasks(lines: list[str], attempts: list[AttemptRecord]) -> None:
    """From the tasks' own records: a GPU of a node is never held by two tasks at once. A task
    killed with its agent writes no end line: its end is when its attempt record says it ended
    (later than it really did, so this can only find more overlap, never hide one)."""
    ended = {
        (t.node, a.job_id, str(a.attempt), t.role, str(t.index)): (t.ended_at or a.ended_at)
        for a in attempts
        for t in a.tasks
    }
    spans: dict[str, tuple[float, float | None, tuple[str, ...]]] = {}
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        sign, stamp, pwd, gpus = parts[0], float(parts[1]), parts[2], parts[3]
        node, job, attempt_no, task_dir = Path(pwd).parts[-4:]
        key = (node, job, attempt_no, *task_dir.rsplit("-", 1))
        start, end, _ = spans.get(pwd, (stamp, None, key))
        spans[pwd] = (start, stamp, key) if sign == "-" else (stamp, end, key)
    held: dict[tuple[str, str], list[tuple[float, float, str]]] = {}
    for pwd, (start, end, key) in spans.items():
        if end is None:
            recorded = ended.get(key)
            assert recorded is not None, f"task {pwd} has no end"
            end = recorded.timestamp()
        gpus = next(line.split()[3] for line in lines if pwd in line)
        for g in gpus.split(","):
            held.setdefault((key[0], g), []).append((start, end, pwd))
    for gpu, used in held.items():
        used.sort()
        for (_s1, e1, who1), (s2, _, who2) in itertools.pairwise(used):
            assert s2 >= e1 - 0.001, f"GPU {gpu} held by {who1} and {who2} at once"


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
