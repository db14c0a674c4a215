"""Fuzzing the bus (issue 24): on a real mesh with authentication on (every service and two
agents as their own processes and identities), every identity — a user, an agent, an admin —
publishes, on every subject of the catalogue (`muster.shared.proto.CHANNELS`) it may publish, messages
with random, oversized, wrongly-typed and control-character values in every field, unknown
fields, and payloads that are not the message at all. Afterwards every service is alive and
healthy, the job that ran before runs on, the consumers hold nothing back, and a canary job
completes.

Every (channel, field) gets each kind of bad value once; MUSTER_FUZZ_N more messages are drawn
by hypothesis (default 150, from seed 0, so CI draws the same ones; MUSTER_FUZZ_N=5000 draws
others each run, from the seed it prints: MUSTER_FUZZ_SEED draws those again)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import nats.errors
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from muster.shared import auth, bus, client, proto, store, subjects
from muster.shared.jobconfig import check_job
from muster.shared.messages import (
    Assignment,
    AttemptRecord,
    ClusterSpec,
    Dataset,
    DrainOrder,
    Endpoint,
    EndpointReported,
    ExecReply,
    ExecRequest,
    JobEvent,
    JobEventKind,
    JobRecord,
    JobState,
    KillOrder,
    KillRequest,
    MetricBatch,
    MetricPoint,
    NodeInfo,
    QueueOrder,
    Rendezvous,
    TaskEvent,
    TaskEventKind,
    TaskSpec,
    TaskStatus,
    Verdict,
    VirtualCluster,
    now,
)
from muster.shared.natsserver import NatsServer
from tests.conftest import CORE
from tests.test_auth import Secured, creds

FUZZ_N = int(os.environ.get("MUSTER_FUZZ_N") or "150")
FUZZ_SEED = int(
    os.environ.get("MUSTER_FUZZ_SEED") or (random.randrange(2**32) if "MUSTER_FUZZ_N" in os.environ else 0)
)
USER, NODE, PEER, ADMIN = "alice", "n1", "n2", "root"
AGENT = auth.agent_name(NODE)

# ------------------------------------------------------------------ bad values


def _deep(n: int) -> Any:
    value: Any = "x"
    for _ in range(n):
        value = [value]
    return value


# Each kind of bad value, once for every field.
KINDS: dict[str, Any] = {
    "oversized": "x" * 70_000,  # past every cap on free text (64 KiB)
    "long-token": "j" * 5000,
    "control": "a\r\nPUB muster.node.n1.drain 2\r\n{}\x00\x1b[2J",
    "path": "../../x",
    "wildcard": "n1.>",
    "dotted": "j1.2",
    "spaces": "a b\tc",
    "wrong-type": {"nested": [1, 2, 3]},
    "number": 10**40,
    "nan": float("nan"),
    "negative": -(2**63),
    "null": None,
    "list": ["x"] * 50,
    "deep": _deep(200),
}

# Any code point, lone surrogates included (JSON's \\ud800 escapes), and the characters that
# mean something in a subject or a protocol line.
NASTY_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=())
    | st.sampled_from(["\x00", "\r", "\n", " ", ".", "*", ">"]),
    max_size=80,
)
ANY_VALUE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | NASTY_TEXT
    | st.sampled_from(list(KINDS.values())),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(NASTY_TEXT, inner, max_size=4),
    max_leaves=8,
)
# Whole payloads that are not the message at all.
NOT_A_MESSAGE = [b"", b"{", b"\xff\xfe\x00", b"[]", b"null", b"3", b'"x"', b"[" * 5000, b"{}" * 1000]


def dumps(doc: Any) -> bytes:
    """JSON as a hostile client writes it: NaN and huge numbers included."""
    return json.dumps(doc, allow_nan=True).encode()


# ------------------------------------------------------------------ the catalogue, as each sender sees it


def _config() -> dict[str, Any]:
    return {
        "jobName": "fuzzed",
        "image": "muster/base:bookworm",
        "taskRoles": [
            {"name": "w", "taskNumber": 1, "cpuNumber": 1, "memoryMB": 128, "gpuNumber": 0, "command": "true"}
        ],
    }


def _examples() -> dict[str, Any]:
    """A valid example of every message model, inert where a valid one could act: records of
    jobs that ended, of a node long silent."""
    config, errors = check_job(_config())
    assert config is not None, errors
    spec = TaskSpec(role="w", role_no=0, index=0, node=NODE)
    ep = Endpoint(role="w", role_no=0, index=0, node=NODE, host="127.0.0.1", port=5000)
    status = TaskStatus(role="w", role_no=0, index=0, node=NODE)
    past = now() - timedelta(hours=1)
    return {
        "jobSubmit": _config(),
        "jobKill": KillRequest(job_id="jfuzz0000000", user=USER),
        "gatewayQuestion": {"ref": "jfuzz0000000", "job_id": "jfuzz0000000", "attempt": 1, "task": "w.0"},
        "submissionVerdict": Verdict(submission_id="sfuzz", accepted=False, user=USER),
        "jobEvent": JobEvent(
            job_id="jfuzz0000000", job_name="fuzzed", kind=JobEventKind.ENDED, state=JobState.FAILED
        ),
        "nodeAssign": Assignment(
            job_id="jfuzz0000000", attempt=1, user=USER, config=config, gang=[spec], node=NODE
        ),
        "nodeKill": KillOrder(job_id="jfuzz0000000", attempt=1, reason="fuzz"),
        "nodeDrain": DrainOrder(node="nfuzz", grace=0),
        "taskEndpoint": EndpointReported(job_id="jfuzz0000000", attempt=1, gang_size=1, endpoint=ep),
        "taskState": TaskEvent(
            job_id="jfuzz0000000", attempt=1, role="w", index=0, node=NODE, kind=TaskEventKind.EXITED
        ),
        "taskMetrics": MetricBatch(
            job_id="jfuzz0000000",
            attempt=1,
            role="w",
            index=0,
            node=NODE,
            points=[MetricPoint(t=now(), name="loss", value=0.5)],
        ),
        "clusterSpec": ClusterSpec(job_id="jfuzz0000000", attempt=1, endpoints=[ep]),
        "attemptMembers": {},
        "queueOrder": QueueOrder(at=now(), total=0, jobs=[]),
        "execRequest": ExecRequest(kind="open", session="fuzz", job_id="jfuzz0000000", attempt=1, role="w"),
        "execReply": ExecReply(kind="out", session="fuzz", data="x"),
        "nodeRecord": NodeInfo(
            node=NODE,
            address="127.0.0.1",
            cpus=1,
            memory_mb=128,
            runtime="process",
            agent_id="fuzz",
            started_at=past,
            heartbeat_at=past,
        ),
        "attemptRecord": AttemptRecord(
            job_id="jfuzz0000000", attempt=1, tasks=[status], ended_at=past, outcome=JobState.FAILED
        ),
        "rendezvousRecord": Rendezvous(job_id="jfuzz0000000", attempt=1, gang_size=1, published=True),
        "rendezvousEndpoint": Endpoint(role="w", role_no=0, index=0, node=NODE, host="127.0.0.1", port=5000),
        "virtualClusterRecord": VirtualCluster(name="fuzzvc", users=["nobody"]),
        "datasetRecord": Dataset(name="fuzzds", source="fuzz-volume", users=["nobody"]),
        "jobRecord": JobRecord(
            job_id="jfuzz0000000",
            job_name="fuzzed",
            state=JobState.FAILED,
            submission_id="sfuzz",
            user=USER,
            config=config,
            submitted_at=past,
        ),
    }


@dataclass(frozen=True)
class Sending:
    """One channel as one identity publishes it: a concrete subject (its parameters filled with
    ids that name nothing real: the fuzzed payload is what is tested) and how it is sent."""

    channel: str
    identity: str
    subject: str
    how: str  # "js" (JetStream publish), "core" (fire and forget), "ask" (request/reply), "kv"


def sendings(j: str = "jfuzz0000000", a: int | str = 1) -> list[Sending]:
    """Every channel of the catalogue, with each identity that may publish on it; `j` and `a`
    fill the subjects' job id and attempt tokens (and the KV keys made of them)."""
    by_user = {
        "jobSubmit": (subjects.submit(USER), "js"),
        "jobKill": (subjects.kill_request(USER), "js"),
        "gatewayQuestion": (subjects.api(USER, "job"), "ask"),
    }
    by_agent = {
        "taskEndpoint": (subjects.task_event(j, a, "w", 0, "endpoint", NODE), "js"),
        "taskState": (subjects.task_event(j, a, "w", 0, "exited", NODE), "js"),
        "taskMetrics": (subjects.task_metrics(j, a, "w", 0, NODE), "js"),
        "execRequest": (subjects.exec_request(PEER, NODE), "core"),
        "execReply": (subjects.exec_reply(PEER, NODE), "core"),
        "nodeRecord": (NODE, "kv"),  # its own record: the real agent rewrites it every beat
    }
    by_admin = {
        **by_user,
        **{k: v for k, v in by_agent.items() if k != "nodeRecord"},
        "jobKill": (subjects.kill_request(ADMIN), "js"),
        "submissionVerdict": (subjects.verdict(USER, "sfuzz"), "js"),
        "jobEvent": (subjects.job_event(j, "ended"), "js"),
        "nodeAssign": (subjects.assign(NODE), "js"),
        "nodeKill": (subjects.kill(NODE), "js"),
        "nodeDrain": (subjects.drain(NODE), "js"),
        "clusterSpec": (subjects.cluster_spec(j, a), "js"),
        "attemptMembers": (subjects.attempt_members(j, a), "js"),
        "queueOrder": (subjects.QUEUE, "core"),  # only the scheduler (and admins) may publish it
        # KV records under keys that name nothing real (a record under its own name is checked
        # against it: see node_refusal, vc_refusal).
        "nodeRecord": ("nfuzz", "kv"),
        "attemptRecord": (f"{j}.{a}", "kv"),
        "rendezvousRecord": (f"{j}.{a}", "kv"),
        "rendezvousEndpoint": (f"{j}.{a}.w.0", "kv"),  # subjects.endpoint_key
        "virtualClusterRecord": ("fuzzvc", "kv"),
        "datasetRecord": ("fuzzds", "kv"),
        "jobRecord": (j, "kv"),
    }
    out = []
    for identity, table in ((USER, by_user), (AGENT, by_agent), (ADMIN, by_admin)):
        for channel, (subject, how) in table.items():
            assert channel in proto.CHANNELS, channel
            out.append(Sending(channel, identity, subject, how))
    return out


