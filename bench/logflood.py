"""One task printing as fast as it can: what reaches MUSTER_LOGS, how soon `muster logs` shows
its first line, and what the gateway costs meanwhile.

    python -m bench.logflood [--mb 100] [--line-bytes 100] [--limits default,none] [--read-timeout 120]

For each setting of the agent's output limits (`default`: MUSTER_TASK_LOG_* unset; `none`: all
0, everything shipped; or `RATE/BURST/TOTAL`, e.g. `64KiB/4MiB/64MiB`): a fresh mesh
(`bench.cluster`, authenticated, every service its own process) with one real agent on the
process runtime, and one job whose task prints `--mb` MB of `--line-bytes` lines as fast as
Python writes them. Measured:

- the task's run (seconds from its job running to its job ended) and the agent's CPU seconds;
- what the stream holds for it (bytes, messages) against the limit, and the task's whole output
  in its file on the node (bytes);
- `muster logs JOB` as a process, started as soon as the job runs and again once it has ended:
  seconds to its first line, to its exit (or `--read-timeout`), lines printed;
- the gateway's RSS before, and its peak while all of that runs (polled every 0.1 s).

Prints a table, then one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.cluster import BENCH_USER, Mesh, cpu_seconds
from bench.listing import rss
from muster.services.agent.output import ENV, OutputLimits, output_path, parse_size
from muster.shared import client, subjects

ROOT = Path(__file__).resolve().parents[1]


def limits_env(setting: str) -> dict[str, str]:
    if setting == "default":
        return {}
    if setting == "none":
        return {ENV["rate"]: "0", ENV["burst"]: "0", ENV["total"]: "0"}
    rate, burst, total = setting.split("/")
    for value in (rate, burst, total):
        parse_size(value)
    return {ENV["rate"]: rate, ENV["burst"]: burst, ENV["total"]: total}


def flood_command(mb: float, line_bytes: int) -> str:
    lines = int(mb * 1_000_000 / line_bytes)
    body = "z" * max(1, line_bytes - 9)
    code = f"import sys\nw=sys.stdout.write\nfor i in range({lines}): w(f'{{i:07d}} {body}\\n')"
    return f"{sys.executable} -c {shlex.quote(code)}"


class Peak:
    """The largest RSS of a process, polled in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.stopped = pid, rss(pid), threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stopped.wait(0.1):
            try:
                self.peak = max(self.peak, rss(self.pid))
            except OSError:
                return

    def stop(self) -> int:
        self.stopped.set()
        self.thread.join()
        return self.peak


