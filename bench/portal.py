"""The web portal with a month of jobs: how long its pages take with N jobs retained.

    python -m bench.portal [--jobs 100000] [--runs 20]

A nats-server (open: the portal acts as an admin, every job listed), Muster's streams and
buckets, the gateway as its own process, N job records written to the jobs bucket in their
stored form (as bench.listing writes them: one in 100 live, 50 users, 4 virtual clusters), then
`muster ui` as its own process, signed in with its one-time link. Timed over HTTP, `--runs`
times each after one first request (which also opens the portal's bus connection):

- `GET /jobs`: the first page (50 jobs, counts per state), as a person opening the portal;
- `GET /jobs?state=FAILED&name=...`: a filtered page;
- `GET /jobs?cursor=...`: the page after;
- `GET /jobs/changes?changed=...`: what the page's script asks every 2 s (jobs changed since);
- `GET /jobs/JOB`: a job's page.

Prints a table, then one JSON line. The target (issue 26): the first page within 300 ms with
100,000 jobs retained."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from bench.listing import Gateway, caught_up, put_all, records
from muster.shared import bus, subjects
from muster.shared.natsserver import NatsServer, free_port


def timed(http: httpx.Client, path: str, runs: int, params: dict[str, str] | None = None) -> dict[str, Any]:
    first = time.monotonic()
    r = http.get(path, params=params)
    first_ms = (time.monotonic() - first) * 1000
    assert r.status_code == 200, (path, r.status_code, r.text[-300:])
    ms = []
    for _ in range(runs):
        start = time.monotonic()
        r = http.get(path, params=params)
        ms.append((time.monotonic() - start) * 1000)
        assert r.status_code == 200, (path, r.status_code)
    return {
        "first_ms": round(first_ms, 1),
        "p50_ms": round(statistics.median(ms), 1),
        "max_ms": round(max(ms), 1),
        "bytes": len(r.content),
    }


async def measure(n: int, runs: int, workdir: Path) -> dict[str, Any]:
    data = records(n, 100, 200)
    with NatsServer(workdir / "nats") as server:
        nc = await bus.connect("bench", server.url)
        try:
            _, buckets = await bus.ensure_jetstream(nc)
            gateway = Gateway(server.url, workdir, "gateway")
            try:
                await put_all(buckets[subjects.JOBS_BUCKET], data)
                await caught_up(nc, n)
                port = free_port()
                ui = subprocess.Popen(  # noqa: ASYNC220 (started once, before anything is timed)
                    [sys.executable, "-m", "muster.services.cli.main", "ui", "--port", str(port)],
                    env={**os.environ, "MUSTER_NATS_URL": server.url},
                    stdout=subprocess.PIPE,
                    stderr=open(workdir / "ui.log", "wb"),  # noqa: SIM115, ASYNC230
                    text=True,
                )
                try:
                    assert ui.stdout is not None
                    link = None
                    while link is None:
                        line = ui.stdout.readline()
                        if not line:
                            raise RuntimeError((workdir / "ui.log").read_text()[-2000:])
                        m = re.search(r"(http://\S+token=\S+)", line)
                        link = m[1] if m else None
                    result = await asyncio.to_thread(pages, link, runs)
                finally:
                    ui.terminate()
                    ui.wait(10)
            finally:
                gateway.stop()
        finally:
            await nc.close()
    return {"jobs": n, "runs": runs, **result}


def pages(link: str, runs: int) -> dict[str, Any]:
    base = link.split("/jobs")[0]
    with httpx.Client(base_url=base, timeout=60) as http:
        assert http.get(link.removeprefix(base)).status_code in (200, 303)
        first = http.get("/api/jobs", params={"limit": 50}).json()
        job = first["jobs"][len(first["jobs"]) // 2]["job_id"]
        since = (datetime.now(UTC) - timedelta(seconds=10)).isoformat()
        return {
            "total_listed": first.get("total"),
            "first_page": timed(http, "/jobs", runs),
            "filtered": timed(http, "/jobs?state=FAILED&name=7", runs),
            "next_page": timed(http, "/jobs", runs, {"cursor": first["next"]}),
            "changes": timed(http, "/jobs/changes", runs, {"changed": since}),
            "job_page": timed(http, f"/jobs/{job}", runs),
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default="100000", help="retained jobs, comma-separated sizes")
    p.add_argument("--runs", type=int, default=20, help="timed requests of each page")
    args = p.parse_args(argv)
    out = []
    with tempfile.TemporaryDirectory(prefix="bench-portal-") as tmp:
        for n in (int(x) for x in args.jobs.split(",")):
            got = asyncio.run(measure(n, args.runs, Path(tmp) / str(n)))
            out.append(got)
            print(f"{n} jobs retained (listed {got['total_listed']}), {args.runs} runs each:")
            for name in ("first_page", "filtered", "next_page", "changes", "job_page"):
                f = got[name]
                print(
                    f"  {name:<11} first {f['first_ms']:7.1f} ms   p50 {f['p50_ms']:7.1f} ms   "
                    f"max {f['max_ms']:7.1f} ms   {f['bytes']:>7} bytes"
                )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
