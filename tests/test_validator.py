"""The validator against a real nats-server: durability, replicas, idempotency, bad payloads."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import uuid

import pytest
from nats.js.errors import KeyNotFoundError

from muster.services.validator.service import Validator
from muster.shared import bus, client, store, subjects
from muster.shared.messages import JobEvent, JobRecord, JobState, job_id_for, now
from muster.shared.service import run_service
from muster.shared.subjects import Headers
from tests.conftest import stored
from tests.test_loader import SMALL_BOMB


def config(name: str = "demo", **extra: object) -> bytes:
    job = {
        "jobName": name,
        "image": "python:3.11",
        "taskRoles": [
            {
                "name": "worker",
                "taskNumber": 2,
                "cpuNumber": 1,
                "memoryMB": 256,
                "gpuNumber": 0,
                "command": "true",
            }
        ],
        **extra,
    }
    return json.dumps(job).encode()


@contextlib.asynccontextmanager
async def validator(url: str):
    stop = asyncio.Event()
    task = asyncio.create_task(run_service("validator", Validator.build, url=url, stop=stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@pytest.fixture
async def nc(nats_url: str):
    conn = await bus.connect("test", nats_url)
    yield conn
    await conn.close()


async def job(nc, job_id: str) -> JobRecord:
    kv = await nc.jetstream().key_value(subjects.JOBS_BUCKET)
    return JobRecord.from_bytes((await kv.get(job_id)).value)


async def test_submission_published_before_any_validator_is_accepted_when_one_starts(nats_url, nc):
    await bus.ensure_jetstream(nc)  # set up once (`muster admin init`); clients only look it up
    sid, verdict = await client.submit(nc, config("early"), user="alice", timeout=0.5)
    assert verdict is None  # nobody is validating yet; the submission waits in the stream
    async with validator(nats_url):
        sub = await nc.subscribe(subjects.verdict("alice", sid))
        verdict = await client.wait_verdict(nc, sub, sid, 10, "alice")
    assert verdict is not None and verdict.accepted, verdict
    record = await job(nc, verdict.job_id)
    assert (record.state, record.job_name, record.user) == (JobState.WAITING, "early", "alice")
    assert record.config.taskRoles[0].taskNumber == 2


async def test_invalid_config_is_rejected_with_every_error(nats_url, nc):
    bad = json.loads(config("bad"))
    bad["taskRoles"][0]["memoryMB"] = 64
    bad["taskRoles"].append(dict(bad["taskRoles"][0], memoryMB=512, name="worker"))
    async with validator(nats_url):
        _, verdict = await client.submit(nc, json.dumps(bad).encode(), timeout=10)
    assert verdict is not None and not verdict.accepted
    assert [str(e) for e in verdict.errors] == [
        "taskRoles[0].memoryMB: must be ≥ 100, got 64",
        "taskRoles[1].name: duplicate role name 'worker' (also taskRoles[0])",
    ]
    assert verdict.job_name == "bad" and verdict.job_id is None


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"{not json", "invalid JSON at line 1"),
        (b"[1, 2, 3]", "must be a JSON object, got a list"),
        (b'"a string"', "must be a JSON object, got a string"),
        (b"\xff\xfe\x00garbage", "not UTF-8"),
        (b"", "must be a JSON object, got null"),
        (b'{"jobName": "x", "pad": "' + b"a" * (1024 * 1024) + b'"}', "the limit is 1 MiB"),
        (SMALL_BOMB.encode(), "aliases expand the config past 1048576 bytes (1 MiB)"),
        (config("dup")[:-1] + b', "jobName": "other"}', "duplicate key 'jobName'"),
    ],
    ids=["not-json", "list", "string", "binary", "empty", "too-large", "yaml-alias-bomb", "duplicate-key"],
)
async def test_bad_payloads_get_a_clear_rejection_and_the_validator_keeps_going(
    nats_url, nc, payload, reason
):
    async with validator(nats_url):
        _, verdict = await client.submit(nc, payload, timeout=10)
        assert verdict is not None and not verdict.accepted
        assert len(verdict.errors) == 1 and reason in verdict.errors[0].reason, verdict.errors
        _, after = await client.submit(nc, config("still-alive"), timeout=10)
    assert after is not None and after.accepted


async def test_a_validator_whose_consumer_is_gone_makes_it_again(nats_url, nc):
    """The bus lost its state (a server rebuilt without its volume and set up again has none of
    the services' consumers; here the validator's is deleted): its fetches failed for ever while
    its health said connected, and no submission was judged again. The agents made theirs
    again; now the services do too."""
    async with validator(nats_url):
        _, before = await client.submit(nc, config("before"), timeout=10)
        assert before is not None and before.accepted, before
        await nc.jetstream().delete_consumer(subjects.SUBMISSIONS_STREAM, subjects.VALIDATOR_CONSUMER)
        _, after = await client.submit(nc, config("after"), timeout=30)
    assert after is not None and after.accepted, after


@pytest.mark.timeout(120)
async def test_a_big_yaml_submission_holds_up_no_other(nats_url, nc):
    """PyYAML reads ~50 KB a second: a 500 KB YAML submission (any user's) held the validator's
    event loop ~10 s, every other submission waiting behind it. It is read in a thread now: the
    loop (the validator runs in this test's) never pauses for long while it is read."""
    big = ("a: [" + ",".join(["1"] * 250_000) + "]\n").encode()
    gaps: list[float] = []

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.05)
            gaps.append(time.monotonic() - last)
            last = time.monotonic()

    async with validator(nats_url):
        _, warm = await client.submit(nc, config("warm"), timeout=10)
        assert warm is not None and warm.accepted, warm
        ticker = asyncio.ensure_future(tick())
        try:
            _, verdict = await client.submit(nc, big, timeout=90)
        finally:
            ticker.cancel()
    assert verdict is not None and not verdict.accepted  # a list, not a job
    assert max(gaps) < 1.5, f"the event loop paused {max(gaps):.1f} s while the YAML was read"


async def test_raw_publish_without_headers_is_judged_and_recorded_in_events(nats_url, nc):
    """A plain `nats pub muster.job.submit` (no Muster headers) still gets a verdict."""
    await bus.ensure_jetstream(nc)
    ack = await nc.jetstream().publish(subjects.submit("raw-user"), config("raw"))
    sid = f"s{ack.seq}"
    async with validator(nats_url):
        for _ in range(100):
            verdict = await client.stored_verdict(nc, sid, "raw-user")
            if verdict:
                break
            await asyncio.sleep(0.1)
    assert verdict is not None and verdict.accepted and verdict.job_id == job_id_for("raw-user", sid)
    events = await history(nc, verdict.job_id)
    assert [(e.kind, e.state) for e in events] == [("accepted", JobState.WAITING)]
    assert (await job(nc, verdict.job_id)).user == "raw-user"  # who the subject names


async def history(nc, job_id: str) -> list[JobEvent]:
    return [JobEvent.from_bytes(m.data) for m in await stored(nc.jetstream(), subjects.job_events(job_id))]


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


async def test_a_config_nested_too_deep_or_holding_infinity_is_refused_where_and_one_within_reads_back(
    nats_url, nc
):
    """`extras` takes any value. Nested ~200 deep, a config was accepted and its record then
    unreadable to every reader (pydantic's JSON parser stops near 200 levels), so the job was
    lost after "accepted"; past 255 the validator failed on it five times, then answered
    "internal error". Infinity (Python's JSON reader takes it) was accepted and stored as null."""
    async with validator(nats_url):
        _, deep = await client.submit(nc, config("deep", extras={"x": _nested(220)}), timeout=15)
        _, deeper = await client.submit(nc, config("deeper", extras={"x": _nested(300)}), timeout=15)
        infinite = config("inf").replace(b'"jobName"', b'"extras": {"lr": Infinity}, "jobName"')
        _, inf = await client.submit(nc, infinite, timeout=15)
        _, fine = await client.submit(nc, config("fine", extras={"x": _nested(60)}), timeout=15)
    for verdict in (deep, deeper):
        assert verdict is not None and not verdict.accepted, verdict
        [error] = verdict.errors
        assert error.path == "extras.x" + "[0]" * 62 and "nested more than 64 levels" in error.reason, error
    assert inf is not None and not inf.accepted, inf
    assert [(e.path, e.reason) for e in inf.errors] == [("extras.lr", "must be a finite number, got inf")]
    assert fine is not None and fine.accepted, fine
    assert (await job(nc, fine.job_id)).config.extras["x"] == _nested(60)


async def test_name_is_unique_among_unfinished_jobs_even_under_concurrent_replicas(nats_url, nc):
    async with validator(nats_url), validator(nats_url):
        verdicts = await asyncio.gather(*(client.submit(nc, config("same"), timeout=15) for _ in range(8)))
        accepted = [v for _, v in verdicts if v and v.accepted]
        rejected = [v for _, v in verdicts if v and not v.accepted]
        assert len(accepted) == 1 and len(rejected) == 7
        assert all(v.errors[0].path == "jobName" and "not finished" in v.errors[0].reason for v in rejected)

        # Once the holder is finished, the name is free again.
        kv = await nc.jetstream().key_value(subjects.JOBS_BUCKET)
        entry = await kv.get(accepted[0].job_id)
        done = JobRecord.from_bytes(entry.value).model_copy(update={"state": JobState.SUCCEEDED})
        await kv.update(accepted[0].job_id, done.to_bytes(), last=entry.revision)
        _, again = await client.submit(nc, config("same"), timeout=10)
    assert again is not None and again.accepted and again.job_id != accepted[0].job_id


async def test_redelivered_submission_converges_on_one_job(nats_url, nc):
    """The same submission handled twice (a crash before the ack) yields one job, one verdict."""
    js, buckets = await bus.ensure_jetstream(nc)
    v = Validator(nc, js, buckets)
    received = now()
    first = await v.judge("dup1", "bob", config("twice"), received)
    second = await v.judge("dup1", "bob", config("twice"), received)
    assert first.accepted and second.accepted and first.job_id == second.job_id
    assert len(await store.keys(buckets[subjects.JOBS_BUCKET])) == 1
    assert [e.kind for e in await history(nc, first.job_id)] == ["accepted"]


async def test_killing_a_validator_replica_mid_stream_loses_no_submission(nats_url, nc, procs):
    n, first = 150, 20
    await bus.ensure_jetstream(nc)
    js = nc.jetstream()
    sids = [uuid.uuid4().hex for _ in range(n)]

    async def submit(i: int) -> None:
        await js.publish(
            subjects.submit("bulk"),
            config(f"job-{i}"),
            headers={Headers.SUBMISSION_ID: sids[i], Headers.MSG_ID: sids[i]},
        )

    for i in range(first):
        await submit(i)
    a = procs.start("muster.services.validator")
    deadline = time.monotonic() + 30
    while await count_verdicts(nc) < 10 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    # Freeze replica a while it works: its open pull request (32 messages, fewer used) takes
    # what is published now, so a holds submissions it never acks, however fast it judged the
    # first ones. Then kill it outright beside a live replica and bring a new one up.
    a.send_signal(signal.SIGSTOP)
    for i in range(first, n):
        await submit(i)
    held, deadline = 0, time.monotonic() + 10
    while not held and time.monotonic() < deadline:
        info = await js.consumer_info(subjects.SUBMISSIONS_STREAM, subjects.VALIDATOR_CONSUMER)
        held = info.num_ack_pending
        await asyncio.sleep(0.05)
    assert held, "replica a held no submission when it was killed"
    b = procs.start("muster.services.validator")
    a.send_signal(signal.SIGKILL)
    a.wait(5)
    procs.start("muster.services.validator")
    deadline = time.monotonic() + 60
    while await count_verdicts(nc) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert b.poll() is None
    kv = await js.key_value(subjects.JOBS_BUCKET)
    for i, sid in enumerate(sids):
        verdict = await client.stored_verdict(nc, sid, "bulk")
        assert verdict is not None and verdict.accepted, (i, verdict)
        try:
            record = JobRecord.from_bytes((await kv.get(verdict.job_id)).value)
        except KeyNotFoundError:
            pytest.fail(f"submission {i} has a verdict but no job record")
        assert record.job_name == f"job-{i}"
    assert len(await store.keys(kv)) == n


async def count_verdicts(nc) -> int:
    info = await nc.jetstream().stream_info(
        subjects.EVENTS_STREAM, subjects_filter=subjects.verdict("*", "*")
    )
    return len(info.state.subjects or {})


def random_json(rng, depth: int = 0):
    kinds = ["null", "bool", "int", "float", "str"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, -1, 1, 2**70, rng.randint(-1000, 100000)])
    if kind == "float":
        return rng.choice([0.5, -1e300, 1e-9])
    if kind == "str":
        return rng.choice(["", " ", "..", "a/../b", "x\x00y", "ümlaut", "$PAI_X", "a" * 100])
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["jobName", "image", "taskRoles", "name", "taskNumber", "memoryMB", "command", "portList", "zzz"]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def mutate(rng, value):
    """Replace, delete or add one thing somewhere inside a decoded config."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(list(value))
        choice = rng.random()
        if choice < 0.3:
            del value[key]
        elif choice < 0.6:
            value[key] = random_json(rng)
        else:
            value[key] = mutate(rng, value[key])
        return value
    if isinstance(value, list) and value and rng.random() < 0.7:
        i = rng.randrange(len(value))
        value[i] = mutate(rng, value[i])
        return value
    return random_json(rng)


async def test_random_and_mutated_payloads_all_get_a_verdict_from_the_live_validator(nats_url, nc):
    import random

    from muster.shared.loader import loads
    from tests.conftest import CORPUS

    rng = random.Random(20261122)
    corpus = [loads(p.read_bytes(), p.name) for p in sorted(CORPUS.glob("*.json"))]
    payloads = [json.dumps(random_json(rng)).encode() for _ in range(40)]
    for _ in range(60):
        cfg = json.loads(json.dumps(rng.choice(corpus)))
        cfg["jobName"] = f"m{rng.randrange(10**9)}"
        payloads.append(json.dumps(mutate(rng, cfg) if rng.random() < 0.8 else cfg).encode())
    payloads.append(b"\x00\x01\x02")
    async with validator(nats_url):
        results = await asyncio.gather(*(client.submit(nc, p, timeout=30) for p in payloads))
    verdicts = [v for _, v in results]
    assert all(v is not None for v in verdicts)
    for v in verdicts:
        assert v.accepted == (v.job_id is not None) == (not v.errors)
    assert any(v.accepted for v in verdicts) and any(not v.accepted for v in verdicts)


async def test_admission_holds_submissions_while_too_many_jobs_wait_for_a_first_look(
    nats_url, nc, monkeypatch
):
    """Past MUSTER_ADMISSION_BACKLOG accepted jobs no scheduler has looked at, a submission is
    held (in its stream, acknowledged) until a scheduler looks at one, or at most
    MUSTER_ADMISSION_WAIT: a burst cannot take the CPU placement needs, and nothing is lost."""
    monkeypatch.setenv("MUSTER_ADMISSION_BACKLOG", "3")
    monkeypatch.setenv("MUSTER_ADMISSION_WAIT", "30")
    await bus.ensure_jetstream(nc)
    kv = await nc.jetstream().key_value(subjects.JOBS_BUCKET)
    async with validator(nats_url):
        first = []
        for i in range(3):
            _, verdict = await client.submit(nc, config(f"burst-{i}"), user="alice", timeout=20)
            assert verdict is not None and verdict.accepted
            first.append(verdict.job_id)
        sid, verdict = await client.submit(nc, config("burst-3"), user="alice", timeout=2)
        assert verdict is None  # held: three jobs wait for a scheduler's first look
        sub = await nc.subscribe(subjects.verdict("alice", sid))
        # A scheduler looks at one (it cannot place it now, and says why): room for one more.
        entry = await kv.get(first[0])
        looked = JobRecord.from_bytes(entry.value).model_copy(update={"reason": "waiting for 1 free GPU"})
        await kv.update(first[0], looked.to_bytes(), last=entry.revision)
        verdict = await client.wait_verdict(nc, sub, sid, 20, "alice")
        assert verdict is not None and verdict.accepted, "held past the room it was waiting for"

    # With nobody looking at all, a held submission is still judged, after the longest wait.
    monkeypatch.setenv("MUSTER_ADMISSION_WAIT", "3")
    async with validator(nats_url):
        began = time.monotonic()
        _, verdict = await client.submit(nc, config("burst-4"), user="alice", timeout=30)
        assert verdict is not None and verdict.accepted
        assert time.monotonic() - began >= 2.9


def test_admission_settings_are_checked_naming_the_variable(monkeypatch):
    from muster.services.validator.service import admission_settings

    monkeypatch.delenv("MUSTER_ADMISSION_BACKLOG", raising=False)
    monkeypatch.delenv("MUSTER_ADMISSION_WAIT", raising=False)
    assert admission_settings() == (2000, 5.0)
    monkeypatch.setenv("MUSTER_ADMISSION_BACKLOG", "0")
    assert admission_settings()[0] > 10**15  # 0: never held
    for name, value in (("MUSTER_ADMISSION_BACKLOG", "-1"), ("MUSTER_ADMISSION_WAIT", "soon")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=name):
            admission_settings()
        monkeypatch.setenv(name, "1")
