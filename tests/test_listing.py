"""Issue 23.1: the job list a page at a time. The index alone (services/gateway/listing.py), then
the gateway and `muster status` over a bucket whose whole list is far above the server's payload
limit: every job is listed, in pages that each fit, and an answer too large to send is said, not
swallowed."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from muster.services.gateway.listing import Listing, Query, Summary, cursor_key, micros
from muster.shared import bus, client, subjects
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import AttemptRecord, JobRecord, JobState, KillRequest, TaskStatus
from tests.conftest import count_calls, lagging
from tests.test_cli import muster

T0 = datetime(2024, 5, 1, tzinfo=UTC)
STATES = list(JobState)


def record(
    i: int,
    state: JobState = JobState.SUCCEEDED,
    *,
    user: str = "alice",
    vc: str = "default",
    command: str = "true",
    name: str | None = None,
    at: datetime | None = None,
) -> JobRecord:
    config = JobConfig.model_validate(
        {
            "jobName": name or f"job-{i}",
            "image": "img",
            "virtualCluster": vc,
            "taskRoles": [
                {
                    "name": "w",
                    "taskNumber": 2,
                    "cpuNumber": 1,
                    "memoryMB": 128,
                    "gpuNumber": 1,
                    "command": command,
                }
            ],
        }
    )
    return JobRecord(
        job_id=f"j{i:012x}",
        job_name=name or f"job-{i}",
        state=state,
        submission_id=f"s{i}",
        user=user,
        config=config,
        submitted_at=at or T0 + timedelta(seconds=i),
    )


def every_page(listing: Listing, query: Query, limit: int, budget: int = 1 << 20) -> list[list[str]]:
    pages, after = [], None
    while True:
        q = Query(query.scope, query.states, query.vc, query.name, query.since, query.until, after)
        page = listing.page(q, limit, budget)
        pages.append([j["job_id"] for j in page["jobs"]])
        if page["next"] is None:
            return pages
        after = cursor_key(page["next"])


# ---------------------------------------------------------------- the index, alone


def test_pages_give_every_job_once_newest_first_whatever_the_filters():
    rng = random.Random(7)
    listing, records = Listing(), {}
    # Out of order, some at the same instant (the job id breaks the tie), some updated later.
    for i in rng.sample(range(600), 600):
        r = record(
            i,
            rng.choice(STATES),
            user=rng.choice(["alice", "bob", "carol"]),
            vc=rng.choice(["default", "vision"]),
            at=T0 + timedelta(seconds=i // 3),
        )
        listing[r.job_id] = Summary.of(r)
        records[r.job_id] = r
    for job_id in rng.sample(sorted(records), 200):  # a change of state moves it between lists
        r = records[job_id] = records[job_id].model_copy(update={"state": rng.choice(STATES)})
        listing[job_id] = Summary.of(r)
    for job_id in rng.sample(sorted(records), 50):  # pruned
        del listing[job_id]
        del records[job_id]
    assert len(listing) == len(records) == 550

    since = T0 + timedelta(seconds=40)
    for query in (
        Query(subjects.ALL),
        Query("bob"),
        Query(subjects.ALL, (JobState.WAITING, JobState.RUNNING)),
        Query("carol", (JobState.FAILED,), vc="vision"),
        Query(subjects.ALL, name="JOB-1"),
        Query("alice", since=micros(since), until=micros(since + timedelta(seconds=60))),
    ):

        def admits(r: JobRecord, q: Query = query) -> bool:
            return (
                (q.scope == subjects.ALL or r.user == q.scope)
                and r.state in q.states
                and (q.vc is None or r.config.virtualCluster == q.vc)
                and (q.name is None or q.name.lower() in r.job_name.lower())
                and (q.since is None or micros(r.submitted_at) >= q.since)
                and (q.until is None or micros(r.submitted_at) < q.until)
            )

        expected = [
            r.job_id
            for r in sorted(records.values(), key=lambda r: (r.submitted_at, r.job_id), reverse=True)
            if admits(r)
        ]
        assert expected, query
        for limit in (1, 7, 1000):
            pages = every_page(listing, query, limit)
            assert [j for p in pages for j in p] == expected, (query, limit)
            assert all(len(p) <= limit for p in pages)
        first = listing.page(query, 5, 1 << 20)
        counts = {
            s.value: sum(admits(r, dataclasses.replace(query, states=(s,))) for r in records.values())
            for s in STATES
        }
        assert first["counts"] == counts and first["total"] == len(expected), query


def test_a_page_stops_at_its_byte_budget_and_the_next_goes_on_from_there():
    listing = Listing()
    for i in range(50):
        r = record(i, name=f"{'n' * 50}-{i}")
        listing[r.job_id] = Summary.of(r)
    one = len(json.dumps(listing.page(Query(subjects.ALL), 1, 1 << 20)["jobs"][0]))
    page = listing.page(Query(subjects.ALL), 1000, budget=one * 10 + 5)
    assert len(page["jobs"]) == 10 and page["next"] == Summary.of(record(40, name=f"{'n' * 50}-40")).cursor
    pages = every_page(listing, Query(subjects.ALL), 1000, budget=one * 10 + 5)
    assert [len(p) for p in pages] == [10] * 5


def test_a_summary_is_what_the_list_shows_and_a_bad_cursor_is_refused():
    r = record(3, JobState.WAITING, vc="vision", command="x" * 5000)
    shown = Summary.of(r).shown()
    assert shown == {
        "job_id": r.job_id,
        "job_name": "job-3",
        "user": "alice",
        "vc": "vision",
        "priority": "normal",
        "state": "WAITING",
        "tasks": 2,
        "gpus": 2,
        "attempt": 0,
        "submitted_at": "2024-05-01T00:00:03+00:00",
        "updated_at": r.updated_at.isoformat(),
        "reason": "waiting for a scheduler",
    }
    assert len(json.dumps(shown)) < 400  # not the 5 KB command
    for bad in ("", "12", "x.j1", "12.j 1", "1" * 20 + ".j1"):
        with pytest.raises(ValueError, match="cursor"):
            cursor_key(bad)


# ---------------------------------------------------------------- the gateway and `muster status`


async def _records(nats_url, procs, records: list[JobRecord], attempts: list[AttemptRecord] = ()):
    nc = await bus.connect("test", nats_url)
    _, buckets = await bus.ensure_jetstream(nc)
    kv = buckets[subjects.JOBS_BUCKET]
    for i in range(0, len(records), 200):
        await asyncio.gather(*(kv.put(r.job_id, r.to_bytes()) for r in records[i : i + 200]))
    for i in range(0, len(attempts), 100):
        await asyncio.gather(
            *(buckets[subjects.ATTEMPTS_BUCKET].put(a.key, a.to_bytes()) for a in attempts[i : i + 100])
        )
    gateway = procs.start("muster.services.gateway")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while loop.time() < deadline:  # until it answers, with the whole list read
        try:
            first = await client.ask(nc, "jobs", {"limit": 1}, timeout=2)
            if len(records) in (first.get("total"), len(first["jobs"])):
                break
        except (TimeoutError, client.Refused):
            pass
        await asyncio.sleep(0.2)
    return nc, gateway


async def test_status_lists_a_week_of_jobs_whose_whole_list_is_far_above_the_payload_limit(nats_url, procs):
    """1,300 jobs with 3.5 KB commands: 4.6 MB of records, above the server's 4 MB limit as one
    reply (it failed every time). Every job is listed, a page at a time, each page well within."""
    records = [
        record(i, JobState.RUNNING if i % 100 == 0 else JobState.SUCCEEDED, command="x" * 3500)
        for i in range(1300)
    ]
    assert sum(len(r.to_bytes()) for r in records) > 4 * 1024 * 1024
    nc, _ = await _records(nats_url, procs, records)
    try:
        env = procs.env()
        r = muster("status", env=env)
        assert r.returncode == 0, r.stderr
        rows = [line.split() for line in r.stdout.splitlines()[1:]]
        live = [f"job-{i}" for i in range(1200, -1, -100)]
        newest_finished = [f"job-{i}" for i in range(1299, 1200, -1) if i % 100][:20]
        assert [row[1] for row in rows] == live + newest_finished
        assert "13 running, 1,287 succeeded" in r.stderr

        r = muster("status", "--all", "--json", env=env)
        assert r.returncode == 0, r.stderr
        pages = [json.loads(line) for line in r.stdout.splitlines()]
        listed = [j["job_name"] for p in pages for j in p["jobs"]]
        assert listed == [f"job-{i}" for i in range(1299, -1, -1)]
        assert len(pages) == 13 and max(len(line) for line in r.stdout.splitlines()) < nc.max_payload // 4
        assert (
            pages[0]["total"] == 1300
            and pages[0]["counts"]["SUCCEEDED"] == 1287
            and pages[-1]["next"] is None
        )

        r = muster("status", "--state", "live", "--name", "JOB-1", "--limit", "5", env=env)
        assert r.returncode == 0, r.stderr
        assert [row.split()[1] for row in r.stdout.splitlines()[1:]] == [
            "job-1200",
            "job-1100",
            "job-1000",
            "job-100",
        ]
        since = (T0 + timedelta(seconds=1295)).isoformat()
        r = muster("status", "--all", "--since", since, env=env)
        assert [row.split()[1] for row in r.stdout.splitlines()[1:]] == [
            f"job-{i}" for i in range(1299, 1294, -1)
        ]
        r = muster("status", "--state", "dreaming", env=env)
        assert r.returncode == 2 and "--state" in r.stderr
    finally:
        await nc.close()


async def test_a_user_pages_only_their_own_jobs(nats_url, procs):
    records = [record(i, user=("alice", "bob")[i % 2]) for i in range(30)]
    nc, _ = await _records(nats_url, procs, records)
    try:
        pages = [p async for p in client.job_pages(nc, page=4, who="bob")]
        assert [j["job_name"] for p in pages for j in p["jobs"]] == [f"job-{i}" for i in range(29, 0, -2)]
        assert pages[0]["counts"]["SUCCEEDED"] == 15 and all(len(p["jobs"]) <= 4 for p in pages)
        with pytest.raises(client.Refused, match="only your own"):
            await client.ask(nc, "jobs", {"user": "alice"}, who="bob")
        with pytest.raises(client.Refused, match="cursor"):
            await client.ask(nc, "jobs", {"cursor": "not-one"}, who="bob")
        with pytest.raises(client.Refused, match="state"):
            await client.ask(nc, "jobs", {"state": ["DREAMING"]}, who="bob")
        with pytest.raises(client.Refused, match=r"since .* must be before until"):  # gave -3 jobs
            await client.ask(nc, "jobs", {"since": "2030-01-01T00:00:00Z", "until": "2020-01-01T00:00:00Z"})
        with pytest.raises(client.Refused, match="after: Input should be less than"):  # the server's 408
            await client.ask(nc, "logs", {"job_id": "j1", "after": 2**64 - 1})
        admin = [p async for p in client.job_pages(nc, user="alice", state=["SUCCEEDED"], limit=3)]
        assert [j["job_name"] for p in admin for j in p["jobs"]] == ["job-28", "job-26", "job-24"]
    finally:
        await nc.close()


def _attempts(job: JobRecord, count: int, tasks: int, lines: int = 0) -> list[AttemptRecord]:
    chatty = [f"{'y' * 1000} {n}" for n in range(lines)]
    return [
        AttemptRecord(
            job_id=job.job_id,
            attempt=n,
            tasks=[
                TaskStatus(role="w", role_no=0, index=i, node="n1", reason="z" * 1000, last_lines=chatty)
                for i in range(tasks)
            ],
        )
        for n in range(1, count + 1)
    ]


async def test_an_answer_above_the_payload_limit_is_refused_logged_and_counted(nats_url, procs):
    """A job's newest attempt and an earlier one asked for, together above the server's 4 MB
    limit: the answer used to be dropped without a word (the asker waited 10 s for nothing); now
    the asker is told at once, and the newest alone is answered."""
    job = record(1, JobState.FAILED).model_copy(update={"attempt": 5})
    attempts = _attempts(job, 5, tasks=70, lines=30)
    assert all(2.1e6 < len(a.to_bytes()) < 3e6 for a in attempts)
    nc, gateway = await _records(nats_url, procs, [job], attempts)
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(client.Refused, match="above the server's limit"):
            await client.ask(nc, "job", {"ref": job.job_id, "attempt": 1}, timeout=10)
        assert asyncio.get_running_loop().time() - started < 5
        assert (await client.ask(nc, "jobs"))["total"] == 1  # the gateway goes on
        newest = await client.ask(nc, "job", {"ref": job.job_id}, timeout=10)
        assert [a["attempt"] for a in newest["attempts"]] == [5] and newest["attempts_total"] == 5

        async def said() -> bool:
            return "gateway.answer_too_large" in gateway.log_path.read_text()

        for _ in range(50):
            if await said():
                break
            await asyncio.sleep(0.1)
        assert await said()
    finally:
        await nc.close()


async def test_a_job_restarted_a_thousand_times_is_shown_and_killed(nats_url, procs):
    """A job that restarts until killed (retryCount -2) or is preempted again and again has
    thousands of attempts. `job` read every one, one after another, and answered them all: past
    the server's payload limit (hours of restarts for a failing one) its status, logs and kill
    all failed, so the job could not be stopped with the tools. Now the newest are answered
    (at most 20, within a page), and an earlier one when asked for by number."""
    from muster.services.gateway.service import ATTEMPTS_SHOWN

    job = record(1, JobState.RUNNING).model_copy(update={"attempt": 1000})
    attempts = _attempts(job, 1000, tasks=2, lines=2)
    size = sum(len(a.to_bytes()) for a in attempts)
    assert size > 4.2e6  # the answer it was
    nc, _ = await _records(nats_url, procs, [job], attempts)
    try:
        answer = await client.ask(nc, "job", {"ref": job.job_id}, timeout=10)
        shown = [a["attempt"] for a in answer["attempts"]]
        assert shown == list(range(1001 - ATTEMPTS_SHOWN, 1001)) and answer["attempts_total"] == 1000
        asked = await client.ask(nc, "job", {"ref": job.job_id, "attempt": 3}, timeout=10)
        assert [a["attempt"] for a in asked["attempts"]][:2] == [3, 1001 - ATTEMPTS_SHOWN]
        env = procs.env()
        out = await asyncio.to_thread(muster, "status", job.job_id, env=env)
        assert out.returncode == 0, out.stderr
        assert f"the newest {ATTEMPTS_SHOWN} attempts of 1000: earlier ones are not shown" in out.stdout
        heard = await nc.subscribe(subjects.kill_request("alice"))
        killed = await asyncio.to_thread(muster, "kill", job.job_id, "--no-wait", env=env)
        assert killed.returncode == 0 and "kill requested" in killed.stdout, killed.stderr
        assert KillRequest.model_validate_json((await heard.next_msg(timeout=5)).data).job_id == job.job_id
    finally:
        await nc.close()


async def test_a_job_is_listed_as_soon_as_its_record_is_written(nats_url, procs):
    """Read your writes: a user who submits and lists at once sees the job, although the
    gateway's mirror hears of the record a moment after it is stored (CI saw the portal list
    nothing right after an accepted submit)."""
    nc, _ = await _records(nats_url, procs, [record(0)])
    try:
        kv = (await bus.ensure_jetstream(nc))[1][subjects.JOBS_BUCKET]
        for i in range(1, 31):
            await kv.put(record(i).job_id, record(i).to_bytes())
            page = await client.ask(nc, "jobs", {"limit": 1}, timeout=5)
            assert [j["job_name"] for j in page["jobs"]] == [f"job-{i}"]
    finally:
        await nc.close()


async def test_a_job_just_written_is_found_by_id_and_name_where_a_replica_lags(nats_url):
    """`muster status JOB` right after `muster submit` on three servers: the gateway's direct
    gets may be answered by a replica that has not applied the record yet, which said "no such
    job" of the id just printed. Such a replica is the seam (its reads find nothing); the
    gateway asks the stream's leader (the real server) before it says so, by id and by name, and
    still says it of a job there is not."""
    from muster.services.gateway.service import Gateway, Refused
    from muster.shared.messages import Question

    nc = await bus.connect("test", nats_url)
    try:
        js, buckets = await bus.ensure_jetstream(nc)
        job = record(1, JobState.WAITING, name="fresh")
        await buckets[subjects.JOBS_BUCKET].put(job.job_id, job.to_bytes())
        await buckets[subjects.JOB_NAMES_BUCKET].put(subjects.name_key("alice", "fresh"), job.job_id.encode())

        behind = await lagging(js, subjects.JOBS_BUCKET, subjects.JOB_NAMES_BUCKET, subjects.ATTEMPTS_BUCKET)
        gateway = Gateway(nc, js, {**buckets, **behind})
        assert await gateway.jobs.get(job.job_id) is None  # what it read before
        assert await gateway.resolve("alice", job.job_id) == job
        assert await gateway.resolve("alice", "fresh") == job
        answer = await gateway.job("alice", Question.model_validate({"ref": job.job_id}))
        assert answer["job"]["job_id"] == job.job_id
        with pytest.raises(Refused, match="no job with id or name 'j00000000009a'"):
            await gateway.resolve("alice", "j00000000009a")
    finally:
        await nc.close()


async def _pinged(nc: Any, monkeypatch: pytest.MonkeyPatch, ping: Any) -> Any:
    """A gateway in this process answering `ping` (a verb the test makes), on every asker's subject."""
    from muster.services.gateway.service import Gateway

    js, buckets = await bus.ensure_jetstream(nc)
    gateway = Gateway(nc, js, buckets)
    monkeypatch.setitem(Gateway.VERBS, "ping", ping)
    await nc.subscribe(subjects.api("*", "*"), cb=gateway._take)
    return gateway


