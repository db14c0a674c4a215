"""Jobs run end to end against a real nats-server, with every service a separate process and
agents on the process runtime: the environment each task sees, a real PyTorch gang, and a
scheduler killed mid-stream."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError

from muster.services.registry.service import MEMBERS_CONSUMER
from muster.shared import bus, client, subjects
from muster.shared.messages import AttemptRecord, ClusterSpec, JobRecord, JobState, KillRequest, TaskState
from muster.shared.store import Store
from tests.conftest import ROOT

PY = sys.executable


def dump_env(path: Path, then_wait_for: tuple[str, ...] = ()) -> str:
    """A command that first writes the task's whole environment as JSON to
    <path>/<role>.<index>.json (atomically: a reader never sees half a file), then waits until the
    files `then_wait_for` exist there too; exits 3 if they do not within 120 s."""
    wait = [str(path / name) for name in then_wait_for]
    code = (
        "import json,os,sys,time;"
        f"p=os.path.join({str(path)!r},"
        "os.environ['PAI_TASK_ROLE_NAME']+'.'+os.environ['PAI_TASK_ROLE_INDEX']+'.json');"
        "f=open(p+'.tmp','w');json.dump(dict(os.environ),f);f.close();os.replace(p+'.tmp',p);"
        f"w={wait!r};d=time.time()+120;"
        "[time.sleep(0.05) for _ in iter(lambda:all(map(os.path.exists,w)) or time.time()>d,True)];"
        "sys.exit(0 if all(map(os.path.exists,w)) else 3)"
    )
    return f'{PY} -c "{code}"'


async def run_job(nc, config: dict, timeout: float = 90) -> JobRecord:
    _, verdict = await client.submit(nc, json.dumps(config).encode(), timeout=30)
    assert verdict is not None and verdict.accepted, verdict
    return await wait_final(nc, verdict.job_id, timeout)


async def wait_final(nc, job_id: str, timeout: float = 90) -> JobRecord:
    kv = await nc.jetstream().key_value(subjects.JOBS_BUCKET)
    deadline = time.monotonic() + timeout
    record = None
    while time.monotonic() < deadline:
        record = JobRecord.from_bytes((await kv.get(job_id)).value)
        if record.state.final:
            return record
        await asyncio.sleep(0.2)
    raise AssertionError(f"job {job_id} did not end within {timeout}s: {record}")


async def attempt(nc, job_id: str, n: int = 1) -> AttemptRecord:
    kv = await nc.jetstream().key_value(subjects.ATTEMPTS_BUCKET)
    return AttemptRecord.from_bytes((await kv.get(f"{job_id}.{n}")).value)


async def ended_attempt(nc, job_id: str, n: int = 1, timeout: float = 30) -> AttemptRecord:
    """Attempt n once every task of it has ended (a job is final before the rest of its gang
    has reported its stop)."""
    deadline = time.monotonic() + timeout
    a = await attempt(nc, job_id, n)
    while not all(t.state.ended for t in a.tasks):
        assert time.monotonic() < deadline, a.tasks
        await asyncio.sleep(0.2)
        a = await attempt(nc, job_id, n)
    return a


async def spec(nc, job_id: str, n: int = 1) -> ClusterSpec:
    msg = await nc.jetstream().get_last_msg(subjects.EVENTS_STREAM, subjects.cluster_spec(job_id, n))
    return ClusterSpec.from_bytes(msg.data)


@pytest.fixture
async def nc(nats_url):
    conn = await bus.connect("test", nats_url)
    yield conn
    await conn.close()


def role(name, n, command, cpu=1, mem=128, gpu=0, **extra):
    return {
        "name": name,
        "taskNumber": n,
        "cpuNumber": cpu,
        "memoryMB": mem,
        "gpuNumber": gpu,
        "command": command,
        **extra,
    }


async def test_seed_tf_example_shape_every_task_sees_the_spec(cluster, nc, tmp_path):
    """The seed's distributed TensorFlow job (2 ps_server + 2 workers, killAllOnCompletedTaskNumber
    2) on two nodes: each task's environment, as the task itself wrote it, matches the spec."""
    cluster.core()
    cluster.agent("node-a", "--address", "127.0.0.1", "--cpus", "3", "--ports", "20000-20999")
    cluster.agent("node-b", "--address", "127.0.0.2", "--cpus", "3", "--ports", "21000-21999")
    out = tmp_path / "envs"
    out.mkdir()
    job = {
        "jobName": "tensorflow-distributed-jobguid",
        "image": "aii.run.tensorflow",
        "dataDir": "hdfs://path/tensorflow-distributed-jobguid/data",
        "outputDir": str(tmp_path / "output"),
        "taskRoles": [
            role("ps_server", 2, dump_env(out) + " && sleep 600", cpu=2),
            # Workers end the job (killAllOnCompletedTaskNumber 2), and so stop the ps tasks: they
            # must not end before every ps has written its environment, however slow it starts.
            role("worker", 2, dump_env(out, then_wait_for=("ps_server.0.json", "ps_server.1.json")), cpu=1),
        ],
        "killAllOnCompletedTaskNumber": 2,
        "retryCount": 0,
    }
    record = await run_job(nc, job)
    assert record.state == JobState.SUCCEEDED, cluster.logs()
    assert "killAllOnCompletedTaskNumber" in record.reason

    # The job is final as soon as the rule fires; the ps tasks' stops are reported after.
    tasks = (await ended_attempt(nc, record.job_id)).tasks
    states = {t.key: t.state for t in tasks}
    assert states == {
        "ps_server.0": TaskState.STOPPED,
        "ps_server.1": TaskState.STOPPED,
        "worker.0": TaskState.SUCCEEDED,
        "worker.1": TaskState.SUCCEEDED,
    }
    assert {t.node for t in tasks} == {"node-a", "node-b"}  # 2-CPU ps tasks cannot share a 3-CPU node

    cluster_spec = await spec(nc, record.job_id)
    by_role: dict[str, list[str]] = {}
    for ep in cluster_spec.endpoints:
        by_role.setdefault(ep.role, []).append(ep.address)
    ps, workers = ",".join(by_role["ps_server"]), ",".join(by_role["worker"])
    tf_cluster = {"ps": by_role["ps_server"], "worker": by_role["worker"]}
    for ep in cluster_spec.endpoints:
        env = json.loads((out / f"{ep.role}.{ep.index}.json").read_text())
        rank = cluster_spec.endpoints.index(ep)
        tf_type = "ps" if ep.role == "ps_server" else "worker"
        expected = {
            "PAI_JOB_NAME": "tensorflow-distributed-jobguid",
            "PAI_TASK_ROLE_NAME": ep.role,
            "PAI_TASK_ROLE_INDEX": str(ep.index),
            "PAI_TASK_ROLE_NO": "0" if ep.role == "ps_server" else "1",
            "PAI_TASK_ROLE_NUM": "2",
            "PAI_TASKS_NUM": "4",
            "PAI_TASK_ROLES_NUM": "2",
            "PAI_TASK_CPU_NUM": "2" if ep.role == "ps_server" else "1",
            "PAI_KILL_ALL_ON_COMPLETED_TASK_NUM": "2",
            "PAI_DATA_DIR": "hdfs://path/tensorflow-distributed-jobguid/data",
            "PAI_OUTPUT_DIR": str(tmp_path / "output"),
            "PAI_CURRENT_CONTAINER_IP": ep.host,
            "PAI_CURRENT_CONTAINER_PORT": str(ep.port),
            "PAI_TASK_ROLE_0_HOST_LIST": ps,
            "PAI_TASK_ROLE_1_HOST_LIST": workers,
            "PAI_TASK_ROLE_ps_server_HOST_LIST": ps,
            "PAI_TASK_ROLE_worker_HOST_LIST": workers,
            "TF_PS_HOSTS": ps,
            "TF_WORKER_HOSTS": workers,
            "VC_TASK_INDEX": str(ep.index),
            "MA_TASK_NAME": tf_type,
            "WORLD_SIZE": "4",
            "RANK": str(rank),
            "MASTER_ADDR": cluster_spec.endpoints[0].host,
            "MASTER_PORT": str(cluster_spec.endpoints[0].port),
        }
        assert {k: env.get(k) for k in expected} == expected, f"{ep.role}.{ep.index}"
        assert json.loads(env["TF_CONFIG"]) == {
            "cluster": tf_cluster,
            "task": {"type": tf_type, "index": ep.index},
            "environment": "cloud",
        }
        assert json.loads(env["CLUSTER_SPEC"])["cluster"] == tf_cluster
        hostfile = Path(env["MUSTER_MPI_HOSTFILE"]).read_text().split("\n")
        assert hostfile[:2] == ["127.0.0.1 slots=2", "127.0.0.2 slots=2"] or hostfile[:2] == [
            "127.0.0.2 slots=2",
            "127.0.0.1 slots=2",
        ]
    # The ports each task was given are distinct on each node.
    per_node: dict[str, list[int]] = {}
    for ep in cluster_spec.endpoints:
        per_node.setdefault(ep.node, []).append(ep.port)
    assert all(len(ports) == len(set(ports)) for ports in per_node.values())


