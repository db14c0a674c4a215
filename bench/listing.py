"""`muster status` over a long retention window: the first page's latency and what the gateway
holds per retained job.

    python -m bench.listing [--jobs 10000,100000] [--runs 3] [--live-every 100] [--command-bytes 200]

For each size N: a nats-server (open: the CLI asks as an admin, every job), Muster's streams and
buckets, and the gateway as its own process. N job records are written straight to the jobs
bucket in their stored form (`JobRecord.to_bytes()`, as the validator and supervisor write
them): one in `--live-every` waiting or running, the others finished (succeeded, failed,
stopped), 50 users, 4 virtual clusters, a command of `--command-bytes`. Then, with the gateway
caught up:

- `muster status` (live jobs and the newest finished), `muster status --user u007` and
  `muster status --state failed --limit 50`, each run `--runs` times as a process: the time to
  its first job row on stdout and to its exit, and its exit code;
- `muster status --all --json` once: every page, how many, and how long in all;
- the gateway's memory: its RSS growth while the N records came in, per job, and the RSS of a
  fresh gateway that reads the N records from scratch (against an empty one's), per job, with
  the time that read takes; beside them, the records' wire size and, exactly (tracemalloc,
  in this process), the bytes the gateway's listing holds per job.

Prints a table, then one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from muster.services.gateway.listing import Listing, Summary
from muster.shared import bus, client, subjects
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import JobRecord, JobState
from muster.shared.natsserver import NatsServer, die_with_parent

ROOT = Path(__file__).resolve().parents[1]
FINISHED = [JobState.SUCCEEDED] * 16 + [JobState.FAILED] * 3 + [JobState.STOPPED]
T0 = datetime(2024, 5, 1, tzinfo=UTC)


def records(n: int, live_every: int, command_bytes: int, seed: int = 1) -> list[bytes]:
    """N job records in their stored form, one a minute or so, newest last."""
    rng = random.Random(seed)
    configs = {}
    for vc in ("default", "vision", "speech", "nlp"):
        configs[vc] = JobConfig.model_validate(
            {
                "jobName": "x",
                "image": "pytorch/pytorch:2.3.0-cuda12.1-cudnn8-runtime",
                "virtualCluster": vc,
                "gpuType": "V100",
                "taskRoles": [
                    {
                        "name": "worker",
                        "taskNumber": 2,
                        "cpuNumber": 4,
                        "memoryMB": 16384,
                        "gpuNumber": 1,
                        "command": "python train.py " + "x" * max(0, command_bytes - 16),
                    }
                ],
            }
        )
    out = []
    for i in range(n):
        live = i % live_every == 0
        state = rng.choice([JobState.WAITING, JobState.RUNNING]) if live else rng.choice(FINISHED)
        vc = rng.choice(list(configs))
        name = f"train-{i}"
        at = T0 + timedelta(seconds=60 * i + rng.randrange(60))
        out.append(
            JobRecord(
                job_id=f"j{i:012x}",
                job_name=name,
                state=state,
                submission_id=f"s{i}",
                user=f"u{rng.randrange(50):03d}",
                config=configs[vc].model_copy(update={"jobName": name}),
                digest="0" * 64,
                submitted_at=at,
                updated_at=at + timedelta(minutes=30),
                attempt=0 if state == JobState.WAITING else 1,
                reason="waiting for a scheduler" if state == JobState.WAITING else str(state).lower(),
            ).to_bytes()
        )
    return out


def rss(pid: int) -> int:
    """Resident bytes of a live process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def held_per_job(data: list[bytes]) -> float:
    """Bytes the gateway's listing holds per job (summaries and index), decoded as its watcher
    decodes them."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    listing = Listing()
    for raw in data:
        record = JobRecord.model_validate_json(raw)
        listing[record.job_id] = Summary.of(record)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(listing) == len(data)
    return (after - before) / len(data)


class Gateway:
    def __init__(self, url: str, workdir: Path, name: str) -> None:
        log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 (the child keeps it)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "muster.services.gateway"],
            env={
                **os.environ,
                "MUSTER_NATS_URL": url,
                "MUSTER_LOG_LEVEL": "warning",
                "PYTHONPATH": str(ROOT),
            },
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def put_all(kv: KeyValue, data: list[bytes]) -> None:
    """The records into the jobs bucket as `j<n>`, 500 writes in flight at a time."""
    for i in range(0, len(data), 500):
        chunk = data[i : i + 500]
        await asyncio.gather(*(kv.put(f"j{i + k:012x}", raw) for k, raw in enumerate(chunk)))


async def caught_up(nc: NATS, n: int, timeout: float = 600) -> float:
    """Seconds until the gateway answers with all `n` jobs listed."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            page = await client.ask(nc, "jobs", {"limit": 1}, timeout=5)
            if page.get("total") == n:
                return time.monotonic() - start
        except (TimeoutError, client.Refused):
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the gateway did not list {n} jobs within {timeout:g}s")