BUCKET_OF = {
    "nodeRecord": subjects.NODES_BUCKET,
    "attemptRecord": subjects.ATTEMPTS_BUCKET,
    "rendezvousRecord": subjects.RENDEZVOUS_BUCKET,
    "rendezvousEndpoint": subjects.RENDEZVOUS_BUCKET,
    "virtualClusterRecord": subjects.VCS_BUCKET,
    "datasetRecord": subjects.DATASETS_BUCKET,
    "jobRecord": subjects.JOBS_BUCKET,
}


def as_doc(example: Any) -> Any:
    return example.model_dump(mode="json") if hasattr(example, "model_dump") else example


def fields_of(doc: Any) -> list[tuple[str, ...]]:
    """Every field of a message, nested ones too (one level into objects and the first item of
    lists of objects), as paths."""
    paths: list[tuple[str, ...]] = []
    if not isinstance(doc, dict):
        return paths
    for key, value in doc.items():
        paths.append((key,))
        inner = value[0] if isinstance(value, list) and value and isinstance(value[0], dict) else value
        if isinstance(inner, dict):
            step = (key, "0") if isinstance(value, list) else (key,)
            paths += [(*step, sub) for sub in inner]
    return paths


def mutated(doc: Any, path: tuple[str, ...], value: Any) -> Any:
    """`doc` with the field at `path` set to `value` (as it is when an earlier change took that
    path's parent away)."""
    doc = json.loads(json.dumps(doc))
    target = doc
    try:
        for part in path[:-1]:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[path[-1]] = value
    except (KeyError, IndexError, TypeError, ValueError):
        pass
    return doc


