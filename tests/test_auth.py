"""Issue 8, the bus: a real nats-server with authentication on, every service as its own
identity, two agents as their nodes, two users and an admin. Each party can do exactly its own
part: what the server refuses is checked through the server's own refusal (a permissions
violation), what a service refuses through the state it leaves unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client as NATS

from muster.shared import auth, bus, client, store, subjects
from muster.shared.messages import (
    Assignment,
    AttemptRecord,
    ClusterSpec,
    Endpoint,
    EndpointReported,
    JobRecord,
    JobState,
    KillRequest,
    MetricBatch,
    MetricPoint,
    NodeInfo,
    TaskCause,
    TaskEvent,
    TaskEventKind,
    TaskState,
    attempt_key,
    node_refusal,
    now,
)
from muster.shared.natsserver import NatsServer, free_port
from muster.shared.subjects import Headers
from tests.conftest import CORE, Cluster


class Secured(Cluster):
    """Services and agents as processes, each connecting as its own identity."""

    def __init__(self, url: str, log_dir: Path, keys: auth.AuthDir):
        super().__init__(url, log_dir)
        self.keys = keys
        self.identity: str | None = None
        self.metrics: dict[str, int] = {}  # identity: its /metrics port

    def env(self) -> dict[str, str]:
        env = super().env()
        if self.identity:
            env["MUSTER_CREDENTIALS"] = str(self.keys.creds(self.identity))
            env["MUSTER_METRICS_PORT"] = str(self.metrics[self.identity])
            env["MUSTER_AGENT_METRICS_PORT"] = str(self.metrics[self.identity])
        return env

    def start_as(self, identity: str, module: str, *args: str):
        self.identity = identity
        self.metrics[identity] = free_port()
        try:
            return self.start(module, *args)
        finally:
            self.identity = None


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Iterator[Secured]:
    tmp = tmp_path_factory.mktemp("secured")
    keys = auth.AuthDir(tmp / "auth")
    keys.ensure_services()
    keys.ensure("root", "admin")
    for user in ("alice", "bob"):
        keys.ensure(user, "user")
    for node in ("n1", "n2", "n3"):
        keys.ensure(auth.agent_name(node), "agent", node)
    with NatsServer(tmp / "nats", auth_config=keys.server_config) as server:

        async def declare() -> None:
            nc = await bus.connect("init", server.url, credentials=creds(keys, "root"))
            await bus.ensure_jetstream(nc)
            await nc.close()

        asyncio.run(declare())
        c = Secured(server.url, tmp, keys)
        for module in CORE:
            c.start_as(module.rsplit(".", 1)[-1], module)
        for node in ("n1", "n2"):
            c.start_as(
                auth.agent_name(node),
                "muster.services.agent",
                "--node",
                node,
                "--runtime",
                "process",
                "--cpus",
                "4",
                "--work-root",
                str(tmp / "work" / node),
                "--output-root",
                str(tmp / "output"),
                "--data-roots",
                f"{tmp}/users/{{user}},{tmp}/shared",
            )

        async def ready() -> None:
            """The gateway answers and both nodes are registered (a loaded machine is slow)."""
            nc = await bus.connect("ready", server.url, credentials=creds(keys, "root"))
            try:
                nodes = await nc.jetstream(timeout=5).key_value(subjects.NODES_BUCKET)
                for _ in range(600):
                    with contextlib.suppress(Exception):
                        await client.ask(nc, "ping", timeout=2)
                        if {"n1", "n2"} <= set(await store.keys(nodes)):
                            return
                    await asyncio.sleep(0.1)
                raise AssertionError(f"the secured mesh did not come up:\n{c.logs()}")
            finally:
                await nc.close()

        try:
            asyncio.run(ready())
            yield c
        finally:
            c.stop_all()


def creds(keys: auth.AuthDir, name: str) -> auth.Credentials:
    return auth.load_credentials(keys.creds(name))


async def connect(secured: Secured, name: str) -> NATS:
    return await bus.connect(name, secured.url, credentials=creds(secured.keys, name), quiet=True)


async def refused(nc: NATS, action, subject_part: str) -> None:
    """`action` fails, and the server says it refused something naming `subject_part`."""
    before = len(bus.refusals(nc))
    with pytest.raises((nats.errors.Error, TimeoutError, asyncio.TimeoutError, client.Refused)):
        await action()
    await nc.flush()
    await asyncio.sleep(0.1)
    new = bus.refusals(nc)[before:] if len(bus.refusals(nc)) > before else bus.refusals(nc)[-1:]
    assert any(subject_part.lower() in r.lower() for r in new), (subject_part, new)


async def wait_for(check, timeout: float = 60.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(every)
    raise AssertionError(f"not within {timeout}s")


async def job_as(nc: NATS, job_id: str) -> JobRecord:
    return JobRecord.model_validate((await client.ask(nc, "job", {"ref": job_id}))["job"])


def sleeper(name: str, seconds: int = 600, tasks: int = 1, **extra) -> bytes:
    return json.dumps(
        {
            "jobName": name,
            "image": "muster/base:bookworm",
            "taskRoles": [
                {
                    "name": "w",
                    "taskNumber": tasks,
                    "cpuNumber": 1,
                    "memoryMB": 128,
                    "gpuNumber": 0,
                    "command": f"echo user=$PAI_USERNAME; sleep {seconds}",
                }
            ],
            **extra,
        }
    ).encode()


async def running(nc: NATS, data: bytes) -> JobRecord:
    _, verdict = await client.submit(nc, data, timeout=30)
    assert verdict is not None and verdict.accepted, verdict
    assert verdict.job_id

    async def up():
        record = await job_as(nc, verdict.job_id)
        return record if record.state == JobState.RUNNING else None

    return await wait_for(up)


# ---------------------------------------------------------------- who may connect


async def test_a_client_without_credentials_gets_nothing(secured):
    with pytest.raises(ConnectionError, match=r"(?i)authorization"):
        await bus.connect("nobody", secured.url, connect_timeout=3, quiet=True)
    # A key pair the server does not know is no better.
    stranger = auth.new_credentials("mallory", "admin")
    with pytest.raises(ConnectionError, match=r"(?i)authorization"):
        await bus.connect("mallory", secured.url, connect_timeout=3, quiet=True, credentials=stranger)


# ---------------------------------------------------------------- agents


async def test_an_agent_cannot_act_for_another_node(secured):
    root = await connect(secured, "root")
    nc = await connect(secured, auth.agent_name("n1"))
    js = nc.jetstream(timeout=1)
    try:
        # Its own record: written by it (the agent started with the module's fixture registers
        # soon), never read back through a direct get, whose bytes the server would send to any
        # reply subject the agent named (a JetStream API request, another user's submission).
        # Another node's: refused by the server.
        by_root = await root.jetstream().key_value(subjects.NODES_BUCKET)
        for _ in range(300):
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                entry = await by_root.get("n1")
                break
            await asyncio.sleep(0.1)
        assert NodeInfo.from_bytes(entry.value).node == "n1"
        nodes = await js.key_value(subjects.NODES_BUCKET)
        await refused(nc, lambda: nodes.get("n1"), "DIRECT.GET.KV_muster_nodes")
        await refused(nc, lambda: nodes.put("n2", entry.value), "muster_nodes.n2")
        endpoint = subjects.task_event("jx", 1, "w", 0, "endpoint", "n1")
        await refused(
            nc, lambda: js.get_last_msg(subjects.EVENTS_STREAM, endpoint, direct=True), "endpoint.n1"
        )
        # Attempt records: listed through a consumer of its own, never another's deleted.
        await refused(
            nc, lambda: js.delete_consumer(f"KV_{subjects.ATTEMPTS_BUCKET}", "any"), "CONSUMER.DELETE"
        )
        ev = TaskEvent(job_id="jx", attempt=1, role="w", index=0, node="n2", kind=TaskEventKind.EXITED)
        await refused(
            nc, lambda: js.publish(subjects.task_event("jx", 1, "w", 0, "exited", "n2"), ev.to_bytes()), "n2"
        )
        await refused(
            nc,
            lambda: js.publish(subjects.task_event("jx", 1, "w", 0, "endpoint", "n2"), b"{}"),
            "endpoint.n2",
        )
        await refused(nc, lambda: js.publish(subjects.task_metrics("jx", 1, "w", 0, "n2"), b"{}"), "n2")
        # Another node's orders: neither its durable consumer nor a plain subscription.
        await refused(
            nc,
            lambda: bus.durable(
                js, subjects.node_commands("n2"), subjects.agent_consumer("n2"), subjects.COMMANDS_STREAM
            ),
            "agent-n2",
        )
        before = len(bus.refusals(nc))
        await nc.subscribe(subjects.node_commands("n2"))
        await nc.flush()
        await asyncio.sleep(0.3)
        assert any("muster.node.n2" in r for r in bus.refusals(nc)[before:]), bus.refusals(nc)
        # No job records (other users' specs), no secrets, no orders of its own to give.
        for bucket in (subjects.JOBS_BUCKET, subjects.SECRETS_BUCKET, subjects.JOB_NAMES_BUCKET):
            kv = await js.key_value(bucket)  # that it exists is no secret; what it holds is
            await refused(nc, lambda kv=kv: kv.get("anything"), f"kv_{bucket}")
            await refused(nc, lambda kv=kv: kv.keys(), f"kv_{bucket}")
        await refused(nc, lambda: js.publish(subjects.assign("n2"), b"{}"), "muster.node.n2.assign")
        await refused(nc, lambda: js.publish(subjects.cluster_spec("jx", 1), b"{}"), "spec")
    finally:
        await nc.close()
        await root.close()


# ---------------------------------------------------------------- users


async def test_users_see_and_kill_only_their_own_jobs(secured):
    alice, bob, root = [await connect(secured, n) for n in ("alice", "bob", "root")]
    try:
        job = await running(alice, sleeper("private"))
        # Bob asks about it by id and by name: it does not exist for him.
        for ref in (job.job_id, "private"):
            with pytest.raises(client.Refused, match="no job"):
                await client.ask(bob, "job", {"ref": ref})
        with pytest.raises(client.Refused, match="no job"):
            await client.ask(bob, "logs", {"job_id": job.job_id, "attempt": 1})
        with pytest.raises(client.Refused, match="no job"):
            await client.ask(bob, "metrics", {"job_id": job.job_id, "attempt": 1})
        assert job.job_id not in {j["job_id"] for j in (await client.ask(bob, "jobs"))["jobs"]}
        with pytest.raises(client.Refused, match="no job"):
            await client.ask(bob, "events", {"job_id": job.job_id})
        history = (await client.ask(alice, "events", {"job_id": job.job_id}))["events"]
        assert [e["kind"] for e in history][:1] == ["accepted"], history
        assert "running" in {e["kind"] for e in history}
        # Nor can he ask as alice, as everyone, or read the buckets and streams himself.
        await refused(bob, lambda: client.ask(bob, "jobs", who="alice", timeout=1), "muster.api.alice")
        await refused(bob, lambda: client.ask(bob, "jobs", who=subjects.ALL, timeout=1), "muster.api._all")
        bjs = bob.jetstream(timeout=1)
        await refused(bob, lambda: bjs.key_value(subjects.JOBS_BUCKET), "kv_muster_jobs")
        await refused(bob, lambda: bjs.stream_info(subjects.LOGS_STREAM), "muster_logs")
        await refused(
            bob, lambda: bjs.get_last_msg(subjects.LOGS_STREAM, f"muster.logs.{job.job_id}.>"), "muster_logs"
        )
        before = len(bus.refusals(bob))
        await bob.subscribe(subjects.task_logs(job.job_id))  # the live output, then
        await bob.subscribe(subjects.job_events(job.job_id))
        await bob.flush()
        await asyncio.sleep(0.3)
        assert len(bus.refusals(bob)) >= before + 2, bus.refusals(bob)
        # He cannot kill it as alice (the server refuses) nor as himself (the supervisor does).
        kill = KillRequest(job_id=job.job_id, user="bob", grace=0)
        await refused(bob, lambda: bjs.publish(subjects.kill_request("alice"), kill.to_bytes()), "kill.alice")
        await bjs.publish(subjects.kill_request("bob"), kill.to_bytes())
        await asyncio.sleep(3)
        assert (await job_as(alice, job.job_id)).state == JobState.RUNNING
        # The admin sees it, listed and by name, the same record alice sees; alice kills it.
        listed = {j["job_id"]: j for j in (await client.ask(root, "jobs"))["jobs"]}
        by_name = (await client.ask(root, "job", {"ref": "private"}))["job"]
        assert listed[job.job_id]["job_id"] == by_name["job_id"] == job.job_id
        assert listed[job.job_id]["user"] == JobRecord.model_validate(by_name).user == "alice"
        await alice.jetstream().publish(
            subjects.kill_request("alice"), kill.model_copy(update={"user": "alice"}).to_bytes()
        )

        async def stopped():
            return (await job_as(alice, job.job_id)).state == JobState.STOPPED

        await wait_for(stopped)
    finally:
        for nc in (alice, bob, root):
            await nc.close()


async def test_the_owner_is_the_authenticated_identity(secured):
    alice = await connect(secured, "alice")
    try:
        data = sleeper("whoami", seconds=0)
        # A header naming bob, and a submit subject naming bob: the first is ignored, the second
        # refused by the server.
        await refused(
            alice, lambda: alice.jetstream(timeout=1).publish(subjects.submit("bob"), data), "submit.bob"
        )
        sub = await alice.subscribe(subjects.verdict("alice", "who-1"))
        await alice.jetstream().publish(
            subjects.submit("alice"), data, headers={Headers.SUBMISSION_ID: "who-1", "Muster-User": "bob"}
        )
        verdict = await client.wait_verdict(alice, sub, "who-1", 30, "alice")
        assert verdict is not None and verdict.accepted and verdict.user == "alice"

        async def done():
            record = await job_as(alice, verdict.job_id)
            return record if record.state.final else None

        record = await wait_for(done)
        assert record.user == "alice" and record.state == JobState.SUCCEEDED

        async def output():  # lines are published apart from the exit report: they may come after
            page = await client.ask(alice, "logs", {"job_id": record.job_id, "attempt": 1})
            return [line for _, line in page["lines"]]

        assert await wait_for(output, 10) == ["user=alice"]
    finally:
        await alice.close()


# ---------------------------------------------------------------- forged messages


async def test_forged_exits_endpoints_and_specs_change_nothing(secured):
    alice, n2 = await connect(secured, "alice"), await connect(secured, auth.agent_name("n2"))
    try:
        job = await running(alice, sleeper("victim"))
        root = await connect(secured, "root")
        attempts = await root.jetstream().key_value(subjects.ATTEMPTS_BUCKET)
        attempt = AttemptRecord.from_bytes((await attempts.get(attempt_key(job.job_id, 1))).value)
        task = attempt.tasks[0]
        other = "n2" if task.node == "n1" else "n1"
        forger = n2 if other == "n2" else await connect(secured, auth.agent_name("n1"))
        # The other node says the task exited 0: allowed on the wire (its own subject), refused
        # by the supervisor (the task is not placed there).
        fake = TaskEvent(
            job_id=job.job_id,
            attempt=1,
            role=task.role,
            index=task.index,
            node=task.node,
            kind=TaskEventKind.EXITED,
            cause=TaskCause.EXITED,
            exit_code=0,
        )
        await forger.jetstream().publish(
            subjects.task_event(job.job_id, 1, task.role, task.index, "exited", other), fake.to_bytes()
        )
        # An endpoint for it from the wrong node, and a cluster spec from anyone but the registry.
        ep = EndpointReported(
            job_id=job.job_id,
            attempt=1,
            gang_size=1,
            endpoint=Endpoint(
                role=task.role, role_no=0, index=task.index, node=other, host="6.6.6.6", port=1
            ),
        )
        await forger.jetstream().publish(
            subjects.task_event(job.job_id, 1, task.role, task.index, "endpoint", other), ep.to_bytes()
        )
        spec = ClusterSpec(job_id=job.job_id, attempt=1, endpoints=[ep.endpoint]).to_bytes()
        # Training metrics for it from the wrong node, and garbage: neither is shown.
        point = MetricPoint(t=now(), name="accuracy", value=0.99)
        forged = MetricBatch(
            job_id=job.job_id, attempt=1, role=task.role, index=task.index, node=other, points=[point]
        )
        metrics_subject = subjects.task_metrics(job.job_id, 1, task.role, task.index, other)
        await forger.jetstream().publish(metrics_subject, forged.to_bytes())
        await forger.jetstream().publish(metrics_subject, b"not json")
        await refused(
            alice,
            lambda: alice.jetstream(timeout=1).publish(subjects.cluster_spec(job.job_id, 2), spec),
            "spec",
        )
        await refused(
            forger,
            lambda: forger.jetstream(timeout=1).publish(subjects.cluster_spec(job.job_id, 2), spec),
            "spec",
        )
        # Nor can a user forge a task event at all.
        await refused(
            alice,
            lambda: alice.jetstream(timeout=1).publish(
                subjects.task_event(job.job_id, 1, task.role, task.index, "exited", task.node),
                fake.to_bytes(),
            ),
            "exited",
        )
        await asyncio.sleep(3)
        now_attempt = AttemptRecord.from_bytes((await attempts.get(attempt_key(job.job_id, 1))).value)
        assert now_attempt.tasks[0].state == TaskState.RUNNING
        assert (await job_as(alice, job.job_id)).state == JobState.RUNNING
        # The forged endpoint is stored nowhere (a one-task job has no rendezvous of its own:
        # its agent builds its spec alone, so anything stored for it would be the forger's).
        rendezvous = await root.jetstream().key_value(subjects.RENDEZVOUS_BUCKET)
        for key in await store.keys(rendezvous):
            if key.startswith(job.job_id):
                assert b"6.6.6.6" not in (await rendezvous.get(key)).value, key
        page = await client.ask(alice, "metrics", {"job_id": job.job_id, "attempt": 1})
        assert page["batches"] == [] and page["last"] > 0, page  # read, and not believed
        await alice.jetstream().publish(
            subjects.kill_request("alice"), KillRequest(job_id=job.job_id, user="alice", grace=0).to_bytes()
        )
        await root.close()
    finally:
        await alice.close()
        await n2.close()


async def test_nobody_but_the_scheduler_holds_its_lease(secured):
    for name in ("alice", auth.agent_name("n1"), "validator", "supervisor", "gateway"):
        nc = await connect(secured, name)
        try:
            squat = json.dumps({"holder": "squatter"}).encode()
            await refused(
                nc,
                lambda nc=nc, squat=squat: nc.jetstream(timeout=1).publish(
                    "$KV.muster_leases.scheduler", squat
                ),
                "leases",
            )
        finally:
            await nc.close()
    # Placement goes on.
    alice = await connect(secured, "alice")
    try:
        job = await running(alice, sleeper("after-squatters", seconds=5))
        assert job.attempt == 1
    finally:
        await alice.close()


async def test_a_heartbeat_from_the_future_or_beyond_belief_gets_no_work(secured):
    n3 = await connect(secured, auth.agent_name("n3"))
    alice = await connect(secured, "alice")
    try:
        nodes = await n3.jetstream(timeout=2).key_value(subjects.NODES_BUCKET)
        future = NodeInfo(
            node="n3",
            address="127.0.0.1",
            cpus=64,
            memory_mb=1 << 20,
            runtime="process",
            agent_id="forger",
            heartbeat_at=now() + timedelta(days=1),
        )
        await nodes.put("n3", future.to_bytes())
        # 64 CPUs: only n3 could fit this; a believable n3 would get it at once.
        big = json.loads(sleeper("needs-n3", seconds=0))
        big["taskRoles"][0]["cpuNumber"] = 32
        _, verdict = await client.submit(alice, json.dumps(big).encode(), timeout=30)
        assert verdict is not None and verdict.accepted
        await asyncio.sleep(3)
        record = await job_as(alice, verdict.job_id)
        assert record.state == JobState.WAITING and record.attempt == 0, record

        # The same node believable: the job is placed there. Written again each time, as its
        # agent would beat: once only, a loaded scheduler could find it silent past the timeout.
        async def placed():
            await nodes.put("n3", future.model_copy(update={"heartbeat_at": now()}).to_bytes())
            return (await job_as(alice, verdict.job_id)).attempt == 1

        await wait_for(placed, 20)
        await alice.jetstream().publish(
            subjects.kill_request("alice"),
            KillRequest(job_id=verdict.job_id, user="alice", grace=0).to_bytes(),
        )
    finally:
        await n3.close()
        await alice.close()


def test_node_records_beyond_belief_are_refused():
    at = now()
    good = NodeInfo(node="a", address="h", cpus=8, memory_mb=1024, runtime="process", agent_id="x")
    assert node_refusal("a", good, at) is None
    assert "claims to be" in node_refusal("b", good, at)
    assert "future" in node_refusal(
        "a", good.model_copy(update={"heartbeat_at": at + timedelta(hours=1)}), at
    )
    assert "capacity" in node_refusal("a", good.model_copy(update={"cpus": 100_000}), at)
    assert "capacity" in node_refusal("a", good.model_copy(update={"memory_mb": 0}), at)
    gpus = [{"index": i, "model": "V100"} for i in range(65)]
    assert "GPUs" in node_refusal("a", NodeInfo.model_validate({**good.model_dump(), "gpus": gpus}), at)
    twice = [{"index": 0, "model": "V100"}, {"index": 0, "model": "V100"}]
    assert "GPUs" in node_refusal("a", NodeInfo.model_validate({**good.model_dump(), "gpus": twice}), at)


# ---------------------------------------------------------------- permissions, as a table


def test_each_identity_gets_its_own_subjects_only():
    agent = auth.permissions(auth.Identity("agent-n1", "agent", "UX", node="n1"))
    pub = agent["publish"]["allow"]
    assert "$KV.muster_nodes.n1" in pub and not any(
        "muster_nodes.n2" in p or p == "$KV.muster_nodes.>" for p in pub
    )
    assert all(not p.startswith(("muster.node.", "$KV.muster_jobs", "$KV.muster_leases")) for p in pub)
    # Nothing it wrote read back through a direct get (its bytes to any reply subject it names)
    assert not any(
        ".DIRECT.GET.KV_muster_nodes" in p or ("endpoint" in p and ".DIRECT.GET." in p) for p in pub
    )
    assert not any((".CONSUMER.DELETE." in p or ".DURABLE." in p) and "KV_muster_attempts" in p for p in pub)
    assert not any(p in (">", "$JS.API.>") for p in pub)
    user = auth.permissions(auth.Identity("alice", "user", "UX"))
    assert sorted(user["publish"]["allow"]) == sorted(
        ["muster.job.submit.alice", "muster.job.kill.alice", "muster.api.alice.>"]
    )
    assert sorted(user["subscribe"]["allow"]) == ["_INBOX.alice.>", "muster.events.submission.alice.>"]
    for service in auth.SERVICES:
        rights = auth.permissions(auth.Identity(service, service, "UX"))["publish"]["allow"]
        assert not any(
            ".STREAM.CREATE." in r or ".STREAM.UPDATE." in r or ".STREAM.DELETE." in r for r in rights
        )
        lease = "$KV.muster_leases.>" in rights
        assert lease == (service == "scheduler"), service


# ---------------------------------------------------------------- secrets


TOKEN, PASSWORD = "tok-3f9a8c1e77d2b5", "pw-c0ffee-beef-4242"
REGISTRY_PASSWORD = "reg-9d8e7f6a5b4c"  # in the job's authFile


async def test_no_secret_in_any_record_event_log_status_or_metrics_page(secured):
    """A job with secret jobEnvs and an authFile: its task gets the jobEnvs (the agent reads the
    authFile, for the image's registry); nothing anyone else sees has any of them."""
    alice, root = await connect(secured, "alice"), await connect(secured, "root")
    try:
        config = json.loads(sleeper("secretive", seconds=0))
        config["jobEnvs"] = {"API_TOKEN": TOKEN, "DB_PASSWORD": PASSWORD, "PLAIN": "visible"}
        auth_file = secured.log_dir / "users" / "alice" / "registry-auth"
        auth_file.parent.mkdir(parents=True, exist_ok=True)
        auth_file.write_text(f"docker.io\nalice\n{REGISTRY_PASSWORD}\n")
        config["authFile"] = str(auth_file)
        # The task proves it has them by a digest (the command is part of the spec: no secret there).
        config["taskRoles"][0]["command"] = (
            'echo digest=$(printf %s "$API_TOKEN:$DB_PASSWORD" | sha256sum | cut -c1-16); '
            'echo "printing it anyway: $API_TOKEN"; echo plain=$PLAIN'
        )
        _, verdict = await client.submit(alice, json.dumps(config).encode(), timeout=30)
        assert verdict is not None and verdict.accepted, verdict

        async def done():
            record = await job_as(alice, verdict.job_id)
            return record if record.state.final else None

        record = await wait_for(done)
        assert record.state == JobState.SUCCEEDED, record
        assert record.config.jobEnvs == {"API_TOKEN": "***", "DB_PASSWORD": "***", "PLAIN": "visible"}

        async def output():
            page = await client.ask(alice, "logs", {"job_id": record.job_id, "attempt": 1})
            lines = [line for _, line in page["lines"]]
            return lines if len(lines) == 3 else None

        lines = await wait_for(output, 10)
        digest = hashlib.sha256(f"{TOKEN}:{PASSWORD}".encode()).hexdigest()[:16]
        assert lines == [f"digest={digest}", "printing it anyway: ***", "plain=visible"], lines

        seen: list[tuple[str, bytes]] = []
        js = root.jetstream(timeout=5)
        for stream in (subjects.EVENTS_STREAM, subjects.LOGS_STREAM, subjects.SUBMISSIONS_STREAM):
            info = await js.stream_info(stream)
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                with contextlib.suppress(Exception):
                    msg = await js.get_msg(stream, seq)
                    seen.append((f"{stream}#{seq}", (msg.data or b"") + str(msg.headers).encode()))
        for bucket in subjects.BUCKETS:
            if bucket == subjects.SECRETS_BUCKET:
                continue  # where they are kept: only the validator and the scheduler may read it
            info = await js.stream_info(f"KV_{bucket}")
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                with contextlib.suppress(Exception):
                    msg = await js.get_msg(f"KV_{bucket}", seq)
                    seen.append((f"{bucket}#{seq}", msg.data or b""))
        for verb, request in (("jobs", {}), ("job", {"ref": record.job_id})):
            seen.append((f"gateway {verb}", json.dumps(await client.ask(alice, verb, request)).encode()))
        env = {**secured.env(), "MUSTER_CREDENTIALS": str(secured.keys.creds("alice"))}
        for args in (("status",), ("status", record.job_id, "--json"), ("status", "secretive")):
            r = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "muster.services.cli.main", *args],
                env=env,
                capture_output=True,
                timeout=60,
            )
            assert r.returncode == 0, r.stderr
            seen.append((f"muster {' '.join(args)}", r.stdout + r.stderr))
        async with httpx.AsyncClient() as http:
            for name, port in secured.metrics.items():
                with contextlib.suppress(httpx.HTTPError):
                    page = await http.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
                    seen.append((f"metrics of {name}", page.content))
        for path in secured.log_dir.glob("*.log"):  # every service's and agent's own log
            seen.append((path.name, path.read_bytes()))
        assert len([w for w, _ in seen if w.startswith("metrics")]) >= 5
        assert any(w.startswith(subjects.LOGS_STREAM) for w, _ in seen)
        for where, data in seen:
            for secret in (TOKEN, PASSWORD, REGISTRY_PASSWORD):
                assert secret.encode() not in data, f"{secret} in {where}"
    finally:
        await alice.close()
        await root.close()


