"""Virtual clusters: the operator's records in bucket `muster_vcs` (`muster admin vc ...`), which
the live validator watches: an unknown VC, one that does not admit the submitter, or a priority
above the VC's highest is refused with the reason; changes apply without a restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable

import pytest
from nats.js.kv import KeyValue

from muster.services.cli.mesh import local_identity, local_user
from muster.services.validator.service import Validator
from muster.shared import bus, client, subjects
from muster.shared.messages import Quota, Verdict, VirtualCluster, now
from tests.test_cli import VALID, mesh, muster, write
from tests.test_validator import config, validator

__all__ = ["mesh"]  # a fixture: `muster up --no-agent` on a free port


@pytest.fixture
async def nc(nats_url: str):
    conn = await bus.connect("test", nats_url)
    yield conn
    await conn.close()


@contextlib.asynccontextmanager
async def running(nc, *records: VirtualCluster) -> AsyncIterator[tuple[Validator, KeyValue]]:
    """A validator in this process (its view of the VCs can be looked at), `records` stored first."""
    js, buckets = await bus.ensure_jetstream(nc)
    vcs = buckets[subjects.VCS_BUCKET]
    for vc in records:
        await vcs.put(vc.name, vc.to_bytes())
    v = Validator(nc, js, buckets)
    stop = asyncio.Event()
    task = asyncio.create_task(v.run(stop))
    try:
        yield v, vcs
        assert not task.done(), "the validator stopped"
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)


async def until(cond: Callable[[], bool], timeout: float = 10) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


_n = 0


async def submit(nc, user: str, vc: str | None = None, priority: str | None = None) -> Verdict:
    """A small job from `user` naming `vc` (None: no virtualCluster field) at `priority`."""
    global _n
    _n += 1
    extra: dict[str, object] = {}
    if vc is not None:
        extra["virtualCluster"] = vc
    if priority is not None:
        extra["priority"] = priority
    _, verdict = await client.submit(nc, config(f"vc-job-{_n}", **extra), user=user, timeout=30)
    assert verdict is not None, "no verdict"
    return verdict


def errors(verdict: Verdict) -> list[tuple[str, str]]:
    return [(e.path, e.reason) for e in verdict.errors]


RESEARCH = VirtualCluster(
    name="research", quota=Quota(gpus={"V100": 4}), users=["alice"], max_priority="normal"
)


# ---------------------------------------------------------------- the validator


async def test_default_needs_no_record_at_all(nats_url, nc):
    """The service as it runs (bus set-up included), with an empty VCs bucket."""
    async with validator(nats_url):
        for vc, priority in ((None, None), ("default", "high"), ("", "low")):
            verdict = await submit(nc, "bob", vc, priority)
            assert verdict.accepted, (vc, priority, verdict.errors)


async def test_an_unknown_vc_is_refused_naming_it_and_the_known_ones(nc):
    alpha = VirtualCluster(name="alpha")
    async with running(nc, RESEARCH, alpha):
        verdict = await submit(nc, "alice", "nope")
    assert not verdict.accepted and verdict.job_id is None
    assert errors(verdict) == [
        ("virtualCluster", "no virtual cluster 'nope'; known: default, alpha, research")
    ]


async def test_only_users_a_vc_admits_may_submit_to_it(nc):
    async with running(nc, RESEARCH, VirtualCluster(name="open", users=["*"])):
        bob = await submit(nc, "bob", "research")
        alice = await submit(nc, "alice", "research")
        anyone = await submit(nc, "bob", "open")
    assert errors(bob) == [("virtualCluster", "user 'bob' may not submit to virtual cluster 'research'")]
    assert alice.accepted, alice.errors
    assert anyone.accepted, anyone.errors


async def test_a_priority_above_the_vcs_highest_is_refused_at_or_below_accepted(nc):
    async with running(nc, RESEARCH):
        high = await submit(nc, "alice", "research", "high")
        normal = await submit(nc, "alice", "research", "normal")
        low = await submit(nc, "alice", "research", "low")
        unsaid = await submit(nc, "alice", "research")  # "normal" by default
    assert errors(high) == [
        ("priority", "'high' is above virtual cluster 'research''s highest priority, 'normal'")
    ]
    assert normal.accepted and low.accepted and unsaid.accepted


async def test_a_record_named_default_overrides_the_implicit_default(nc):
    strict = VirtualCluster(name="default", users=["alice"], max_priority="low")
    async with running(nc, strict):
        bob = await submit(nc, "bob")
        alice = await submit(nc, "alice", "default", "normal")
        alice_low = await submit(nc, "alice", None, "low")
    assert errors(bob) == [
        ("virtualCluster", "user 'bob' may not submit to virtual cluster 'default'"),
        ("priority", "'normal' is above virtual cluster 'default''s highest priority, 'low'"),
    ]
    assert errors(alice) == [
        ("priority", "'normal' is above virtual cluster 'default''s highest priority, 'low'")
    ]
    assert alice_low.accepted, alice_low.errors


async def test_records_written_while_the_validator_runs_take_effect_without_a_restart(nc):
    async with running(nc) as (v, vcs):
        before = await submit(nc, "alice", "research")
        assert errors(before) == [("virtualCluster", "no virtual cluster 'research'; known: default")]

        await vcs.put("research", RESEARCH.to_bytes())
        await until(lambda: "research" in v.vcs)
        assert (await submit(nc, "alice", "research")).accepted
        assert not (await submit(nc, "bob", "research")).accepted

        # Opened to everyone and capped at low; then removed.
        changed = RESEARCH.model_copy(update={"users": ["*"], "max_priority": "low"})
        await vcs.put("research", changed.to_bytes())
        await until(lambda: v.vcs["research"].max_priority == "low")
        bob = await submit(nc, "bob", "research", "low")
        assert bob.accepted, bob.errors
        assert [p for p, _ in errors(await submit(nc, "bob", "research", "normal"))] == ["priority"]

        await vcs.purge("research")
        await until(lambda: "research" not in v.vcs)
        gone = await submit(nc, "alice", "research")
        assert errors(gone) == [("virtualCluster", "no virtual cluster 'research'; known: default")]


async def test_a_garbage_record_is_skipped_and_breaks_no_other_vc(nc):
    _, buckets = await bus.ensure_jetstream(nc)
    vcs = buckets[subjects.VCS_BUCKET]
    await vcs.put("broken", b"not a virtual cluster")
    await vcs.put("extra", json.dumps({"name": "extra", "colour": "blue"}).encode())  # unknown field
    # A record stored under another VC's name: not believed (the key is the name jobs give).
    await vcs.put("mislabeled", VirtualCluster(name="research").to_bytes())
    async with running(nc, RESEARCH) as (v, vcs):
        assert (await submit(nc, "alice", "research")).accepted
        broken = await submit(nc, "alice", "broken")
        assert errors(broken) == [("virtualCluster", "no virtual cluster 'broken'; known: default, research")]
        assert not (await submit(nc, "bob", "mislabeled")).accepted
        assert not (await submit(nc, "bob", "research")).accepted  # still research's own record

        # A good record turned into garbage while running: that VC is gone, the others stay.
        await vcs.put("alpha", VirtualCluster(name="alpha").to_bytes())
        await until(lambda: "alpha" in v.vcs)
        await vcs.put("alpha", b"\xff\x00")
        await until(lambda: "alpha" not in v.vcs)
        assert not (await submit(nc, "alice", "alpha")).accepted
        assert (await submit(nc, "alice", "research")).accepted
        assert (await submit(nc, "bob")).accepted
    assert sorted(v.vcs) == ["research"]


async def test_a_redelivered_submission_keeps_its_verdict_when_the_vc_changes(nc):
    """The job id is the submission's: a redelivery after the VC changed is the same job."""
    async with running(nc, RESEARCH) as (v, vcs):
        await until(lambda: "research" in v.vcs)
        data = config("redelivered", virtualCluster="research")
        first = await v.judge("same-sid", "alice", data, now())
        await vcs.purge("research")
        await until(lambda: "research" not in v.vcs)
        again = await v.judge("same-sid", "alice", data, now())
    assert first.accepted and again.accepted and again.job_id == first.job_id


