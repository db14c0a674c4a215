"""Launch overhead: what Muster adds to starting a container, and what `muster submit` costs.

    python -m bench.launch [--rounds 20] [--image muster/base:bookworm]

A fresh mesh (`bench.cluster`: nats-server with authentication, each service its own process) with
one real agent on the Docker runtime. Then, interleaved round by round (the order swapped each
round, so drift in the machine's load falls on both alike):

  * muster: a single-task job of the image (`sleep 0.3`, 1 CPU) published to the submit subject as
    `muster submit` does; submit→running is from just before the publish to the job's `running`
    event (the agent started the container and reported it; the supervisor recorded it). The
    round waits for the job's `ended` event so the node is free for the next;
  * docker run: bare `docker run -d --network host IMAGE sleep 0.3` (the CLI returns once the
    container has started), timed from the call to its return, then the container is removed;
  * docker SDK: the same container created and started through the docker SDK, as the agent does
    it: the engine's own cost, without the CLI's process start-up.

Overhead = muster p50 - docker run p50. Beside it, `muster submit FILE` as a user runs it (a new
Python process: start-up, connect, publish, verdict), against `python -c pass`, the interpreter's
own start-up, the floor any Python CLI pays. Prints a table, then one JSON line.
Needs a Docker engine and the image (`deploy/build-base-image.sh` builds it)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import docker
from nats.aio.msg import Msg

from bench.bus import pct
from bench.cluster import BENCH_USER, Mesh
from muster.shared import subjects
from muster.shared.subjects import Headers

TASK_COMMAND = "sleep 0.3"


def job(name: str, image: str) -> dict[str, Any]:
    return {
        "jobName": name,
        "image": image,
        "taskRoles": [
            {
                "name": "task",
                "taskNumber": 1,
                "cpuNumber": 1,
                "memoryMB": 256,
                "gpuNumber": 0,
                "command": TASK_COMMAND,
            }
        ],
    }


def summary(values: list[float]) -> dict[str, float | None]:
    return {
        "p50": pct(values, 0.5),
        "p90": pct(values, 0.9),
        "max": pct(values, 1.0),
        "mean": round(statistics.fmean(values), 1) if values else None,
    }


class Events:
    """When each job's running and ended events arrived, by job name; why one was rejected."""

    def __init__(self) -> None:
        self.at: dict[tuple[str, str], float] = {}
        self.rejected: dict[str, str] = {}
        self.changed = asyncio.Event()

    async def on_verdict(self, msg: Msg) -> None:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            verdict = json.loads(msg.data)
            if not verdict["accepted"]:
                self.rejected[verdict.get("job_name") or "?"] = json.dumps(verdict.get("errors"))[:500]
                self.changed.set()

    async def on_event(self, msg: Msg) -> None:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            event = json.loads(msg.data)
            self.at.setdefault((event["job_name"], event["kind"]), time.perf_counter())
            self.changed.set()

    async def wait(self, name: str, kind: str, timeout: float) -> float:
        deadline = time.perf_counter() + timeout
        while (name, kind) not in self.at:
            if name in self.rejected or "?" in self.rejected:
                raise RuntimeError(f"job {name} rejected: {self.rejected.get(name, self.rejected.get('?'))}")
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError(f"job {name}: no {kind} event in {timeout:g}s")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)
        return self.at[(name, kind)]


