"""Disk hygiene on a node: after many finished jobs, does the work root hold anything older than
the retention? (Issue 23 point 5; services/agent/workdirs.py.)

    python -m bench.workdirs [--attempts 10000] [--retention 2] [--leftovers 500]
                             [--mesh-jobs 300] [--mesh-nodes 4] [--mesh-retention 5]

Two runs, each a row:
  * `module`: the agent's work-directory code driven directly, as its task lifecycle drives it, at
    `--attempts` attempts on one work root: each gets what a real attempt leaves (a task
    directory with an env file and its output, a hostfile, a synced checkout's files), is in use
    while it "runs", and is reported ended; the work root also starts with `--leftovers` attempt
    directories a crashed agent left (never ended, never marked), which the start-up sweep must
    find. Real files, real renames and deletes; the clock is the machine's.
  * `mesh`: the real services and one process of `--mesh-nodes` sim nodes (the sim runtime starts
    nothing, but each task still gets its directory and hostfile, as on any node), the agent
    started with MUSTER_WORKDIR_RETENTION=`--mesh-retention`, `--mesh-jobs` one-task jobs submitted
    and run to their end (0 to skip this row).
For each: the attempt directories on disk at most while it ran (sampled), how many there were
`retention` + 2 s after the last end (the target: none older than the retention, so none), and
the oldest ended one's age then. A table, then one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cluster import BENCH_USER, Mesh
from muster.services.agent import workdirs
from muster.services.agent.output import output_path
from muster.services.agent.workdirs import Workdirs
from muster.shared import subjects
from muster.shared.subjects import Headers

OUTPUT_BYTES = 4096  # a task's output kept on the node, per attempt here


def attempt_dirs(roots: list[Path]) -> list[tuple[Path, float | None]]:
    """Every attempt directory under these work roots, with when it was marked ended (None:
    not marked: in use, or not found by a sweep yet)."""
    out = []
    for root in roots:
        for job in root.iterdir() if root.is_dir() else []:
            if job.name.startswith(".") or job.name in workdirs.AGENT_FILES or not job.is_dir():
                continue
            for attempt in job.iterdir():
                if attempt.name.isdigit() and attempt.is_dir():
                    mark = job / f"{attempt.name}{workdirs.ENDED}"
                    try:
                        out.append((attempt, float(mark.read_text())))
                    except (OSError, ValueError):
                        out.append((attempt, None))
    return out


def node_roots(scratch: Path) -> list[Path]:
    return [p for p in scratch.iterdir() if p.is_dir()] if scratch.is_dir() else []


def make_attempt(root: Path, job_id: str, attempt: int) -> None:
    task = workdirs.task_dir(root, job_id, attempt, "worker", 0)
    task.mkdir(parents=True)
    (task / "env").write_text("export PAI_TASK_ROLE_NAME='worker'\n")
    out = output_path(str(root), job_id, attempt, "worker", 0)
    out.parent.mkdir()
    out.write_bytes(b"x" * OUTPUT_BYTES)
    base = workdirs.attempt_dir(root, job_id, attempt)
    (base / "hostfile").write_text("worker-0 slots=1\n")
    code = base / "code"
    code.mkdir()
    (code / "train.py").write_text("print('hi')\n")


async def run_module(attempts: int, retention: float, leftovers: int, root: Path) -> dict[str, Any]:
    for k in range(leftovers):  # a crashed agent's: no mark, nothing live
        make_attempt(root, f"left{k:06d}", 1)
    live: set[tuple[str, int]] = set()
    dirs = Workdirs(root, lambda: live, node="bench", retention=retention, sweep_every=3600)
    t0 = time.monotonic()
    dirs.start()  # the start-up sweep: marks the leftovers (kept `retention` from now)
    peak = leftovers
    for k in range(attempts):
        key = (f"j{k:06d}", 1)
        live.add(key)  # taken on: in use from here
        make_attempt(root, *key)
        live.discard(key)  # its last task here ended
        dirs.ended(*key)
        if k % 100 == 0:
            await asyncio.sleep(0)  # let removals that are due run, as an agent's loop would
            peak = max(peak, len(attempt_dirs([root])))
    ended_s = time.monotonic() - t0
    await asyncio.sleep(retention + 2)
    await dirs.close()
    left = attempt_dirs([root])
    now = time.time()
    return {
        "run": "module",
        "attempts": attempts,
        "leftovers": leftovers,
        "retention_s": retention,
        "ended_per_s": round(attempts / ended_s, 1),
        "peak_attempt_dirs": peak,
        "removed": dirs.removed,
        "attempt_dirs_after": len(left),
        "older_than_retention_after": sum(1 for _, at in left if at is None or now - at > retention),
        "oldest_ended_age_s": round(max((now - at for _, at in left if at), default=0.0), 2),
        "trash_left": sum(1 for _ in (root / workdirs.TRASH).iterdir())
        if (root / workdirs.TRASH).exists()
        else 0,
    }


def sim_job(name: str) -> bytes:
    return json.dumps(
        {
            "jobName": name,
            "image": "muster/bench:sim",
            "taskRoles": [
                {
                    "name": "worker",
                    "taskNumber": 1,
                    "cpuNumber": 1,
                    "memoryMB": 512,
                    "gpuNumber": 0,
                    "command": "true",
                }
            ],
            "extras": {"sim": {"seconds": 0.2}},
        }
    ).encode()


async def run_mesh(jobs: int, nodes: int, retention: float, workdir: Path) -> dict[str, Any]:
    env = {"MUSTER_WORKDIR_RETENTION": str(retention), "MUSTER_MAX_TASKS_PER_USER": "100000000"}
    with Mesh(workdir, nodes, cpus=16, memory_mb=65536, env=env) as mesh:
        await mesh.wait_ready()
        nc = await mesh.connect()
        ended: set[str] = set()

        async def on_end(msg: Any) -> None:
            ended.add(msg.subject.split(".")[-2])

        try:
            await nc.subscribe(subjects.job_event("*", "ended"), cb=on_end)
            js = nc.jetstream(timeout=30)
            t0 = time.monotonic()
            for i in range(jobs):
                sid = f"wd-{i}"
                await js.publish(
                    subjects.submit(BENCH_USER),
                    sim_job(sid),
                    headers={Headers.SUBMISSION_ID: sid, Headers.MSG_ID: sid},
                )
            peak = 0
            deadline = time.monotonic() + 120 + jobs * 0.5
            while len(ended) < jobs and time.monotonic() < deadline:
                mesh.check()
                peak = max(peak, len(attempt_dirs(node_roots(mesh.scratch))))
                await asyncio.sleep(0.5)
            ended_s = time.monotonic() - t0
            at_end = len(attempt_dirs(node_roots(mesh.scratch)))
            until = time.monotonic() + retention + 2
            while time.monotonic() < until:  # kept for the retention, then gone
                peak = max(peak, len(attempt_dirs(node_roots(mesh.scratch))))
                await asyncio.sleep(0.5)
            left = attempt_dirs(node_roots(mesh.scratch))
            now = time.time()
            return {
                "run": "mesh",
                "attempts": jobs,
                "nodes": nodes,
                "ended": len(ended),
                "retention_s": retention,
                "ended_per_s": round(len(ended) / ended_s, 1),
                "peak_attempt_dirs": max(peak, at_end),
                "attempt_dirs_at_end": at_end,
                "attempt_dirs_after": len(left),
                "older_than_retention_after": sum(1 for _, at in left if at is None or now - at > retention),
                "oldest_ended_age_s": round(max((now - at for _, at in left if at), default=0.0), 2),
            }
        finally:
            await nc.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--attempts", type=int, default=10_000, help="module run: attempts ended on one node")
    p.add_argument("--retention", type=float, default=2.0, help="module run: seconds kept after the end")
    p.add_argument("--leftovers", type=int, default=500, help="module run: a crashed agent's directories")
    p.add_argument("--mesh-jobs", type=int, default=300, help="mesh run: jobs (0: no mesh run)")
    p.add_argument("--mesh-nodes", type=int, default=4)
    p.add_argument("--mesh-retention", type=float, default=5.0)
    p.add_argument("--workdir", type=Path, default=None, help="keep data and logs here (default: a temp dir)")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="muster-workdirs-") as tmp:
        base = args.workdir or Path(tmp)
        root = base / "module-work"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        rows.append(asyncio.run(run_module(args.attempts, args.retention, args.leftovers, root)))
        if args.mesh_jobs:
            rows.append(
                asyncio.run(run_mesh(args.mesh_jobs, args.mesh_nodes, args.mesh_retention, base / "mesh"))
            )
    print("attempt directories on a node's work root (target: none older than the retention)")
    print(
        f"{'run':<7} {'attempts':>8} {'retention s':>11} {'ended/s':>8} {'peak dirs':>9} "
        f"{'dirs after':>10} {'older than retention':>20} {'oldest ended s':>14}"
    )
    for r in rows:
        print(
            f"{r['run']:<7} {r['attempts']:>8} {r['retention_s']:>11g} {r['ended_per_s']:>8} "
            f"{r['peak_attempt_dirs']:>9} {r['attempt_dirs_after']:>10} "
            f"{r['older_than_retention_after']:>20} {r['oldest_ended_age_s']:>14}"
        )
    print(
        "(after: retention + 2 s after the last attempt ended; module run: plus "
        f"{args.leftovers} leftovers of a crashed agent, found by the start-up sweep)"
    )
    print(json.dumps({"bench": "workdirs", "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