async def test_a_one_task_job_starts_without_a_rendezvous_and_sees_itself_as_its_cluster(
    cluster, nc, tmp_path
):
    """A job of one task (not elastic) is its own whole gang: its agent builds the spec from its
    own endpoint, so no endpoint is reported and no spec message goes out (issue 28: six fewer
    messages for the commonest job), and its environment names it as rank 0 of 1, as a spec
    from the registry would."""
    cluster.core()
    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "2", "--ports", "22000-22999")
    out = tmp_path / "envs"
    out.mkdir()
    config = {
        "jobName": "solo",
        "image": "img",
        "taskRoles": [
            role("trainer", 1, dump_env(out), portList=[{"label": "http", "beginAt": 0, "portNumber": 2}])
        ],
    }
    record = await run_job(nc, config)
    assert record.state == JobState.SUCCEEDED, cluster.logs()
    env = json.loads((out / "trainer.0.json").read_text())
    port = env["PAI_CURRENT_CONTAINER_PORT"]
    assert 22000 <= int(port) <= 22999, env
    expected = {
        "PAI_TASKS_NUM": "1",
        "PAI_CURRENT_CONTAINER_IP": "127.0.0.1",
        "PAI_TASK_ROLE_trainer_HOST_LIST": f"127.0.0.1:{port}",
        "WORLD_SIZE": "1",
        "RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }
    assert {k: env.get(k) for k in expected} == expected
    assert len(env["PAI_CONTAINER_HOST_http_PORT_LIST"].split(",")) == 2, env
    js = nc.jetstream()
    for subject in (
        subjects.cluster_spec(record.job_id, 1),
        subjects.task_event(record.job_id, 1, "trainer", 0, "endpoint", "n1"),
    ):
        with pytest.raises(NotFoundError):
            await js.get_last_msg(subjects.EVENTS_STREAM, subject)


async def test_services_whose_consumers_are_gone_make_them_again(cluster, nc):
    """The bus lost the services' consumers (a server rebuilt without its volume and set up
    again has none of them): their fetches failed for ever while their health said connected,
    and nothing was judged, rendezvoused, recorded or killed again. Each service now makes its
    consumers again: a two-task gang runs to its end, and a kill stops a job."""
    cluster.core()
    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "4")
    gang = {"image": "img", "taskRoles": [role("w", 2, "true")]}
    assert (await run_job(nc, {"jobName": "before", **gang})).state == JobState.SUCCEEDED, cluster.logs()
    js = nc.jetstream()
    for stream, consumer in (
        (subjects.SUBMISSIONS_STREAM, subjects.VALIDATOR_CONSUMER),
        (subjects.SUBMISSIONS_STREAM, subjects.SUPERVISOR_KILL_CONSUMER),
        (subjects.EVENTS_STREAM, subjects.SUPERVISOR_CONSUMER),
        (subjects.EVENTS_STREAM, subjects.REGISTRY_CONSUMER),
        (subjects.EVENTS_STREAM, MEMBERS_CONSUMER),
    ):
        await js.delete_consumer(stream, consumer)
    assert (await run_job(nc, {"jobName": "after", **gang})).state == JobState.SUCCEEDED, cluster.logs()
    _, verdict = await client.submit(
        nc, json.dumps({"jobName": "long", "image": "img", "taskRoles": [role("w", 1, "sleep 600")]}).encode()
    )
    assert verdict is not None and verdict.accepted and verdict.job_id, verdict
    await all_running(nc, verdict.job_id)
    user = client.submitter(nc)
    kill = KillRequest(job_id=verdict.job_id, user=user, grace=0)
    await js.publish(subjects.kill_request(user), kill.to_bytes())
    assert (await wait_final(nc, verdict.job_id, 60)).state == JobState.STOPPED, cluster.logs()