async def test_credentials_in_a_code_sync_url_reach_the_node_and_nothing_else(secured):
    """`codeSync.git` with a token in it: the job record and every view show `***@`, the token
    lives with the secret jobEnvs, and only the placed node's order carries it (git needs it)."""
    alice, root = await connect(secured, "alice"), await connect(secured, "root")
    try:
        config = json.loads(sleeper("synced", seconds=0))
        url = f"http://alice:{PASSWORD}@127.0.0.1:1/team/code.git"  # nothing listens: it fails
        config["codeSync"] = {"git": url, "branch": "main"}
        orders: list[Assignment] = []

        async def order(msg) -> None:
            orders.append(Assignment.from_bytes(msg.data))

        await root.subscribe(subjects.assign("*"), cb=order)  # the orders stream keeps none once done
        _, verdict = await client.submit(alice, json.dumps(config).encode(), timeout=30)
        assert verdict is not None and verdict.accepted, verdict
        assert [w.path for w in verdict.warnings] == ["codeSync.git"]

        async def done():
            record = await job_as(alice, verdict.job_id)
            return record if record.state.final else None

        record = await wait_for(done)
        assert record.state == JobState.FAILED, record
        assert record.config.codeSync is not None
        assert record.config.codeSync.git == "http://***@127.0.0.1:1/team/code.git"
        assert "codeSync: cannot fetch http://***@127.0.0.1:1/team/code.git" in record.reason, record.reason
        js = root.jetstream(timeout=5)
        assert orders and all(o.config.codeSync and o.config.codeSync.git == url for o in orders)
        shown = [
            json.dumps(await client.ask(alice, "job", {"ref": record.job_id})).encode(),
            (
                await js.get_last_msg(
                    f"KV_{subjects.JOBS_BUCKET}", f"$KV.{subjects.JOBS_BUCKET}.{record.job_id}"
                )
            ).data,
        ]
        info = await js.stream_info(subjects.EVENTS_STREAM)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            with contextlib.suppress(Exception):
                shown.append((await js.get_msg(subjects.EVENTS_STREAM, seq)).data or b"")
        for path in secured.log_dir.glob("*.log"):
            shown.append(path.read_bytes())
        assert all(PASSWORD.encode() not in data for data in shown)
    finally:
        await alice.close()
        await root.close()


