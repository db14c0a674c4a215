"""Idle cost: CPU of each service while N simulated nodes beat and nothing else happens.

    python -m bench.idle [--nodes 1000,10000] [--settle 15] [--window 60]

For each size: a fresh mesh (`bench.cluster`: nats-server with authentication, each service its
own process, one process of N sim nodes, each beating every 2 s as a real agent does), wait until
every node is registered, let it settle (`--settle` seconds: start-up work done), then CPU per
process over `--window` seconds, as a percentage of one core. What the nodes really sent in that
window is counted on the bus and printed beside it: beats a second (and so the period per node
achieved) and node-record writes a second. The window defaults to a whole refresh period
(MUSTER_NODE_REFRESH, 60 s: each node rewrites its record once in it, at a random point of its
first period), so both costs are counted at their real average rates. The sim process and
nats-server are the load and the floor beside the services: a service can cost no less than
reading what they send. Prints a table, then one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cluster import Mesh
from muster.services.agent.service import REFRESH
from muster.shared import subjects


async def measure(nodes: int, settle: float, window: float, workdir: Path) -> dict[str, Any]:
    with Mesh(workdir, nodes) as mesh:
        ready_s = await mesh.wait_ready()
        await asyncio.sleep(settle)
        mesh.check()
        nc = await mesh.connect()
        try:
            beats = 0

            async def heard(_: Any) -> None:
                nonlocal beats
                beats += 1

            await nc.subscribe(subjects.beat("*"), cb=heard, pending_msgs_limit=1_000_000)
            await nc.flush()
            js = nc.jetstream()
            stream = f"KV_{subjects.NODES_BUCKET}"
            writes0 = (await js.stream_info(stream)).state.last_seq
            before, t0, beats = mesh.cpu(), time.monotonic(), 0
            await asyncio.sleep(window)
            mesh.check()
            after, elapsed, heard_n = mesh.cpu(), time.monotonic() - t0, beats
            writes = (await js.stream_info(stream)).state.last_seq - writes0
        finally:
            await nc.close()
        percent = {name: round(100 * (after[name] - before[name]) / elapsed, 2) for name in after}
        per_s = heard_n / elapsed
        return {
            "nodes": nodes,
            "ready_s": round(ready_s, 1),
            "window_s": round(elapsed, 1),
            "beats_per_s": round(per_s, 1),
            "period_per_node_s": round(nodes / per_s, 2) if per_s else None,
            "node_writes_per_s": round(writes / elapsed, 2),
            "cpu_percent": percent,
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="1000,10000", help="comma-separated sizes")
    p.add_argument("--settle", type=float, default=15.0, help="seconds after registration before measuring")
    p.add_argument("--window", type=float, default=REFRESH, help="seconds measured (default: one refresh)")
    p.add_argument("--workdir", type=Path, default=None, help="keep logs and data here (default: a temp dir)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.nodes.split(",") if s.strip()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="muster-idle-") as tmp:
        root = args.workdir or Path(tmp)
        for n in sizes:
            rows.append(asyncio.run(measure(n, args.settle, args.window, root / f"n{n}")))
    names = list(rows[0]["cpu_percent"]) if rows else []
    print("CPU, % of one core, idle (nodes registered, no jobs)")
    print(f"{'process':>12} " + " ".join(f"{r['nodes']:>8} nodes" for r in rows))
    for key, label in (
        ("beats_per_s", "beats/s"),
        ("period_per_node_s", "period s"),
        ("node_writes_per_s", "KV w/s"),
    ):
        print(f"{label:>12} " + " ".join(f"{r[key]!s:>14}" for r in rows))
    for name in names:
        print(f"{name:>12} " + " ".join(f"{r['cpu_percent'].get(name, 0):>13.1f}%" for r in rows))
    print(json.dumps({"bench": "idle", "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