# Tokens a subject's job id and attempt may be given by anyone who may publish there: the
# payload is then a valid message that names another job and attempt than its subject.
ODD_TOKENS: list[tuple[str, int | str]] = [
    ("j" * 3000, 1),
    ("jfuzz0000000", "9" * 3000),
    ("jfuzz0000000", "-1"),
    ("jfuzz0000000", "x"),
    ("%é\u00e9", 0),
    ("jfuzz0000000", "1.2"),
]


def deterministic(examples: dict[str, Any]) -> Iterator[tuple[Sending, bytes]]:
    """Each kind of bad value in every field of every message, an unknown field, a missing
    field, and payloads that are no message, on every channel as every identity that may send;
    then valid messages on subjects with odd job id and attempt tokens."""
    for j, a in ODD_TOKENS:
        for sending in sendings(j, a):
            if str(a) in sending.subject.split(".") or j in sending.subject.split("."):
                yield sending, dumps(as_doc(examples[sending.channel]))
    for sending in sendings():
        doc = as_doc(examples[sending.channel])
        for path in fields_of(doc):
            for value in KINDS.values():
                yield sending, dumps(mutated(doc, path, value))
            if len(path) == 1:
                yield sending, dumps({k: v for k, v in doc.items() if k != path[0]})
        if isinstance(doc, dict):
            yield sending, dumps({**doc, "node": NODE, "unknown_field": True})
        for junk in NOT_A_MESSAGE:
            yield sending, junk