async def all_running(nc, job_id: str, timeout: float = 60) -> None:
    """Until attempt 1 of `job_id` shows every task running."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if all(t.state == TaskState.RUNNING for t in (await attempt(nc, job_id)).tasks):
                return
        except Exception:
            pass
        assert time.monotonic() < deadline, f"{job_id} never ran"
        await asyncio.sleep(0.2)


async def test_pytorch_gloo_allreduce_on_the_process_runtime(cluster, nc, tmp_path):
    pytest.importorskip("torch")
    cluster.core()
    cluster.agent("solo", "--address", "127.0.0.1", "--cpus", "4", "--memory-mb", "8192")
    config = json.loads(
        "\n".join(
            line
            for line in (ROOT / "examples/pytorch-allreduce/job.json").read_text().splitlines()
            if not line.strip().startswith("//")
        )
    )
    config["codeDir"] = str(ROOT / "examples/pytorch-allreduce")
    record = await run_job(nc, config, timeout=180)
    a = await attempt(nc, record.job_id)
    assert record.state == JobState.SUCCEEDED, (a.tasks, cluster.logs())
    lines = sorted(line for t in a.tasks for line in t.last_lines if "all_reduce" in line)
    assert lines == [f"rank {r}/3: all_reduce sum 6 ok (master 127.0.0.1)" for r in range(3)]


async def test_an_attempt_past_max_run_time_is_stopped_and_retried_as_retry_count_says(cluster, nc, tmp_path):
    """maxRunTimeSec: each attempt of a job that would run 10 minutes is stopped 2 s after its
    first task started, fails as the user's, and runs again once (retryCount 1); then the job
    fails, saying why. No task of it is left running."""
    cluster.core()
    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "4")
    runs = tmp_path / "runs"
    command = f"echo $MUSTER_ATTEMPT >> {runs}; sleep 600"
    config = {
        "jobName": "limited",
        "image": "img",
        "maxRunTimeSec": 2,
        "retryCount": 1,
        "taskRoles": [role("w", 2, command)],
    }
    record = await run_job(nc, config, timeout=120)
    assert record.state == JobState.FAILED and record.attempt == 2, (record, cluster.logs())
    assert "ran past maxRunTimeSec (2 s since" in record.reason and "all 1 retries spent" in record.reason
    assert sorted(runs.read_text().split()) == ["1", "1", "2", "2"]
    for n in (1, 2):
        a = await ended_attempt(nc, record.job_id, n)
        first = min(t.started_at for t in a.tasks if t.started_at is not None)
        assert a.ended_at is not None and (a.ended_at - first).total_seconds() >= 2, a
        assert a.failure is not None and a.failure.kind == "user", a.failure
        assert {t.state for t in a.tasks} == {TaskState.STOPPED}, a.tasks


async def _lease_holder(nc, timeout: float = 30) -> str:
    leases = await nc.jetstream().key_value(subjects.LEASES_BUCKET)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return (await leases.get(subjects.SCHEDULER_LEASE)).value.decode()
        except Exception:
            assert time.monotonic() < deadline, "no scheduler took the lease"
            await asyncio.sleep(0.1)


async def test_killing_the_active_scheduler_mid_stream_standby_takes_over(cluster, nc, tmp_path):
    for module in ("muster.services.validator", "muster.services.registry", "muster.services.supervisor"):
        cluster.start(module)
    schedulers = [cluster.start("muster.services.scheduler"), cluster.start("muster.services.scheduler")]
    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "4")
    runs = tmp_path / "runs.log"
    jobs = []
    for i in range(12):
        config = {
            "jobName": f"once-{i}",
            "image": "img",
            "taskRoles": [role("main", 2, f"echo $PAI_JOB_NAME.$PAI_TASK_ROLE_INDEX >> {runs}; sleep 0.3")],
        }
        _, verdict = await client.submit(nc, json.dumps(config).encode(), timeout=30)
        assert verdict and verdict.accepted
        jobs.append(verdict.job_id)
        if i == 3:  # kill whichever scheduler holds the lease, with work in flight
            holder = await _lease_holder(nc)
            deadline = time.monotonic() + 30  # the lease is taken a moment before it is logged
            while not (leaders := [p for p in schedulers if holder in p.log_path.read_text()]):
                assert time.monotonic() < deadline, f"no scheduler logged lease {holder}"
                await asyncio.sleep(0.1)
            leader = leaders[0]
            leader.send_signal(signal.SIGKILL)
            leader.wait(5)
            standby = next(p for p in schedulers if p is not leader)
    for job_id in jobs:
        record = await wait_final(nc, job_id, timeout=120)
        assert record.state == JobState.SUCCEEDED and record.attempt == 1, cluster.logs()
    assert standby.poll() is None
    assert "scheduler.leader" in standby.log_path.read_text()
    lines = runs.read_text().split()
    assert sorted(lines) == sorted(f"once-{i}.{k}" for i in range(12) for k in range(2)), (
        "a task ran twice or never"
    )
    kv = await nc.jetstream().key_value(subjects.ATTEMPTS_BUCKET)
    assert sorted(await Store(kv, AttemptRecord).keys()) == sorted(f"{j}.1" for j in jobs)