def _pings(nc: Any, who: str, n: int) -> list[asyncio.Task[Any]]:
    return [asyncio.create_task(nc.request(subjects.api(who, "ping"), b"{}", timeout=10)) for _ in range(n)]


async def _first_answers(asks: list[asyncio.Task[Any]], n: int) -> list[dict[str, Any]]:
    """The first `n` answers to come (taken out of `asks`), within 10 s each."""
    answers: list[dict[str, Any]] = []
    while len(answers) < n:
        done, _ = await asyncio.wait(asks, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        assert done, "no answer came"
        for task in done:
            asks.remove(task)
            answers.append(json.loads(task.result().data))
    return answers


async def test_past_its_limit_of_questions_at_once_the_gateway_answers_busy_at_once(nats_url, monkeypatch):
    """Each question was taken off the subscription as it came, so the server's pending limits
    never applied: one asker flooding a costly question grew the gateway's work without bound,
    for every user. Past MAX_ANSWERING at once, a question is answered "busy" straight away."""
    from muster.services.gateway import service as gateway_service

    nc = await bus.connect("test", nats_url)
    try:
        release = asyncio.Event()

        async def slow_ping(self, who, request):  # type: ignore[no-untyped-def]
            await release.wait()
            return {"user": who}

        monkeypatch.setattr(gateway_service, "MAX_ANSWERING", 2)
        await _pinged(nc, monkeypatch, slow_ping)
        asks = _pings(nc, "alice", 5)
        busy = await _first_answers(asks, 3)  # the three past the limit, while two are in hand
        assert all("busy" in b["error"] for b in busy), busy
        release.set()
        answers = [json.loads((await t).data) for t in asks]
        assert answers == [{"user": "alice"}] * 2, answers
    finally:
        await nc.close()


async def test_one_askers_flood_leaves_the_others_room(nats_url, monkeypatch):
    """One user keeping the gateway's questions in hand (a slow question asked again and again)
    held every other user's and the portal's: all were answered "busy". Past MAX_PER_ASKER of
    one asker's at once, that asker is told so; another is answered as ever."""
    from muster.services.gateway import service as gateway_service

    nc = await bus.connect("test", nats_url)
    try:
        release = asyncio.Event()

        async def slow_ping(self, who, request):  # type: ignore[no-untyped-def]
            if who == "mallory":
                await release.wait()
            return {"user": who}

        monkeypatch.setattr(gateway_service, "MAX_ANSWERING", 10)
        monkeypatch.setattr(gateway_service, "MAX_PER_ASKER", 3)
        gateway = await _pinged(nc, monkeypatch, slow_ping)
        flood = _pings(nc, "mallory", 6)
        busy = await _first_answers(flood, 3)
        assert all("3 of your questions are in hand" in b["error"] for b in busy), busy
        for _ in range(3):  # another asker, while mallory's three are in hand
            assert json.loads((await nc.request(subjects.api("alice", "ping"), b"{}", timeout=5)).data) == {
                "user": "alice"
            }
        release.set()
        assert [json.loads((await t).data) for t in flood] == [{"user": "mallory"}] * 3
        assert not gateway.asking  # nothing left counted once answered
    finally:
        await nc.close()


async def test_the_vcs_answer_is_made_once_for_every_asker_within_seconds(nats_url, monkeypatch):
    """`vcs` reads two records per placed job. Any user asking it again and again (or many at
    once) made the gateway read the whole cluster's records each time; one answer now serves
    every asker for VCS_FRESH seconds."""
    from muster.services.gateway import service as gateway_service
    from muster.services.gateway.service import Gateway
    from muster.shared.messages import Question

    nc = await bus.connect("test", nats_url)
    stop = asyncio.Event()
    try:
        js, buckets = await bus.ensure_jetstream(nc)
        running = [record(i, JobState.RUNNING).model_copy(update={"attempt": 1}) for i in range(5)]
        for r in running:
            await buckets[subjects.JOBS_BUCKET].put(r.job_id, r.to_bytes())
            (a,) = _attempts(r, 1, tasks=2)
            await buckets[subjects.ATTEMPTS_BUCKET].put(a.key, a.to_bytes())
        gateway = Gateway(nc, js, buckets)
        serving = asyncio.create_task(gateway.run(stop))
        reads = count_calls(monkeypatch, gateway.jobs, "get")
        ask = Question()
        answers = await asyncio.gather(*(gateway.virtual_clusters(f"u{i}", ask) for i in range(20)))
        assert all(a == answers[0] for a in answers) and answers[0]["vcs"][0]["running"] == 5
        assert reads() == 5, reads()  # 100 before: each asker read every placed job's records
        await gateway.virtual_clusters("again", ask)
        assert reads() == 5, reads()
        monkeypatch.setattr(gateway_service, "VCS_FRESH", 0.0)  # seconds later: made again
        await asyncio.sleep(0.01)
        await gateway.virtual_clusters("later", ask)
        assert reads() == 10, reads()
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serving, 10)
        await nc.close()


async def test_an_answer_not_shaped_as_the_gateways_is_refused_not_a_traceback(nats_url):
    """Whatever answers on the gateway's subjects (an open bus, a broken gateway): an answer
    that is not a JSON object, or an error whose code is not an exit status, raised out of
    `muster` as a traceback or became its exit status. Now each is a refusal naming it."""
    nc = await bus.connect("test", nats_url)
    try:
        answers = iter(
            [b"<html>", b"[1, 2]", b'{"error": "no", "code": "x"}', b'{"error": "no", "code": 999}']
        )

        async def answer(msg):  # type: ignore[no-untyped-def]
            await msg.respond(next(answers))

        await nc.subscribe(subjects.api("*", "*"), cb=answer)
        for said, code in (("not a JSON object", 1), ("not a JSON object", 1), ("no", 1), ("no", 1)):
            with pytest.raises(client.Refused, match=said) as refused:
                await client.ask(nc, "jobs", who="alice")
            assert refused.value.code == code
    finally:
        await nc.close()
