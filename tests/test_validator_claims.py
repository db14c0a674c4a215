"""Job name claims (bucket muster_job_names) never outlive a submission that was not accepted."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from nats.js.errors import KeyNotFoundError

from muster.services.validator.service import Validator
from muster.shared import bus, client, subjects
from muster.shared.messages import job_id_for, now
from tests.conftest import lagging
from tests.test_validator import config


@pytest.fixture
async def nc(nats_url: str):
    conn = await bus.connect("test", nats_url)
    yield conn
    await conn.close()


@contextlib.asynccontextmanager
async def running(v: Validator):
    stop = asyncio.Event()
    task = asyncio.create_task(v.run(stop))
    try:
        yield v
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def claim_of(nc, name: str, user: str | None = None) -> str | None:
    kv = await nc.jetstream().key_value(subjects.JOB_NAMES_BUCKET)
    try:
        return (await kv.get(subjects.name_key(user or client.submitter(nc), name))).value.decode()
    except KeyNotFoundError:
        return None


async def test_a_submission_given_up_on_releases_its_name(nc, monkeypatch):
    js, buckets = await bus.ensure_jetstream(nc)
    v = Validator(nc, js, buckets)

    async def crash(*_args, **_kwargs):
        raise RuntimeError("seam: judging crashes after the name is claimed")

    async with running(v):
        monkeypatch.setattr(v.jobs, "create", crash)  # every delivery crashes after the claim
        _, verdict = await client.submit(nc, config("crashy"), timeout=90)
        assert verdict is not None and not verdict.accepted
        assert "internal error" in verdict.errors[0].reason
        assert await claim_of(nc, "crashy") is None, "the claim outlived the rejected submission"
        monkeypatch.undo()
        _, again = await client.submit(nc, config("crashy"), timeout=30)
    assert again is not None and again.accepted, again
    assert await claim_of(nc, "crashy") == again.job_id


async def test_a_claim_with_no_job_record_is_taken_over_after_the_claim_timeout(nc):
    js, buckets = await bus.ensure_jetstream(nc)
    ghost = job_id_for("bob", "ghost")  # claimed by a submission that never wrote its record
    await buckets[subjects.JOB_NAMES_BUCKET].put(subjects.name_key("bob", "orphan"), ghost.encode())
    v = Validator(nc, js, buckets)
    v.claim_timeout = 3600.0
    early = await v.judge("s-early", "bob", config("orphan"), now())
    assert not early.accepted and "being accepted" in early.errors[0].reason
    v.claim_timeout = 0.0
    late = await v.judge("s-late", "bob", config("orphan"), now())
    assert late.accepted, late
    assert await claim_of(nc, "orphan", "bob") == late.job_id


async def test_a_claim_is_released_only_while_it_points_at_the_job_given_up_on(nc):
    js, buckets = await bus.ensure_jetstream(nc)
    names = buckets[subjects.JOB_NAMES_BUCKET]
    v = Validator(nc, js, buckets)
    await names.put(subjects.name_key("bob", "kept"), b"jsomeoneelse")
    await v.release_name(subjects.name_key("bob", "kept"), job_id_for("bob", "mine"))
    assert await claim_of(nc, "kept", "bob") == "jsomeoneelse"
    await v.release_name(subjects.name_key("bob", "absent"), job_id_for("bob", "mine"))  # nothing: no error
    # A claim whose job has a record is that job's, even if its submission was then given up on.
    accepted = await v.judge("mine", "bob", config("real"), now())
    await v.give_up("mine", "bob", config("real"))
    assert await claim_of(nc, "real", "bob") == accepted.job_id


def test_claim_timeout_setting(monkeypatch):
    from muster.services.validator.service import claim_timeout

    assert claim_timeout() == 300.0
    monkeypatch.setenv("MUSTER_NAME_CLAIM_TIMEOUT", "0.5")
    assert claim_timeout() == 0.5
    for bad in ("-1", "soon", "inf"):
        monkeypatch.setenv("MUSTER_NAME_CLAIM_TIMEOUT", bad)
        with pytest.raises(ValueError, match="MUSTER_NAME_CLAIM_TIMEOUT must be a number of seconds"):
            claim_timeout()


async def test_a_live_jobs_name_is_neither_released_nor_taken_over_where_a_replica_lags(nc):
    """The name claims read the job that holds a name: a replica that has not applied the job's
    record yet (the seam, conftest.lagging) said there was none, so giving up on a redelivery
    released the name of a job that exists, and a second submission took over the name of a live
    job once the claim looked stale. The validator asks the stream's leader before either."""
    js, buckets = await bus.ensure_jetstream(nc)
    first = await Validator(nc, js, buckets).judge("s-first", "bob", config("taken"), now())
    assert first.accepted
    v = Validator(nc, js, {**buckets, **await lagging(js, subjects.JOBS_BUCKET)})
    v.claim_timeout = 0.0  # every claim looks stale: only the holder's record keeps the name
    second = await v.judge("s-second", "bob", config("taken"), now())
    assert not second.accepted and f"job {first.job_id} is WAITING" in second.errors[0].reason, second
    await v.give_up("s-first", "bob", config("taken"))
    assert await claim_of(nc, "taken", "bob") == first.job_id