def read_logs(env: dict[str, str], job_id: str, timeout: float) -> dict[str, Any]:
    """`muster logs JOB` as a process: seconds to its first line and to its end, lines."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "muster.services.cli.main", "logs", job_id],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    first, lines, done = None, 0, True
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for _ in proc.stdout:
            lines += 1
            if first is None:
                first = time.monotonic() - start
        code = proc.wait()
        done = code == 0
    finally:
        timer.cancel()
    took = time.monotonic() - start
    return {
        "first_line_s": round(first, 3) if first is not None else None,
        "s": round(took, 2),
        "lines": lines,
        "finished": done,
    }


async def measure(
    setting: str, mb: float, line_bytes: int, read_timeout: float, workdir: Path
) -> dict[str, Any]:
    env = limits_env(setting)
    limits = OutputLimits.from_env(env)
    with Mesh(workdir, 1, env=env, process=True, cpus=4, memory_mb=8192) as mesh:
        await mesh.wait_ready()
        cli_env = {
            **os.environ,
            "MUSTER_NATS_URL": mesh.url,
            "MUSTER_CREDENTIALS": str(mesh.keys.creds(BENCH_USER)),
            "PYTHONPATH": str(ROOT),
        }
        gateway, agent = mesh.procs["gateway"].pid, mesh.procs["agent"].pid
        await asyncio.sleep(1)
        before = rss(gateway)
        peak = Peak(gateway)
        nc = await mesh.connect()
        try:
            job = {
                "jobName": "flood",
                "image": "python:3.11",
                "taskRoles": [
                    {
                        "name": "main",
                        "taskNumber": 1,
                        "cpuNumber": 1,
                        "memoryMB": 512,
                        "gpuNumber": 0,
                        "command": flood_command(mb, line_bytes),
                    }
                ],
            }
            cpu0 = cpu_seconds(agent)
            _, verdict = await client.submit(nc, json.dumps(job).encode(), timeout=60)
            assert verdict is not None and verdict.accepted, verdict
            job_id = str(verdict.job_id)
            record: dict[str, Any] = {}
            while record.get("state") != "RUNNING":
                record = (await client.ask(nc, "job", {"ref": job_id}))["job"]
                if record["state"] in ("SUCCEEDED", "FAILED", "STOPPED"):
                    break
                await asyncio.sleep(0.05)
            running_at = time.monotonic()
            reading = asyncio.create_task(asyncio.to_thread(read_logs, cli_env, job_id, read_timeout))
            while record["state"] not in ("SUCCEEDED", "FAILED", "STOPPED"):
                mesh.check()
                await asyncio.sleep(0.05)
                record = (await client.ask(nc, "job", {"ref": job_id}))["job"]
            run_s = time.monotonic() - running_at
            agent_cpu = cpu_seconds(agent) - cpu0
            during = await reading
            info = await nc.jetstream().stream_info(subjects.LOGS_STREAM)
            after = await asyncio.to_thread(read_logs, cli_env, job_id, read_timeout)
            kept = output_path(str(mesh.scratch), job_id, 1, "main", 0)
            kept_bytes = kept.stat().st_size if kept.exists() else 0
        finally:
            await nc.close()
            top = peak.stop()
    return {
        "limits": setting,
        "rate": limits.rate,
        "burst": limits.burst,
        "total": limits.total,
        "printed_mb": mb,
        "state": record["state"],
        "run_s": round(run_s, 2),
        "agent_cpu_s": round(agent_cpu, 2),
        "stream_bytes": info.state.bytes,
        "stream_messages": info.state.messages,
        "file_bytes": kept_bytes,
        "logs_during": during,
        "logs_after": after,
        "gateway_rss_before_mb": round(before / 1e6, 1),
        "gateway_rss_growth_mb": round((top - before) / 1e6, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=100.0, help="MB the task prints")
    p.add_argument("--line-bytes", type=int, default=100, help="bytes a line, its newline included")
    p.add_argument(
        "--limits", default="default,none", help="comma-separated: default, none, or RATE/BURST/TOTAL"
    )
    p.add_argument("--read-timeout", type=float, default=120.0, help="seconds a `muster logs` may take")
    p.add_argument("--workdir", type=Path, default=None, help="keep logs and data here (default: a temp dir)")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="muster-logflood-") as tmp:
        root = args.workdir or Path(tmp)
        for setting in args.limits.split(","):
            work = root / setting.replace("/", "-")
            rows.append(asyncio.run(measure(setting, args.mb, args.line_bytes, args.read_timeout, work)))
    print(f"one task printing {args.mb:g} MB in {args.line_bytes}-byte lines")
    print(
        f"{'limits':>22} {'run s':>6} {'agent cpu':>9} {'stream MB':>9} {'msgs':>7} {'file MB':>8}"
        f"  {'logs during: 1st s / s / lines':>30}  {'after: 1st s / s / lines':>26}  {'gateway +MB':>11}"
    )
    for r in rows:
        d, a = r["logs_during"], r["logs_after"]
        print(
            f"{r['limits']:>22} {r['run_s']:>6} {r['agent_cpu_s']:>9} {r['stream_bytes'] / 1e6:>9.1f} "
            f"{r['stream_messages']:>7} {r['file_bytes'] / 1e6:>8.1f}  "
            f"{d['first_line_s']!s:>8} / {d['s']:>6} / {d['lines']:>8}{'' if d['finished'] else '+'}  "
            f"{a['first_line_s']!s:>8} / {a['s']:>6} / {a['lines']:>8}{'' if a['finished'] else '+'}  "
            f"{r['gateway_rss_growth_mb']:>11}"
        )
    print(json.dumps({"bench": "logflood", "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