# ---------------------------------------------------------------- muster admin vc


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


async def test_admin_vc_set_list_remove_round_trip_through_the_cli(mesh, tmp_path):
    _, env = mesh
    me = local_user()  # the admin identity `muster up` made for this machine's user

    r = muster(
        "admin", "vc", "set", "research", "--gpus", "4xV100,2xT4", "--cpus", "32", "--memory-mb", "65536",
        "--users", "alice,bob", "--max-priority", "normal", "--no-borrow", env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("research: set")

    r = muster("admin", "vc", "list", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert [VirtualCluster.model_validate(x) for x in json.loads(r.stdout)] == [
        VirtualCluster(
            name="research",
            quota=Quota(gpus={"V100": 4, "T4": 2}, cpus=32, memory_mb=65536),
            users=["alice", "bob"],
            max_priority="normal",
            borrow=False,
        )
    ]
    r = muster("admin", "vc", "list", env=env)
    assert r.returncode == 0, r.stderr
    rows = [re.split(r"\s{2,}", line) for line in r.stdout.splitlines()]
    assert rows == [
        ["NAME", "QUOTA", "USERS", "MAX PRIORITY", "BORROW"],
        ["default", "what the others leave", "*", "high", "yes"],
        ["research", "4xV100,2xT4, 32 CPUs, 65536 MB", "alice,bob", "normal", "no"],
    ]

    # The validator applies it to the next submission: this admin is not one of research's users.
    job = write(tmp_path, "r.json", json.dumps(dict(VALID, jobName="in-research", virtualCluster="research")))
    r = muster("submit", job, env=env)
    assert r.returncode == 2
    assert f"virtualCluster: user '{me}' may not submit to virtual cluster 'research'" in r.stderr

    assert muster("admin", "vc", "set", "research", "--max-priority", "normal", env=env).returncode == 0
    r = muster("submit", job, env=env)
    assert r.returncode == 0 and "accepted" in r.stdout, r.stderr
    high = write(
        tmp_path, "h.json", json.dumps(dict(VALID, jobName="hi", virtualCluster="research", priority="high"))
    )
    r = muster("submit", high, env=env)
    assert r.returncode == 2
    assert "priority: 'high' is above virtual cluster 'research''s highest priority, 'normal'" in r.stderr

    # Bad values exit 2 naming the flag, before anything is written.
    for args, named in (
        (("--gpus", "4xV100,foo"), "--gpus"),
        (("--gpus", "4xV100,2x"), "--gpus"),
        (("--cpus", "-1"), "--cpus"),
        (("--memory-mb", "lots"), "--memory-mb"),
        (("--users", "alice,b/c"), "--users"),
        (("--max-priority", "urgent"), "--max-priority"),
    ):
        r = muster("admin", "vc", "set", "research", *args, env=env)
        line = _one_line(r.stderr)
        assert r.returncode == 2 and named in line, (args, r.stderr)
    r = muster("admin", "vc", "set", "a.b", env=env)
    assert r.returncode == 2 and "NAME" in _one_line(r.stderr)
    r = muster("admin", "vc", "list", "--json", env=env)
    assert [x["max_priority"] for x in json.loads(r.stdout)] == ["normal"]  # unchanged

    # A record that does not decode is shown (to be fixed or removed) and left out of --json.
    nc = await bus.connect("test", env["MUSTER_NATS_URL"], credentials=local_identity(env["MUSTER_NATS_URL"]))
    await (await nc.jetstream().key_value(subjects.VCS_BUCKET)).put("junk", b"{")
    await nc.close()
    r = muster("admin", "vc", "list", env=env)
    assert ["junk", "(does not decode: ignored)", "-", "-", "-"] in [
        re.split(r"\s{2,}", line) for line in r.stdout.splitlines()
    ], r.stdout
    r = muster("admin", "vc", "list", "--json", env=env)
    assert [x["name"] for x in json.loads(r.stdout)] == ["research"]
    assert muster("admin", "vc", "remove", "junk", env=env).returncode == 0

    r = muster("admin", "vc", "remove", "research", env=env)
    assert r.returncode == 0 and "research: removed" in r.stdout, r.stderr
    r = muster("admin", "vc", "list", "--json", env=env)
    assert json.loads(r.stdout) == []
    r = muster("admin", "vc", "remove", "research", env=env)
    assert r.returncode == 2 and "no virtual cluster 'research'" in _one_line(r.stderr)
    r = muster(
        "submit",
        write(tmp_path, "r2.json", json.dumps(dict(VALID, jobName="r2", virtualCluster="research"))),
        env=env,
    )
    assert r.returncode == 2 and "virtualCluster: no virtual cluster 'research'; known: default" in r.stderr


def test_only_admins_manage_virtual_clusters(mesh, tmp_path):
    _, env = mesh
    r = muster("admin", "user", "add", "carol", env=env)
    assert r.returncode == 0, r.stderr
    creds = re.search(r"MUSTER_CREDENTIALS=(\S+)\)", r.stdout)
    assert creds, r.stdout
    carol = {**env, "MUSTER_CREDENTIALS": creds[1]}
    for args in (("set", "mine"), ("remove", "default"), ("list",)):
        r = muster("admin", "vc", *args, env=carol)
        assert r.returncode == 1 and "takes an admin identity" in _one_line(r.stderr), (args, r.stderr)
    # The admin restricts the default VC; carol is refused under her own name.
    assert muster("admin", "vc", "set", "default", "--users", "alice", env=env).returncode == 0
    r = muster("submit", write(tmp_path, "c.json", json.dumps(VALID)), env=carol)
    assert r.returncode == 2
    assert "virtualCluster: user 'carol' may not submit to virtual cluster 'default'" in r.stderr
    r = muster("admin", "vc", "remove", "default", env=env)
    assert r.returncode == 0 and "open to everyone again" in r.stdout
    r = muster("submit", write(tmp_path, "c2.json", json.dumps(dict(VALID, jobName="c2"))), env=carol)
    assert r.returncode == 0, r.stderr
