"""Issue 10, sharing the cluster, with the real services on sim nodes: a high-priority job
preempts a whole low-priority gang, which resumes later uncharged; the first job in line lends
what it waits for and calls it back the same way; a virtual cluster borrows
idle capacity and another reclaims it; a quota that may not be exceeded holds; fair share
between two users of one VC. Waits are bounded and generous (the machine may be busy); no
verdict depends on timing: each step waits for the state it needs."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from muster.shared import bus, client, subjects
from muster.shared.messages import AttemptRecord, JobEventKind, JobRecord, JobState, KillRequest, TaskState
from muster.shared.natsserver import NatsServer
from tests.conftest import stored
from tests.test_jobs import role
from tests.test_sim import SimCluster, wait_nodes


class Bench:
    def __init__(self, cluster: SimCluster, nc) -> None:
        self.cluster, self.nc, self.js = cluster, nc, nc.jetstream()

    async def vc(self, name: str, v100: int, **kw: object) -> None:
        kv = await self.js.key_value(subjects.VCS_BUCKET)
        await kv.put(name, json.dumps({"name": name, "quota": {"gpus": {"V100": v100}}, **kw}).encode())

    async def submit(
        self,
        name: str,
        gpus: int,
        tasks: int = 1,
        user: str = "alice",
        seconds: float = 600,
        elastic: tuple[int, int] | None = None,
        **kw,
    ):
        bounds = {"minTaskNumber": elastic[0], "maxTaskNumber": elastic[1]} if elastic else {}
        config = {
            "jobName": name,
            "image": "img",
            "gpuType": "V100",
            "taskRoles": [role("worker", tasks, "python train.py", cpu=1, mem=1024, gpu=gpus, **bounds)],
            "extras": {"sim": {"seconds": seconds}},
            **kw,
        }
        _, verdict = await client.submit(self.nc, json.dumps(config).encode(), user=user, timeout=30)
        assert verdict is not None and verdict.accepted, verdict
        return verdict.job_id

    async def job(self, job_id: str) -> JobRecord:
        kv = await self.js.key_value(subjects.JOBS_BUCKET)
        return JobRecord.from_bytes((await kv.get(job_id)).value)

    async def attempt(self, job_id: str, n: int) -> AttemptRecord | None:
        kv = await self.js.key_value(subjects.ATTEMPTS_BUCKET)
        try:
            return AttemptRecord.from_bytes((await kv.get(f"{job_id}.{n}")).value)
        except Exception:
            return None

    async def until(self, what: str, check: Callable[[], object], timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not await check():  # type: ignore[misc]
            assert time.monotonic() < deadline, f"{what}: not within {timeout}s\n{self.cluster.logs()}"
            await asyncio.sleep(0.2)

    async def running(self, job_id: str, n: int = 1) -> bool:
        """Its attempt `n` runs every task, and its job record says so (written just after)."""
        a = await self.attempt(job_id, n)
        if a is None or a.ended or not all(t.state == TaskState.RUNNING for t in a.tasks):
            return False
        job = await self.job(job_id)
        return job.state == JobState.RUNNING and job.attempt == n

    async def kill(self, job_id: str, user: str = "alice") -> None:
        await self.js.publish(
            subjects.kill_request(user), KillRequest(job_id=job_id, user=user, grace=0).to_bytes()
        )

    async def events(self, job_id: str) -> list[str]:
        return [json.loads(m.data)["kind"] for m in await stored(self.js, subjects.job_events(job_id))]


@pytest.fixture
async def bench(tmp_path: Path, monkeypatch) -> AsyncIterator[Bench]:
    """The control plane as processes and one sim node of 4 V100s; a 1 s preemption grace."""
    monkeypatch.setenv("MUSTER_PREEMPT_GRACE", "1")
    monkeypatch.setenv("MUSTER_ELASTIC_DWELL", "1")
    with NatsServer(tmp_path / "nats") as server:
        cluster = SimCluster(server.url, tmp_path)
        try:
            cluster.core()
            cluster.sim("sim", 1, "--gpus", "4xV100")
            nc = await bus.connect("test", server.url)
            try:
                assert len(await wait_nodes(nc, "sim", 1)) == 1, cluster.logs()
                await bus.ensure_jetstream(nc)
                yield Bench(cluster, nc)
            finally:
                await nc.close()
        finally:
            cluster.stop_all()


async def test_a_high_priority_job_preempts_a_whole_low_gang_which_resumes_uncharged(bench):
    # The low gang takes all 4 GPUs (2 tasks × 2); the high job needs only 2, but a gang is
    # stopped whole or not at all. retryCount 0: a charged retry would fail the low job.
    low = await bench.submit("low", gpus=2, tasks=2, priority="low", retryCount=0)
    await bench.until("the low gang runs", lambda: bench.running(low))
    high = await bench.submit("high", gpus=2, priority="high", seconds=2)

    async def preempted() -> bool:
        a = await bench.attempt(low, 1)
        return a is not None and a.ended and all(t.state.ended for t in a.tasks)

    await bench.until("the low gang is stopped", preempted)
    first = await bench.attempt(low, 1)
    assert first.preempted_by == high and first.rule.startswith(f"preempted by {high} (high priority")
    assert {t.state for t in first.tasks} == {TaskState.STOPPED}
    # The high job runs and ends; the low job then runs again, as attempt 2, uncharged.
    await bench.until("the high job succeeds", lambda: _final(bench, high, JobState.SUCCEEDED))
    await bench.until("the low job runs again", lambda: bench.running(low, 2))
    record = await bench.job(low)
    assert record.state == JobState.RUNNING and record.attempt == 2
    assert record.retries == 0 and record.platform_retries == 0
    assert JobEventKind.PREEMPTED in await bench.events(low)
    # No preemption loop: the high job ran once, the low job's second attempt is left alone.
    assert (await bench.job(high)).attempt == 1
    await asyncio.sleep(2)
    second = await bench.attempt(low, 2)
    assert second is not None and not second.ended and second.preempted_by is None
    # Equal priority never preempts: a second low job waits for room.
    other = await bench.submit("other-low", gpus=2, priority="low")
    await bench.until("it waits with a reason", lambda: _reason(bench, other))
    assert await bench.attempt(other, 1) is None and not (await bench.attempt(low, 2)).ended


async def test_the_head_lends_what_it_waits_for_and_calls_it_back_uncharged(bench):
    # 4 GPUs: first holds 2; head needs all 4 and waits, first in line; later (2 GPUs, submitted
    # after it) runs at once on what is held for the head. When first ends, the head would fit on
    # what is free plus what later holds: later is stopped for it, uncharged (retryCount 0: a
    # charged retry would fail it), the head runs, and later runs again as attempt 2.
    first = await bench.submit("first", gpus=2)
    await bench.until("first runs", lambda: bench.running(first))
    head = await bench.submit("head", gpus=4, seconds=2)
    await bench.until("the head waits first in line", lambda: _reason(bench, head, "first in line"))
    later = await bench.submit("later", gpus=2, retryCount=0)
    await bench.until("later runs on what is held for the head", lambda: bench.running(later))
    await bench.kill(first)

    async def stopped() -> bool:
        a = await bench.attempt(later, 1)
        return a is not None and a.ended and all(t.state.ended for t in a.tasks)

    await bench.until("later is stopped for the head", stopped)
    a = await bench.attempt(later, 1)
    assert a.preempted_by == head and a.rule == f"stopped to let job {head}, which waited longer, start"
    await bench.until("the head succeeds", lambda: _final(bench, head, JobState.SUCCEEDED))
    await bench.until("later runs again", lambda: bench.running(later, 2))
    record = await bench.job(later)
    assert record.retries == 0 and record.platform_retries == 0
    assert JobEventKind.PREEMPTED in await bench.events(later)
    assert (await bench.job(head)).attempt == 1


async def test_a_vc_borrows_idle_gpus_and_another_reclaims_them(bench):
    await bench.vc("a", 2)
    await bench.vc("b", 2)
    a1 = await bench.submit("a1", gpus=2, virtualCluster="a")
    await bench.until("a1 runs", lambda: bench.running(a1))
    a2 = await bench.submit("a2", gpus=2, virtualCluster="a")  # beyond a's quota, on idle GPUs
    await bench.until("a2 runs on borrowed GPUs", lambda: bench.running(a2))
    assert not (await bench.attempt(a1, 1)).borrowed and (await bench.attempt(a2, 1)).borrowed

    # What `muster vc` shows, from the gateway (its copy of the records follows them closely).
    async def shown_running() -> bool:
        rows = {r["name"]: r for r in (await client.ask(bench.nc, "vcs"))["vcs"]}
        return rows.get("a", {}).get("running") == 2

    await bench.until("the gateway shows a's two jobs running", shown_running)
    rows = {r["name"]: r for r in (await client.ask(bench.nc, "vcs"))["vcs"]}
    assert list(rows) == ["default", "a", "b"]
    assert rows["a"]["quota"].startswith("2 v100") and rows["a"]["used"].startswith("4 v100")
    assert rows["a"]["borrowed"].startswith("2 v100") and rows["a"]["running"] == 2
    assert rows["default"]["quota"].startswith("0 v100") and rows["b"]["used"].startswith("0 GPUs")
    shown = await asyncio.to_thread(bench.cluster.cli, "vc")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split() == ["VC", "QUOTA", "USED", "BORROWED", "RUNNING", "WAITING"]
    assert lines[2].split()[0] == "a" and lines[2].split()[-2:] == ["2", "0"] and "2 v100" in lines[2]
    # b's job within b's quota finds no free GPU: a's borrowed gang is reclaimed, not a1.
    b1 = await bench.submit("b1", gpus=2, user="bob", virtualCluster="b")
    await bench.until("b1 runs", lambda: bench.running(b1))
    reclaimed = await bench.attempt(a2, 1)
    assert reclaimed.preempted_by == b1 and "virtual cluster b reclaims" in reclaimed.rule
    assert not (await bench.attempt(a1, 1)).ended
    # a2 waits again, uncharged; with no idle GPU left it does not run.
    await bench.until("a2 waits", lambda: _state(bench, a2, JobState.WAITING))
    await asyncio.sleep(2)
    assert await bench.attempt(a2, 2) is None and (await bench.job(a2)).retries == 0
    # Once b's job is gone, a2 borrows again.
    await bench.kill(b1, "bob")
    await bench.until("a2 runs again", lambda: bench.running(a2, 2))


async def test_a_quota_that_may_not_be_exceeded_holds(bench):
    await bench.vc("hard", 2, borrow=False)
    h1 = await bench.submit("h1", gpus=2, virtualCluster="hard")
    await bench.until("h1 runs", lambda: bench.running(h1))
    h2 = await bench.submit("h2", gpus=1, virtualCluster="hard")
    await bench.until("h2 waits for the quota", lambda: _reason(bench, h2, "virtual cluster hard's quota"))
    await asyncio.sleep(2)  # 2 GPUs are idle, but not hard's to take
    assert await bench.attempt(h2, 1) is None
    # Another VC's job takes them.
    d1 = await bench.submit("d1", gpus=2, user="bob")
    await bench.until("d1 runs", lambda: bench.running(d1))
    # The quota is changed at run time: h2 may go once there is room.
    await bench.vc("hard", 3, borrow=False)
    await bench.kill(d1, "bob")
    await bench.until("h2 runs", lambda: bench.running(h2))


async def test_an_elastic_job_grows_only_within_a_quota_that_may_not_be_exceeded(bench):
    await bench.vc("hard", 2, borrow=False)
    el = await bench.submit("el", gpus=1, virtualCluster="hard", elastic=(1, 4))

    async def members(n: int) -> bool:
        a = await bench.attempt(el, 1)
        return a is not None and sum(1 for t in a.members() if t.state == TaskState.RUNNING) == n

    await bench.until("it grows to its quota", lambda: members(2))
    await asyncio.sleep(3)  # 2 GPUs idle, 3 dwell periods: it stays at the quota
    assert len((await bench.attempt(el, 1)).members()) == 2


async def test_fair_share_between_two_users_of_one_vc(bench):
    await bench.vc("team", 4)
    alice = [await bench.submit(f"alice{i}", gpus=1, virtualCluster="team") for i in range(4)]
    for j in alice:
        await bench.until(f"{j} runs", lambda j=j: bench.running(j))
    # alice holds all 4; she queues two more, then bob one.
    later = [await bench.submit(f"alice-more{i}", gpus=1, virtualCluster="team") for i in range(2)]
    bob = await bench.submit("bob1", gpus=1, user="bob", virtualCluster="team")
    for j in [*later, bob]:
        await bench.until(f"{j} waits", lambda j=j: _reason(bench, j))
    # One GPU comes free: bob (holding nothing) goes before alice's earlier submissions.
    await bench.kill(alice[0])
    await bench.until("bob's job runs", lambda: bench.running(bob))
    await asyncio.sleep(1)
    assert [await bench.attempt(j, 1) for j in later] == [None, None]


async def _final(bench: Bench, job_id: str, state: JobState) -> bool:
    record = await bench.job(job_id)
    assert not record.state.final or record.state == state, record
    return record.state == state


async def _state(bench: Bench, job_id: str, state: JobState) -> bool:
    return (await bench.job(job_id)).state == state


async def _reason(bench: Bench, job_id: str, has: str = "") -> bool:
    record = await bench.job(job_id)
    return (
        record.state == JobState.WAITING
        and record.reason != "waiting for a scheduler"
        and has in record.reason
    )
