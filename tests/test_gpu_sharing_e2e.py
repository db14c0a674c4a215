"""Fractional GPUs through the real services: a job of half-GPU tasks submitted on the bus, placed
by the scheduler on an agent with declared GPUs and run as processes. Four halves run at once on
two GPUs (two per device), a 1-GPU job waits while the GPUs are shared and says why, and runs
once they are free. (The agent's sharing modes, time-slicing and MPS, are tests/test_agent_gpu_sharing.py.)"""

from __future__ import annotations

import asyncio
import json
import time

from muster.shared import bus, client, subjects
from muster.shared.messages import JobRecord, JobState
from tests.test_jobs import attempt, role, run_job, wait_final

# Each task notes its device, then waits until all four have started: they can only all finish if
# the four run at the same time on the node's two GPUs.
BARRIER = (
    "echo $CUDA_VISIBLE_DEVICES > {out}/$PAI_TASK_ROLE_INDEX; "
    "n=0; while [ $(ls {out} | wc -l) -lt 4 ]; do n=$((n+1)); [ $n -gt 900 ] && exit 1; sleep 0.1; done"
)


async def test_four_half_gpu_tasks_share_two_gpus_and_a_whole_gpu_job_waits_for_them(
    cluster, nats_url, tmp_path
):
    cluster.core()
    cluster.agent("gpu-box", "--gpus", "2xT4", "--cpus", "8", "--address", "127.0.0.1")
    nc = await bus.connect("test", nats_url)
    try:
        out = tmp_path / "devices"
        out.mkdir()
        gate = tmp_path / "gate"
        halves = {
            "jobName": "halves",
            "image": "img",
            "taskRoles": [
                role(
                    "train",
                    4,
                    BARRIER.format(out=out) + f"; while [ ! -e {gate} ]; do sleep 0.1; done",
                    gpu=0.5,
                )
            ],
        }
        _, verdict = await client.submit(nc, json.dumps(halves).encode(), timeout=30)
        assert verdict is not None and verdict.accepted, verdict
        kv = await nc.jetstream().key_value(subjects.JOBS_BUCKET)
        deadline = time.monotonic() + 90
        while len(list(out.iterdir())) < 4:  # all four running at once, on two GPUs
            assert time.monotonic() < deadline, "the four half-GPU tasks did not all start"
            await asyncio.sleep(0.2)
        devices = sorted((out / str(i)).read_text().strip() for i in range(4))
        assert devices == ["0", "0", "1", "1"], devices

        # While both GPUs are shared, a whole-GPU job waits, and says why.
        _, whole = await client.submit(
            nc,
            json.dumps(
                {"jobName": "whole", "image": "img", "taskRoles": [role("t", 1, "true", gpu=1)]}
            ).encode(),
        )
        assert whole is not None and whole.accepted
        while True:
            record = JobRecord.from_bytes((await kv.get(whole.job_id)).value)
            if "no GPU is free now" in record.reason:
                break
            assert record.state == JobState.WAITING, (record.state, record.reason)
            assert time.monotonic() < deadline, record.reason
            await asyncio.sleep(0.2)

        gate.touch()  # the halves end; the GPUs are untouched again and the whole job runs
        done = await wait_final(nc, verdict.job_id, timeout=60)
        assert done.state == JobState.SUCCEEDED, done.reason
        tasks = (await attempt(nc, verdict.job_id)).tasks
        assert sorted((t.gpus[0], t.gpu_milli) for t in tasks) == [(0, 500), (0, 500), (1, 500), (1, 500)]
        assert (await wait_final(nc, whole.job_id, timeout=60)).state == JobState.SUCCEEDED

        # A share larger than what is left of a GPU takes the other one.
        record = await run_job(
            nc,
            {
                "jobName": "mixed",
                "image": "img",
                "taskRoles": [role("big", 1, "true", gpu=0.7), role("small", 1, "true", gpu=0.4)],
            },
        )
        assert record.state == JobState.SUCCEEDED, record.reason
        tasks = (await attempt(nc, record.job_id)).tasks
        assert sorted(t.gpus[0] for t in tasks) == [0, 1]
    finally:
        await nc.close()