def drawn(examples: dict[str, Any], n: int) -> list[tuple[Sending, bytes]]:
    """`n` more, drawn by hypothesis: a random field (or a new one) of a random channel given a
    random value of any JSON type, or several fields at once."""
    out: list[tuple[Sending, bytes]] = []
    channels = sendings()

    @seed(FUZZ_SEED)
    @settings(
        max_examples=n,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def draw(data: st.DataObject) -> None:
        sending = data.draw(st.sampled_from(channels))
        doc = as_doc(examples[sending.channel])
        paths = [*fields_of(doc), ("fuzzed_" + data.draw(NASTY_TEXT),)]
        for path in data.draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3)):
            doc = mutated(doc, path, data.draw(ANY_VALUE))
        out.append((sending, dumps(doc)))

    draw()
    return out


# ------------------------------------------------------------------ the mesh


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Secured]:
    keys = auth.AuthDir(tmp_path / "auth")
    keys.ensure_services()
    keys.ensure(ADMIN, "admin")
    keys.ensure(USER, "user")
    for node in (NODE, PEER):
        keys.ensure(auth.agent_name(node), "agent", node)
    with NatsServer(tmp_path / "nats", auth_config=keys.server_config) as server:

        async def declare() -> None:
            nc = await bus.connect("init", server.url, credentials=creds(keys, ADMIN))
            await bus.ensure_jetstream(nc)
            await nc.close()

        asyncio.run(declare())
        m = Secured(server.url, tmp_path, keys)
        for module in CORE:
            m.start_as(module.rsplit(".", 1)[-1], module)
        for node in (NODE, PEER):
            m.start_as(
                auth.agent_name(node),
                "muster.services.agent",
                *("--node", node, "--runtime", "process", "--cpus", "2", "--address", "127.0.0.1"),
                *("--work-root", str(tmp_path / "work" / node), "--output-root", str(tmp_path / "output")),
            )
        try:
            yield m
        finally:
            m.stop_all()


async def connect(mesh: Secured, name: str):
    return await bus.connect(name, mesh.url, credentials=creds(mesh.keys, name), quiet=True)


