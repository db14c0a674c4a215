"""Submission ids: the same id with the same config is one job; with another config, a rejection."""

from __future__ import annotations

import json

import pytest
from nats.js.errors import KeyNotFoundError

from muster.services.validator.service import Validator
from muster.shared import bus, store, subjects
from muster.shared.messages import Verdict, now
from muster.shared.subjects import Headers
from tests.test_validator import config, validator


@pytest.fixture
async def nc(nats_url: str):
    conn = await bus.connect("test", nats_url)
    yield conn
    await conn.close()


async def test_a_reused_submission_id_with_another_config_is_rejected_naming_the_header(nc):
    js, buckets = await bus.ensure_jetstream(nc)
    v = Validator(nc, js, buckets)
    first = await v.judge("reused", "bob", config("one"), now())
    second = await v.judge("reused", "bob", config("two"), now())
    assert first.accepted and not second.accepted
    assert [(e.path, e.reason) for e in second.errors] == [
        (Headers.SUBMISSION_ID, f"already used by job {first.job_id} with a different config")
    ]
    assert second.job_id is None and second.job_name == "two"
    assert await store.keys(buckets[subjects.JOBS_BUCKET]) == [first.job_id]
    # The rejected config claimed nothing: its name is free for a submission of its own.
    try:
        await buckets[subjects.JOB_NAMES_BUCKET].get("two")
        raise AssertionError("the rejected submission holds the name 'two'")
    except KeyNotFoundError:
        pass
    assert (await v.judge("fresh", "bob", config("two"), now())).accepted


async def test_the_same_config_under_the_same_id_is_one_job_whatever_its_bytes(nc):
    js, buckets = await bus.ensure_jetstream(nc)
    v = Validator(nc, js, buckets)
    original = config("same")
    reformatted = json.dumps(dict(reversed(json.loads(original).items())), indent=2).encode()
    as_yaml = (
        b"taskRoles:\n  - {name: worker, taskNumber: 2, cpuNumber: 1, memoryMB: 256, gpuNumber: 0,"
        b" command: 'true'}\nimage: python:3.11\njobName: same\n"
    )
    verdicts = [await v.judge("again", "bob", p, now()) for p in (original, original, reformatted, as_yaml)]
    assert all(x.accepted for x in verdicts), verdicts
    assert {x.job_id for x in verdicts} == {verdicts[0].job_id}
    assert len(await store.keys(buckets[subjects.JOBS_BUCKET])) == 1


async def test_two_configs_published_under_one_id_get_two_verdicts_from_the_live_validator(nats_url, nc):
    """A raw publish (each with its own Nats-Msg-Id, as a client retrying with a changed file
    would): both reach the validator, and the second gets its own rejection, stored too."""
    await bus.ensure_jetstream(nc)
    sub = await nc.subscribe(subjects.verdict("u", "shared-id"))
    for n, name in enumerate(("first", "second")):
        await nc.jetstream().publish(
            subjects.submit("u"),
            config(name),
            headers={Headers.SUBMISSION_ID: "shared-id", Headers.MSG_ID: f"m{n}"},
        )
    async with validator(nats_url):
        got = [Verdict.from_bytes((await sub.next_msg(timeout=30)).data) for _ in range(2)]
    assert [(x.accepted, x.job_name) for x in got] == [(True, "first"), (False, "second")]
    assert got[1].errors[0].path == Headers.SUBMISSION_ID
    assert got[0].job_id in got[1].errors[0].reason
    stored = await nc.jetstream().get_last_msg(subjects.EVENTS_STREAM, subjects.verdict("u", "shared-id"))
    assert Verdict.from_bytes(stored.data) == got[1]