def run_status(url: str, *args: str) -> tuple[float, float, int, int]:
    """`muster status ARGS` as a process: seconds to its first job row, to its exit; its exit
    code; lines printed."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "muster.services.cli.main", "status", *args],
        env={**os.environ, "MUSTER_NATS_URL": url, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    first, lines = None, 0
    for line in proc.stdout:
        lines += 1
        if first is None and (lines == 2 or line.startswith(b"{")):  # past the header, or a page
            first = time.monotonic() - start
    _, errors = proc.communicate()
    took = time.monotonic() - start
    if proc.returncode:
        print(f"muster status {' '.join(args)}: {errors.decode(errors='replace')[-500:]}", file=sys.stderr)
    return (first if first is not None else took), took, proc.returncode, lines


def figures(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {"p50": round(statistics.median(ms), 1), "max": round(max(ms), 1)}


async def measure(n: int, runs: int, live_every: int, command_bytes: int, workdir: Path) -> dict[str, Any]:
    data = records(n, live_every, command_bytes)
    with NatsServer(workdir / "nats") as server:
        nc = await bus.connect("bench", server.url)
        try:
            _, buckets = await bus.ensure_jetstream(nc)
            gateway = Gateway(server.url, workdir, "gateway")
            try:
                await caught_up(nc, 0)
                await asyncio.sleep(1)
                empty = rss(gateway.proc.pid)
                await put_all(buckets[subjects.JOBS_BUCKET], data)
                await caught_up(nc, n)
                grown = rss(gateway.proc.pid) - empty
                commands = {
                    "default": (),
                    "user": ("--user", "u007"),
                    "failed": ("--state", "failed", "--limit", "50"),
                }
                timed: dict[str, Any] = {}
                for name, args in commands.items():
                    got = [run_status(server.url, *args) for _ in range(runs)]
                    timed[name] = {
                        "first_row_ms": figures([g[0] for g in got]),
                        "exit_ms": figures([g[1] for g in got]),
                        "exit_codes": sorted({g[2] for g in got}),
                        "rows": got[-1][3] - 1,
                    }
                _, all_s, all_code, pages = run_status(server.url, "--all", "--json")
            finally:
                gateway.stop()
            # A fresh gateway reading the whole bucket, as after a restart.
            fresh = Gateway(server.url, workdir, "gateway-fresh")
            try:
                sync_s = await caught_up(nc, n)
                await asyncio.sleep(1)
                cold = rss(fresh.proc.pid) - empty
            finally:
                fresh.stop()
        finally:
            await nc.close()
    return {
        "jobs": n,
        "live": sum(1 for i in range(n) if i % live_every == 0),
        "wire_bytes_per_job": round(sum(map(len, data)) / n),
        "held_bytes_per_job": round(held_per_job(data)),
        "rss_growth_bytes_per_job": round(grown / n),
        "fresh_rss_bytes_per_job": round(cold / n),
        "fresh_sync_s": round(sync_s, 2),
        "status": timed,
        "all_json": {"pages": pages, "s": round(all_s, 2), "exit_code": all_code},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default="10000,100000", help="retained jobs, comma-separated sizes")
    p.add_argument("--runs", type=int, default=3, help="runs of each `muster status`")
    p.add_argument("--live-every", type=int, default=100, help="one job in this many is live")
    p.add_argument("--command-bytes", type=int, default=200, help="each job's command")
    p.add_argument("--workdir", type=Path, default=None, help="keep logs and data here (default: a temp dir)")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="muster-listing-") as tmp:
        root = args.workdir or Path(tmp)
        for n in (int(s) for s in args.jobs.split(",") if s.strip()):
            (root / f"n{n}").mkdir(parents=True, exist_ok=True)
            rows.append(
                asyncio.run(measure(n, args.runs, args.live_every, args.command_bytes, root / f"n{n}"))
            )
    print("muster status over N retained jobs (first job row / exit, ms p50; exit codes)")
    print(
        f"{'jobs':>8} {'wire B':>7} {'held B':>7} {'RSS B':>6} {'fresh B':>7} {'sync s':>6}"
        f"  {'status':>15}  {'--user':>15}  {'--state failed':>15}  {'--all pages':>11} {'s':>6}"
    )
    for r in rows:
        cells = []
        for name in ("default", "user", "failed"):
            t = r["status"][name]
            cells.append(
                f"{t['first_row_ms']['p50']:>6.0f}/{t['exit_ms']['p50']:<5.0f}{t['exit_codes']!s:>4}"
            )
        print(
            f"{r['jobs']:>8} {r['wire_bytes_per_job']:>7} {r['held_bytes_per_job']:>7} "
            f"{r['rss_growth_bytes_per_job']:>6} {r['fresh_rss_bytes_per_job']:>7} {r['fresh_sync_s']:>6}  "
            + "  ".join(f"{c:>15}" for c in cells)
            + f"  {r['all_json']['pages']:>11} {r['all_json']['s']:>6}"
        )
    print(json.dumps({"bench": "listing", "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