async def until(check: Callable[[], Any], timeout: float, what: str, logs: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            value = await check()
            if value:
                return value
        assert time.monotonic() < deadline, f"{what} (not within {timeout:g}s)\n{logs()}"
        await asyncio.sleep(0.25)


def job(name: str, command: str) -> bytes:
    config = _config()
    config["jobName"] = name
    config["taskRoles"][0]["command"] = command
    return json.dumps(config).encode()


async def state(nc, job_id: str) -> JobState:
    return JobRecord.model_validate((await client.ask(nc, "job", {"ref": job_id}, timeout=5))["job"]).state


async def send(ncs: dict[str, Any], sending: Sending, data: bytes) -> str:
    """Publish one message; what the server or client refuses (a permission, a payload past
    its limit) is the bus doing its part, not a failure of the test. Returns what became of it."""
    nc = ncs[sending.identity]
    try:
        if sending.how == "js":
            await nc.jetstream(timeout=5).publish(sending.subject, data)
        elif sending.how == "core":
            await nc.publish(sending.subject, data)
        elif sending.how == "ask":
            await nc.request(sending.subject, data, timeout=2)
        else:
            kv = await nc.jetstream(timeout=5).key_value(BUCKET_OF[sending.channel])
            await kv.put(sending.subject, data)
    except (nats.errors.Error, TimeoutError) as exc:
        return type(exc).__name__
    return "sent"


COUNTED = (
    "muster_messages_rejected_total",
    "muster_claims_refused_total",
    "muster_validator_verdicts_total",
    "muster_bad_records_total",
    "muster_agent_exec_messages_total",
)


async def test_fuzzing_every_subject_stops_nothing_and_a_canary_completes(mesh: Secured) -> None:
    examples = _examples()
    messages = list(deterministic(examples)) + drawn(examples, FUZZ_N)
    ncs = {name: await connect(mesh, name) for name in (USER, AGENT, ADMIN)}
    alice = ncs[USER]
    try:
        await until(lambda: client.ask(alice, "ping", timeout=2), 90, "the gateway never answered", mesh.logs)
        nodes = await ncs[ADMIN].jetstream(timeout=5).key_value(subjects.NODES_BUCKET)

        async def registered() -> bool:
            return {NODE, PEER} <= set(await store.keys(nodes))

        await until(registered, 90, "the agents never registered", mesh.logs)
        # A job accepted and running before: nothing the fuzz sends may end it.
        _, verdict = await client.submit(alice, job("before", "sleep 600"), timeout=60)
        assert verdict is not None and verdict.accepted and verdict.job_id, verdict
        before = verdict.job_id

        async def runs() -> bool:
            return await state(alice, before) == JobState.RUNNING

        await until(runs, 90, "the job before never ran", mesh.logs)

        started = time.monotonic()
        channels = {s.channel for s, _ in messages}
        outcomes: dict[str, int] = {}
        for i in range(0, len(messages), 32):
            for what in await asyncio.gather(*(send(ncs, s, data) for s, data in messages[i : i + 32])):
                outcomes[what] = outcomes.get(what, 0) + 1
        took = time.monotonic() - started
        sent = f"{len(messages)} messages (seed {FUZZ_SEED}) on {len(channels)} channels"
        print(f"fuzz: {sent} in {took:.1f}s: {outcomes}")
        assert outcomes.get("sent", 0) > len(messages) // 2, outcomes
        assert channels == set(proto.CHANNELS), set(proto.CHANNELS) - channels

        for p in mesh.procs:
            assert p.poll() is None, f"{p.args} exited with {p.returncode}\n{mesh.logs()}"
        for identity, port in mesh.metrics.items():
            page = await asyncio.to_thread(httpx.get, f"http://127.0.0.1:{port}/healthz", timeout=5)
            assert page.status_code == 200, (identity, page.text)
        admin = ncs[ADMIN]

        async def held_back() -> list[str]:
            js = admin.jetstream(timeout=5)
            left = []
            for stream, consumer in (
                (subjects.SUBMISSIONS_STREAM, subjects.VALIDATOR_CONSUMER),
                (subjects.SUBMISSIONS_STREAM, subjects.SUPERVISOR_KILL_CONSUMER),
                (subjects.EVENTS_STREAM, subjects.SUPERVISOR_CONSUMER),
                (subjects.EVENTS_STREAM, subjects.REGISTRY_CONSUMER),
                (subjects.COMMANDS_STREAM, subjects.agent_consumer(NODE)),
                (subjects.COMMANDS_STREAM, subjects.agent_consumer(PEER)),
            ):
                info = await js.consumer_info(stream, consumer)
                if info.num_pending or info.num_ack_pending:
                    left.append(f"{consumer}: {info.num_pending} pending, {info.num_ack_pending} unacked")
            return left

        async def drained() -> bool:
            return not await held_back()

        await until(drained, 120, "the consumers kept messages", mesh.logs)
        assert await state(alice, before) == JobState.RUNNING
        _, verdict = await client.submit(alice, job("canary", "echo canary"), timeout=60)
        assert verdict is not None and verdict.accepted and verdict.job_id, verdict
        canary = verdict.job_id

        async def succeeded() -> bool:
            return await state(alice, canary) == JobState.SUCCEEDED

        await until(succeeded, 90, "the canary did not complete", mesh.logs)
        for p in mesh.procs:
            assert p.poll() is None, f"{p.args} exited with {p.returncode}\n{mesh.logs()}"
        # What the services made of it: refused on decode (counted), judged, refused as claims.
        counts: dict[str, float] = {}
        for port in mesh.metrics.values():
            page = await asyncio.to_thread(httpx.get, f"http://127.0.0.1:{port}/metrics", timeout=5)
            for line in page.text.splitlines():
                name = line.split("{")[0]
                if name in COUNTED:
                    counts[line.rsplit(" ", 1)[0]] = float(line.rsplit(" ", 1)[1])
        print("\n".join(f"  {k} {v:g}" for k, v in sorted(counts.items())))
        for log in mesh.log_dir.glob("*.log"):
            text = log.read_text()
            assert "nats.closed" not in text and "service.failed" not in text, f"{log.name}:\n{text[-3000:]}"
    finally:
        for nc in ncs.values():
            await nc.close()