async def test_the_gateway_answers_only_to_an_inbox(secured):
    """The server lets a responder publish its answer on whatever reply subject the asker named:
    alice's ping answered to `$KV.muster_jobs.<bob's job>` overwrote bob's job record, and to
    `muster.node.n2.drain` put a message in n2's orders."""
    alice, root = await connect(secured, "alice"), await connect(secured, "root")
    try:
        for reply in (f"$KV.{subjects.JOBS_BUCKET}.jvictim", subjects.drain("n2")):
            await alice.publish(subjects.api("alice", "ping"), b"{}", reply=reply)
        # Taken in order: once a later question is answered, the two before it were judged.
        assert await client.ask(alice, "ping") == {"user": "alice", "admin": False}
        js = root.jetstream()
        jobs = await js.key_value(subjects.JOBS_BUCKET)
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await jobs.get("jvictim")
        info = await js.stream_info(subjects.COMMANDS_STREAM, subjects_filter=subjects.drain("n2"))
        assert not info.state.subjects, info.state.subjects
    finally:
        await alice.close()
        await root.close()


async def test_the_gateway_names_what_is_wrong_with_a_question(secured):
    bob = await connect(secured, "bob")
    try:
        with pytest.raises(client.Refused, match="attempt"):
            await client.ask(bob, "logs", {"job_id": "j1", "attempt": "first"})
        with pytest.raises(client.Refused, match="colour"):
            await client.ask(bob, "jobs", {"colour": "red"})
        with pytest.raises(client.Refused, match="no such question 'secrets'"):
            await client.ask(bob, "secrets")
        assert await client.ask(bob, "ping") == {"user": "bob", "admin": False}
    finally:
        await bob.close()


