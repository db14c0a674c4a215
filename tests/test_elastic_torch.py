"""Issue 10, an elastic PyTorch job end to end: torchrun (c10d rendezvous on the address Muster
gives, gloo, CPU) on the process runtime. The scheduler grows it from 1 to 3 workers into free
CPUs, shrinks it back to 1 when a waiting job needs the room, and grows it again once that job is
done; torchrun re-forms the group each time and the training goes on. Every step's all-reduce
result, as the workers themselves wrote it, is right for the group it ran in."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import pytest

from muster.shared import bus, client, subjects
from muster.shared.messages import AttemptRecord, JobRecord, JobState, TaskState

TRAIN = """
import json, os, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out, stop = os.environ["ELASTIC_OUT"], os.environ["ELASTIC_STOP"]
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
while not os.path.exists(stop):
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)  # 1 + 2 + ... + world
    with open(out, "a") as f:
        f.write(json.dumps({"world": world, "rank": rank, "sum": value.item(), "restart": restart}) + "\\n")
    time.sleep(0.3)
dist.destroy_process_group()  # no barrier: a peer may be re-forming the group as the stop comes
"""

TORCHRUN = (
    "exec torchrun --nnodes=1:3 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=$MUSTER_RDZV_ENDPOINT "
    "--rdzv-id=$MUSTER_RDZV_ID --rdzv-conf=is_host=$MUSTER_RDZV_IS_HOST,last_call_timeout=1 "
    "--max-restarts=100 --monitor-interval=1 train.py"
)


def lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line being written
            out.append(json.loads(line))
    return out


async def record(nc, job_id: str) -> JobRecord:
    kv = await nc.jetstream().key_value(subjects.JOBS_BUCKET)
    return JobRecord.from_bytes((await kv.get(job_id)).value)


async def attempt(nc, job_id: str) -> AttemptRecord:
    kv = await nc.jetstream().key_value(subjects.ATTEMPTS_BUCKET)
    return AttemptRecord.from_bytes((await kv.get(f"{job_id}.1")).value)


async def until(what: str, check, cluster, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s\n{cluster.logs()}"
        await asyncio.sleep(0.5)


def running_members(a: AttemptRecord) -> int:
    return sum(1 for t in a.members() if t.state == TaskState.RUNNING)


@pytest.mark.timeout(600)
async def test_an_elastic_torchrun_job_grows_to_3_shrinks_to_1_for_a_waiting_job_and_trains_on(
    cluster, tmp_path, monkeypatch
):
    pytest.importorskip("torch")
    monkeypatch.setenv("MUSTER_ELASTIC_DWELL", "2")
    monkeypatch.setenv("MUSTER_ELASTIC_GRACE", "5")
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(TRAIN)
    out, stop = tmp_path / "steps.jsonl", tmp_path / "stop"
    cluster.core()
    cluster.agent("node-a", "--address", "127.0.0.1", "--cpus", "3", "--ports", "23000-23999")
    nc = await bus.connect("test", cluster.url)
    try:
        job = {
            "jobName": "elastic-torch",
            "image": "muster/base:bookworm",
            "codeDir": str(code),
            "jobEnvs": {"ELASTIC_OUT": str(out), "ELASTIC_STOP": str(stop)},
            "taskRoles": [
                {
                    "name": "worker",
                    "taskNumber": 1,
                    "minTaskNumber": 1,
                    "maxTaskNumber": 3,
                    "cpuNumber": 1,
                    "memoryMB": 1024,
                    "gpuNumber": 0,
                    "command": TORCHRUN,
                }
            ],
        }
        _, verdict = await client.submit(nc, json.dumps(job).encode(), timeout=60)
        assert verdict is not None and verdict.accepted, verdict
        jid = verdict.job_id

        async def trained_in(world: int, after: int = 0) -> bool:
            return any(x["world"] == world for x in lines(out)[after:])

        # It starts with its minimum, then grows into the two free CPUs.
        await until("the job trains with 3 workers", lambda: trained_in(3), cluster)
        grown = await attempt(nc, jid)
        assert len(grown.members()) == 3 and running_members(grown) == 3
        # It was placed with 1; the other two joined the running attempt later.
        assert [t.placed_at is not None for t in grown.tasks] == [False, True, True]
        # A job needing 2 CPUs waits: the two newest workers are removed for it. It runs until
        # the test has seen the training go on with 1 worker.
        seen = len(lines(out))
        release = tmp_path / "release"
        blocker = {
            "jobName": "needs-room",
            "image": "muster/base:bookworm",
            "jobEnvs": {"RELEASE": str(release)},
            "taskRoles": [
                {
                    "name": "main",
                    "taskNumber": 1,
                    "cpuNumber": 2,
                    "memoryMB": 256,
                    "gpuNumber": 0,
                    "command": 'while [ ! -e "$RELEASE" ]; do sleep 0.2; done',
                }
            ],
        }
        _, v2 = await client.submit(nc, json.dumps(blocker).encode(), timeout=60)
        assert v2 is not None and v2.accepted, v2

        async def blocker_done() -> bool:
            r = await record(nc, v2.job_id)
            assert not r.state.final or r.state == JobState.SUCCEEDED, (r, cluster.logs())
            return r.state == JobState.SUCCEEDED

        await until("training goes on with 1 worker", lambda: trained_in(1, seen), cluster)
        shrunk = await attempt(nc, jid)
        removed = sorted(t.index for t in shrunk.tasks if t.removed)
        assert removed == [1, 2], shrunk.tasks  # the newest two, never the first
        assert (await record(nc, v2.job_id)).state == JobState.RUNNING
        release.write_text("")
        await until("the waiting job succeeds", blocker_done, cluster)
        # Room again: it grows back.
        seen = len(lines(out))
        await until("it grows back to 3", lambda: trained_in(3, seen), cluster)
        stop.write_text("")

        async def done() -> bool:
            return (await record(nc, jid)).state.final

        try:
            await until("the elastic job ends", done, cluster, timeout=120)
        except AssertionError:  # say what each task did
            tasks = [
                (t.key, t.state, t.removed, t.exit_code, t.reason, t.last_lines[-8:])
                for t in (await attempt(nc, jid)).tasks
            ]
            raise AssertionError(f"the elastic job did not end: {tasks}\n{cluster.logs()}") from None
        final = await record(nc, jid)
        assert final.state == JobState.SUCCEEDED and final.attempt == 1 and final.retries == 0, final
        steps = lines(out)
        # Every all-reduce was right for the group it ran in: 1 + ... + world.
        assert steps and all(x["sum"] == x["world"] * (x["world"] + 1) / 2 for x in steps)
        worlds = [x["world"] for x in steps]  # (torch may still be starting when the others join)
        first3 = worlds.index(3)
        assert 1 in worlds[first3:] and 3 in worlds[first3 + worlds[first3:].index(1) :]
    finally:
        await nc.close()


async def test_running_tasks_get_a_refreshed_env_file_and_the_signal_they_asked_for(
    cluster, tmp_path, monkeypatch
):
    """A shell task that traps SIGUSR1 (`extras.elastic.signal`) and reads MUSTER_ENV_FILE then:
    it learns of each new gang (3 members, then 1) while it runs; its own environment stays as
    it was started."""
    monkeypatch.setenv("MUSTER_ELASTIC_DWELL", "1")
    monkeypatch.setenv("MUSTER_ELASTIC_GRACE", "2")
    seen, stop, release = tmp_path / "seen", tmp_path / "stop", tmp_path / "release"
    seen.mkdir()
    cluster.core()
    cluster.agent("node-a", "--address", "127.0.0.1", "--cpus", "3", "--ports", "24000-24999")
    trap = (
        'trap \'(. "$MUSTER_ENV_FILE"; echo "$MUSTER_SPEC_VERSION $PAI_TASK_ROLE_NUM") '
        '>> "$SEEN/$MUSTER_TASK_INDEX"\' USR1; '
        'echo "start $PAI_TASK_ROLE_NUM" >> "$SEEN/$MUSTER_TASK_INDEX"; '
        'while [ ! -e "$STOP" ]; do sleep 0.2; done'
    )
    nc = await bus.connect("test", cluster.url)
    try:
        job = {
            "jobName": "elastic-shell",
            "image": "muster/base:bookworm",
            "jobEnvs": {"SEEN": str(seen), "STOP": str(stop)},
            "extras": {"elastic": {"signal": "SIGUSR1"}},
            "taskRoles": [
                {
                    "name": "worker", "taskNumber": 1, "minTaskNumber": 1, "maxTaskNumber": 3,
                    "cpuNumber": 1, "memoryMB": 256, "gpuNumber": 0, "command": trap,
                }
            ],
        }  # fmt: skip
        _, verdict = await client.submit(nc, json.dumps(job).encode(), timeout=60)
        assert verdict is not None and verdict.accepted, verdict
        first = seen / "0"

        async def told(members: str) -> bool:  # a line "<spec version> <members>" after the start
            return first.exists() and any(
                x.split()[-1] == members for x in first.read_text().splitlines()[1:]
            )

        # Grown to 3: the first task is told, and its env file says 3.
        await until("the first task hears of 3 members", lambda: told("3"), cluster, timeout=120)
        assert first.read_text().splitlines()[0] == "start 1"
        blocker = {
            "jobName": "blocker",
            "image": "muster/base:bookworm",
            "jobEnvs": {"RELEASE": str(release)},
            "taskRoles": [
                {
                    "name": "main", "taskNumber": 1, "cpuNumber": 2, "memoryMB": 256, "gpuNumber": 0,
                    "command": 'while [ ! -e "$RELEASE" ]; do sleep 0.2; done',
                }
            ],
        }  # fmt: skip
        _, v2 = await client.submit(nc, json.dumps(blocker).encode(), timeout=60)
        assert v2 is not None and v2.accepted, v2
        # Shrunk to 1 for it: told again; the removed tasks were stopped, not told.
        await until("the first task hears of 1 member", lambda: told("1"), cluster, timeout=120)
        release.write_text("")
        stop.write_text("")

        async def done() -> bool:
            return (await record(nc, verdict.job_id)).state.final

        await until("the elastic job ends", done, cluster, timeout=120)
        assert (await record(nc, verdict.job_id)).state == JobState.SUCCEEDED
        told_versions = [int(x.split()[0]) for x in first.read_text().splitlines()[1:]]
        assert told_versions == sorted(set(told_versions))  # each version once, in order
    finally:
        await nc.close()
