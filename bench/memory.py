"""Scheduler memory per queued job: what the scheduler's view holds for each waiting job, beyond
the job's spec (its config, which any scheduler must keep to place it).

    python -m bench.memory [--jobs 10000,100000]

For each size, N single-task job records are decoded from their wire form (as the KV watcher
does), kept as the scheduler keeps them (`view.Job`) and fed to its view
(`muster.services.scheduler.view.View`); tracemalloc counts the bytes allocated and still held.
The floor, measured beside it: the same N configs decoded alone.
Per job beyond the spec = (view - configs) / N.

Beside it, the supervisor's share of the retention window (finished jobs are kept for
MUSTER_JOB_RETENTION, a week by default): the bytes it holds per finished job
(`policy.Finished`, what pruning takes) against the whole decoded record it used to hold.
Prints a table, then one JSON line."""

from __future__ import annotations

import argparse
import gc
import json
import tracemalloc
from datetime import timedelta
from typing import Any

from muster.services.scheduler.view import Job, View
from muster.services.supervisor.policy import Finished
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import JobRecord, JobState, now


def wire(n: int) -> bytes:
    """Job n's record as the validator writes it."""
    config = {
        "jobName": f"train-{n}",
        "image": "pytorch/pytorch:2.3.0-cuda12.1-cudnn8-runtime",
        "gpuType": "V100",
        "taskRoles": [
            {
                "name": "worker",
                "taskNumber": 1,
                "cpuNumber": 4,
                "memoryMB": 16384,
                "gpuNumber": 1,
                "command": "python train.py --epochs 10",
            }
        ],
    }
    record = JobRecord(
        job_id=f"j{n:08x}",
        job_name=f"train-{n}",
        submission_id=f"s{n}",
        user="alice",
        config=JobConfig.model_validate(config),
        digest="0" * 64,
        submitted_at=now() + timedelta(microseconds=n),
    )
    return record.to_bytes()


def held(build: Any) -> tuple[int, Any]:
    """Bytes allocated by build() and still held, with what it built (kept alive)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = build()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return after - before, kept


def measure(n: int) -> dict[str, Any]:
    records = [wire(i) for i in range(n)]
    configs = [json.dumps(json.loads(r)["config"]).encode() for r in records]

    def specs() -> list[JobConfig]:
        return [JobConfig.model_validate_json(c) for c in configs]

    def view() -> View:
        v = View(node_timeout=5)
        for i, data in enumerate(records):
            job_id = f"j{i:08x}"
            v.jobs[job_id] = Job.of(JobRecord.model_validate_json(data))  # as the watcher keeps it
            v.job_changed(job_id)
        assert v.waiting == n
        return v

    ended = [
        JobRecord.model_validate_json(r)
        .model_copy(update={"state": JobState.SUCCEEDED})
        .model_dump_json()
        .encode()
        for r in records
    ]

    def whole() -> list[JobRecord]:
        return [JobRecord.model_validate_json(r) for r in ended]

    def finished() -> list[JobRecord | Finished]:
        return [Finished.held(JobRecord.model_validate_json(r)) for r in ended]

    spec_bytes, kept_specs = held(specs)
    del kept_specs
    view_bytes, kept_view = held(view)
    del kept_view
    whole_bytes, kept_whole = held(whole)
    del kept_whole
    finished_bytes, kept_finished = held(finished)
    assert all(isinstance(f, Finished) for f in kept_finished)
    del kept_finished
    return {
        "jobs": n,
        "wire_bytes_per_job": round(sum(map(len, records)) / n),
        "spec_bytes_per_job": round(spec_bytes / n),
        "view_bytes_per_job": round(view_bytes / n),
        "beyond_spec_per_job": round((view_bytes - spec_bytes) / n),
        "supervisor_finished_bytes_per_job": round(finished_bytes / n),
        "supervisor_whole_record_bytes_per_job": round(whole_bytes / n),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", default="10000,100000", help="queue sizes, comma-separated")
    args = p.parse_args(argv)
    rows = [measure(int(n)) for n in args.jobs.split(",")]
    print(
        f"{'queued':>8} {'wire B':>8} {'spec B':>8} {'view B':>8} {'beyond spec B':>14}"
        f"  {'supervisor B/finished job':>26} {'(whole record B)':>17}"
    )
    for r in rows:
        print(
            f"{r['jobs']:>8} {r['wire_bytes_per_job']:>8} {r['spec_bytes_per_job']:>8} "
            f"{r['view_bytes_per_job']:>8} {r['beyond_spec_per_job']:>14}"
            f"  {r['supervisor_finished_bytes_per_job']:>26} {r['supervisor_whole_record_bytes_per_job']:>17}"
        )
    print(json.dumps({"bench": "memory", "rows": rows}))


if __name__ == "__main__":
    main()