# ---------------------------------------------------------------- MPI: exec in a peer's task


async def test_only_the_launchers_node_may_run_commands_in_an_mpi_jobs_workers(secured):
    """docs/mpi.md: an agent asks a peer's agent to run an MPI daemon in a task. The server lets
    it ask only as its own node and read only answers addressed to it; the peer runs a command
    only in a workers task of its own whose attempt's launcher runs on the asking node."""
    from muster.shared.messages import ExecReply, ExecRequest

    alice = await connect(secured, "alice")
    agents = {node: await connect(secured, auth.agent_name(node)) for node in ("n1", "n2")}
    job = None
    try:
        # An agent cannot ask as another node, nor read another node's answers.
        n2 = agents["n2"]
        before = len(bus.refusals(n2))
        await n2.publish(subjects.exec_request("n1", "n1"), b"{}")
        await n2.subscribe(subjects.exec_reply("n1"))
        await n2.flush()
        await asyncio.sleep(0.3)
        said = bus.refusals(n2)[before:]
        assert any("muster.exec.req.n1.n1" in r for r in said), said
        assert any("muster.exec.out.n1" in r for r in said), said

        async def gateway_up() -> bool:
            with contextlib.suppress(TimeoutError, client.Refused):
                return bool(await client.ask(alice, "ping", timeout=2))
            return False

        await wait_for(gateway_up)  # run alone, this test may come first
        data = json.loads(sleeper("mpi-exec"))
        worker = dict(data["taskRoles"][0], name="w", command="true")
        data["taskRoles"] = [dict(data["taskRoles"][0], name="launcher"), worker]
        data["extras"] = {"mpi": {"launcher": "launcher"}}
        job = await running(alice, json.dumps(data).encode())
        root = await connect(secured, "root")
        attempts = await root.jetstream().key_value(subjects.ATTEMPTS_BUCKET)
        attempt = AttemptRecord.from_bytes((await attempts.get(attempt_key(job.job_id, 1))).value)
        await root.close()
        launcher_node = attempt.task("launcher", 0).node
        w = attempt.task("w", 0)
        other = "n2" if launcher_node == "n1" else "n1"

        async def ask(sender: str, **fields) -> list[ExecReply]:
            """Ask as `sender` to run in task w.0; its answers until the last one."""
            nc = agents[sender]
            sub = await nc.subscribe(subjects.exec_reply(sender, w.node))
            session = hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:32]
            ask = dict(kind="open", session=session, job_id=job.job_id, attempt=1, role="w", index=0) | fields
            await nc.publish(subjects.exec_request(w.node, sender), ExecRequest(**ask).to_bytes())
            got: list[ExecReply] = []
            try:
                while not got or got[-1].kind not in ("exit", "error"):
                    reply = ExecReply.from_bytes((await sub.next_msg(timeout=30)).data)
                    if reply.session == session:
                        got.append(reply)
            finally:
                await sub.unsubscribe()
            return got

        # Garbage first: dropped, the peer goes on answering.
        await agents[other].publish(subjects.exec_request(w.node, other), b"\x00not json")
        refusal = await ask(other, command="id")
        assert refusal[-1].kind == "error" and f"launcher does not run on node {other}" in refusal[-1].error
        assert (await ask(launcher_node, role="launcher", command="id"))[-1].kind == "error"  # hosts no ranks
        # The launcher's node: it runs, in the task's environment, and its exit code comes back.
        ran = await ask(launcher_node, command="echo in $MUSTER_TASK_ROLE.$MUSTER_TASK_INDEX; exit 3")
        assert ran[0].kind == "started" and ran[-1].kind == "exit" and ran[-1].code == 3
        assert "in w.0" in "".join(r.data for r in ran if r.kind == "out")
        # Another job's task: never.
        other_job = await running(alice, sleeper("not-mpi"))
        try:
            stranger = await ask(launcher_node, job_id=other_job.job_id, role="w", command="id")
            assert stranger[-1].kind == "error"
        finally:
            kill = KillRequest(job_id=other_job.job_id, user="alice", grace=0)
            await alice.jetstream().publish(subjects.kill_request("alice"), kill.to_bytes())
    finally:
        if job is not None:
            kill = KillRequest(job_id=job.job_id, user="alice", grace=0)
            await alice.jetstream().publish(subjects.kill_request("alice"), kill.to_bytes())
        for nc in (alice, *agents.values()):
            await nc.close()