def docker_run(image: str) -> float:
    """Seconds from calling `docker run -d` to its return (the container started); then removed."""
    start = time.perf_counter()
    proc = subprocess.run(
        ["docker", "run", "-d", "--network", "host", image, *TASK_COMMAND.split()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"docker run failed: {proc.stderr.strip()}")
    subprocess.run(["docker", "rm", "-f", proc.stdout.strip()], capture_output=True, timeout=60)
    return took


def docker_sdk_run(engine: Any, image: str) -> float:
    """Seconds for the engine alone to create and start the container (docker SDK, as Muster's
    agent calls it: no CLI process), then removed."""
    start = time.perf_counter()
    container = engine.containers.run(image, TASK_COMMAND.split(), detach=True, network_mode="host")
    took = time.perf_counter() - start
    container.remove(force=True)
    return took


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return took


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    cpus = os.cpu_count() or 1
    with Mesh(workdir, 1, gpus="", cpus=cpus, memory_mb=2048, docker=True) as mesh:
        ready_s = await mesh.wait_ready()
        nc = await mesh.connect()
        js = nc.jetstream(timeout=30)
        engine = docker.from_env()
        events = Events()
        for kind in ("running", "ended"):
            await nc.subscribe(subjects.job_event("*", kind), cb=events.on_event)
        await nc.subscribe(subjects.verdict(BENCH_USER, "*"), cb=events.on_verdict)

        async def muster_job(tag: str) -> float:
            name = f"launch-{tag}"
            sid = f"{name}-{uuid.uuid4().hex[:6]}"
            start = time.perf_counter()
            await js.publish(
                subjects.submit(BENCH_USER),
                json.dumps(job(name, args.image)).encode(),
                headers={Headers.SUBMISSION_ID: sid, Headers.MSG_ID: sid},
            )
            running = await events.wait(name, "running", 120)
            await events.wait(name, "ended", 120)
            mesh.check()
            return running - start

        try:
            await asyncio.to_thread(docker_run, args.image)  # warm-up: not counted
            await muster_job("warmup")
            launches: dict[str, list[float]] = {"muster": [], "docker_run": [], "docker_sdk": []}
            for i in range(args.rounds):
                order = list(launches) if i % 2 == 0 else list(reversed(launches))
                for what in order:
                    if what == "muster":
                        took = await muster_job(str(i))
                    elif what == "docker_run":
                        took = await asyncio.to_thread(docker_run, args.image)
                    else:
                        took = await asyncio.to_thread(docker_sdk_run, engine, args.image)
                    launches[what].append(took * 1000)

            # `muster submit` end to end, as a user types it, beside the interpreter's start-up.
            config = workdir / "submit-job.json"
            env = {
                **os.environ,
                "MUSTER_NATS_URL": mesh.url,
                "MUSTER_CREDENTIALS": str(mesh.keys.creds(BENCH_USER)),
            }
            # As on a user's machine, where an installed package has its bytecode: the first run
            # writes it (not counted) when this shell says not to.
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            cli: dict[str, list[float]] = {"muster_submit": [], "python_start": []}
            await asyncio.to_thread(timed, [sys.executable, "-m", "muster.services.cli.main", "--help"], env)
            for i in range(args.cli_rounds):
                config.write_text(json.dumps(job(f"cli-{i}", args.image)))
                cli["python_start"].append(
                    1000 * await asyncio.to_thread(timed, [sys.executable, "-c", "pass"], env)
                )
                argv = [sys.executable, "-m", "muster.services.cli.main", "submit", str(config)]
                cli["muster_submit"].append(1000 * await asyncio.to_thread(timed, argv, env))
                await events.wait(f"cli-{i}", "ended", 120)  # the node is free for the next
        finally:
            await nc.close()
            engine.close()
    muster, bare = summary(launches["muster"]), summary(launches["docker_run"])
    return {
        "rounds": args.rounds,
        "image": args.image,
        "ready_s": round(ready_s, 1),
        "submit_to_running_ms": muster,
        "docker_run_ms": bare,
        "docker_sdk_ms": summary(launches["docker_sdk"]),
        "overhead_p50_ms": round(muster["p50"] - bare["p50"], 1) if muster["p50"] and bare["p50"] else None,
        "muster_submit_ms": summary(cli["muster_submit"]),
        "python_start_ms": summary(cli["python_start"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20, help="interleaved rounds of each launch")
    p.add_argument("--cli-rounds", type=int, default=10, help="`muster submit` runs timed")
    p.add_argument("--image", default=os.environ.get("MUSTER_BASE_IMAGE", "muster/base:bookworm"))
    p.add_argument("--workdir", type=Path, default=None, help="keep logs and data here (default: a temp dir)")
    args = p.parse_args(argv)
    probe = subprocess.run(["docker", "image", "inspect", args.image], capture_output=True)
    if probe.returncode != 0:
        print(f"bench.launch: no image {args.image} (deploy/build-base-image.sh builds it)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="muster-launch-") as tmp:
        report = asyncio.run(run(args, args.workdir or Path(tmp)))
    print(f"{report['rounds']} interleaved rounds, image {report['image']}; ms")
    print(f"{'':<34} {'p50':>7} {'p90':>7} {'max':>7} {'mean':>7}")
    rows = (
        ("muster: submit→running", report["submit_to_running_ms"]),
        ("bare docker run -d (floor)", report["docker_run_ms"]),
        ("docker SDK create+start (engine)", report["docker_sdk_ms"]),
        ("muster submit FILE (new process)", report["muster_submit_ms"]),
        ("python -c pass (floor)", report["python_start_ms"]),
    )
    for label, s in rows:
        print(f"{label:<34} {s['p50']:>7} {s['p90']:>7} {s['max']:>7} {s['mean']:>7}")
    print(f"overhead over bare docker run at p50: {report['overhead_p50_ms']} ms")
    print(json.dumps({"bench": "launch", **report}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
