"""The node agent: inventory (declared and discovered GPUs, ports), registration and heartbeats
on a real bus, GPU tasks given disjoint device indexes, pending reasons a person can act on."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import types

import pytest

from muster.services.agent.inventory import PortPool, discover_gpus, parse_gpus, short_model
from muster.services.agent.service import begin_reading
from muster.shared import bus, client, subjects
from muster.shared.messages import JobRecord, JobState, NodeInfo
from muster.shared.natsserver import NatsServer
from tests.test_jobs import attempt, role, run_job


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("8xV100", [(i, "V100") for i in range(8)]),
        ("4xV100,2xT4", [(0, "V100"), (1, "V100"), (2, "V100"), (3, "V100"), (4, "T4"), (5, "T4")]),
        (" 1 x A100 ", [(0, "A100")]),
        ("", []),
        ("0", []),
    ],
)
def test_declared_gpus(spec, expected):
    assert [(g.index, g.model) for g in parse_gpus(spec)] == expected


@pytest.mark.parametrize("bad", ["V100", "4V100", "x4", "4xV100;2xT4", "-1xT4", "1x" + "A" * 65])
def test_bad_gpu_declarations_say_what_is_expected(bad):
    with pytest.raises(ValueError, match="expected COUNTxMODEL"):
        parse_gpus(bad)


@pytest.mark.parametrize("bad", ["65xV100", "100000xV100", "60xV100,5xT4"])
def test_more_gpus_than_a_node_can_have_are_refused_in_a_line(bad):
    """A declaration no node record may carry: refused at the flag, not by a traceback when the
    agent registers."""
    with pytest.raises(ValueError, match="at most 64 GPUs on one node"):
        parse_gpus(bad)


def test_an_agent_refuses_a_bad_gpu_declaration_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "muster.services.agent", "--gpus", "1x" + "A" * 70, "--runtime", "process"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MUSTER_DATA_DIR": str(tmp_path), "MUSTER_NATS_URL": "nats://127.0.0.1:1"},
    )
    assert proc.returncode != 0
    assert "--gpus" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("Tesla V100-SXM2-16GB", "V100"),
        ("NVIDIA A100-SXM4-40GB", "A100"),
        ("Tesla T4", "T4"),
        ("NVIDIA GeForce RTX 3090", "RTX3090"),
        ("NVIDIA L40S", "L40S"),
    ],
)
def test_nvml_names_become_the_words_gpuType_uses(name, model):
    assert short_model(name) == model


def test_no_driver_means_no_discovered_gpus():
    # These machines have no NVIDIA driver: discovery says "none found", it does not raise.
    assert discover_gpus() in (None, [])  # [] only where a driver with no devices is installed


def test_port_pool_never_hands_out_a_port_twice_or_one_in_use():
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        pool = PortPool(taken - 2, taken + 2)
        got = pool.take(4)
        assert taken not in got and len(set(got)) == 4
        with pytest.raises(RuntimeError, match="no 1 free ports"):
            pool.take(1)
        pool.release(got[:1])
        assert pool.take(1) == got[:1]
        with pytest.raises(RuntimeError, match="in use"):
            pool.take_range(taken, 1)
        # Tasks in another network namespace (--docker-network container:NAME): a bind here
        # says nothing about theirs, so only the pool's own ports are kept apart.
        elsewhere = PortPool(taken, taken + 1, probe=False)
        assert elsewhere.take(2) == [taken, taken + 1]
        with pytest.raises(RuntimeError, match="no 1 free ports"):
            elsewhere.take(1)


async def test_agent_registers_declared_inventory_and_reregisters_after_an_outage(tmp_path, cluster):
    server = NatsServer(tmp_path / "nats2").start()
    cluster.url = server.url
    work_root = cluster.log_dir / "work" / "gpu-box"
    work_root.mkdir(parents=True, mode=0o755)  # as an older agent or a careless operator left it
    cluster.agent(
        "gpu-box", "--gpus", "4xV100,2xT4", "--cpus", "16", "--memory-mb", "65536", "--heartbeat", "0.5"
    )
    try:
        nc = await bus.connect("test", server.url)
        info = await _wait_node(nc, "gpu-box")
        assert (info.cpus, info.memory_mb, info.runtime) == (16, 65536, "process")
        assert [(g.index, g.model) for g in info.gpus] == [
            (0, "V100"),
            (1, "V100"),
            (2, "V100"),
            (3, "V100"),
            (4, "T4"),
            (5, "T4"),
        ]
        # Attempt directories (the MPI rsh socket, code, hostfiles) are the agent's alone.
        assert work_root.stat().st_mode & 0o777 == 0o700
        await nc.close()

        # The bus goes away and comes back empty (a new server, same port, no data): the agent
        # registers again by itself.
        server.stop()
        await asyncio.sleep(1.5)
        server = NatsServer(tmp_path / "nats3", port=server.port).start()
        nc = await bus.connect("test", server.url)
        again = await _wait_node(nc, "gpu-box")
        assert again.agent_id == info.agent_id and again.heartbeat_at > info.heartbeat_at
        await nc.close()
    finally:
        cluster.stop_all()
        server.stop()


async def _wait_node(nc, node: str, timeout: float = 20) -> NodeInfo:
    deadline = time.monotonic() + timeout
    while True:
        try:
            kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)
            return NodeInfo.from_bytes((await kv.get(node)).value)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_gpu_tasks_get_disjoint_devices_of_the_right_type(cluster, nats_url, tmp_path):
    cluster.core()
    cluster.agent("mixed", "--gpus", "4xV100,2xT4", "--cpus", "8", "--address", "127.0.0.1")
    nc = await bus.connect("test", nats_url)
    try:
        out = tmp_path / "gpus"
        out.mkdir()
        show = f"echo $CUDA_VISIBLE_DEVICES > {out}/$PAI_TASK_ROLE_INDEX; test $PAI_TASK_GPU_NUM = 2"
        record = await run_job(
            nc,
            {
                "jobName": "v100s",
                "image": "img",
                "gpuType": "v100",
                "taskRoles": [role("train", 2, show, gpu=2)],
            },
        )
        assert record.state == JobState.SUCCEEDED
        seen = [set((out / str(i)).read_text().strip().split(",")) for i in range(2)]
        assert seen[0].isdisjoint(seen[1]) and seen[0] | seen[1] == {"0", "1", "2", "3"}
        tasks = (await attempt(nc, record.job_id)).tasks
        assert sorted(g for t in tasks for g in t.gpus) == [0, 1, 2, 3]

        # A job asking for a model the cluster lacks waits, and says why.
        _, verdict = await client.submit(
            nc,
            json.dumps(
                {
                    "jobName": "a100",
                    "image": "img",
                    "gpuType": "A100",
                    "taskRoles": [role("t", 1, "true", gpu=1)],
                }
            ).encode(),
        )
        kv = await nc.jetstream().key_value(subjects.JOBS_BUCKET)
        deadline = time.monotonic() + 20
        while True:
            job = JobRecord.from_bytes((await kv.get(verdict.job_id)).value)
            if "A100" in job.reason or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert job.state == JobState.WAITING
        assert "A100" in job.reason and "T4" in job.reason and "V100" in job.reason, job.reason
    finally:
        await nc.close()


def test_an_agent_that_crashes_before_its_first_heartbeat_leaves_where_to_read_on_from(tmp_path):
    """A successor of an agent killed before its first heartbeat reads its tasks' output on
    from where that agent began (or from where it had been told to), not from its own start:
    what the tasks wrote in between is not lost."""
    root = str(tmp_path)
    before = time.time()
    assert begin_reading(root) is None  # a first start
    first = begin_reading(root)  # the next agent, after a crash before any heartbeat
    assert first is not None and first <= before
    assert begin_reading(root) == first  # and the one after it, crashed as early: still from there
    assert begin_reading(root, note=False) == first  # a runtime that adopts nothing notes nothing
    assert begin_reading(root) is None


async def test_a_restarted_agent_counts_a_solo_order_it_kept_as_taken(nats_url, tmp_path):
    """A solo task (one task, not elastic) reports no endpoint, so a restarted agent knows it
    took the order from the order it kept on its disk (saved before the order was acked): the
    task is then lost, not left waiting for an order that will never come again. A task of a
    bigger gang with no endpoint reported was not taken."""
    from muster.services.agent.reconcile import Assignments, Reconciler
    from muster.shared.jobconfig import JobConfig
    from muster.shared.messages import Assignment, TaskState, TaskStatus

    nc = await bus.connect("test", nats_url)
    try:
        js, _ = await bus.ensure_jetstream(nc)
        kept = Assignments(tmp_path / "orders")
        tasks = types.SimpleNamespace(runtime=None, node="n1")  # was_taken needs none of them
        reconciler = Reconciler(tasks, kept, js, "127.0.0.1")  # type: ignore[arg-type]
        placed = TaskStatus(role="w", role_no=0, index=0, node="n1", state=TaskState.PLACED)
        for n, (tasks, taken) in enumerate([(1, True), (2, False)], start=1):
            config = JobConfig.model_validate(
                {"jobName": f"j{n}", "image": "i", "taskRoles": [role("w", tasks, "x")]}
            )
            order = Assignment(
                job_id=f"j{n}", attempt=1, user="u", config=config, gang=[placed.spec()], node="n1"
            )
            assert order.solo is (tasks == 1)
            assert await reconciler.was_taken((f"j{n}", 1, "w", 0), placed) is False  # no order kept
            kept.save(order)
            assert await reconciler.was_taken((f"j{n}", 1, "w", 0), placed) is taken
    finally:
        await nc.close()
