"""A check on a machine with an NVIDIA GPU: the agent's GPU sharing against the real driver.

    python3 -m bench.gpu_check [--gib 2] [--limit-mib 4096] [--timeout 180]

Run from the repository root, as root or the GPU's user; needs python3 with torch (CUDA), the
NVIDIA driver with nvidia-cuda-mps-control, and Muster's own dependencies (pydantic, structlog,
nvidia-ml-py). No NATS, no Docker. Each task is a plain process started with the environment the
agent's code builds for it (services/agent/gpushare.py, which the agent's environment renders),
on GPU 0:

  a. what the agent's NVML discovery (inventory.discover_gpus) reports;
  b. the agent's MPS daemon for GPU 0, started through its own code (MpsDaemons, the real
     nvidia-cuda-mps-control), under a scratch work root;
  c. MPS: two tasks with 0.5 of GPU 0 each allocate --gib GiB and hold it until both have: both
     must see the same device (UUID) at once; the MPS server must be listed by the daemon;
  d. MPS: a task whose pinned device memory limit is --limit-mib (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT
     set directly; a share gives share × the device's memory) cannot allocate 1.5× that (CUDA out
     of memory), and one allocating 0.75× that succeeds;
  r. a restarted agent (a new MpsDaemons over the same work root) finds the daemon left running
     and tells it to quit (sweep);
  e. time-slicing: (c) again with the time-slicing environment, no daemon.

Prints each step, then one JSON line; exits 1 if any check failed, 0 if all passed or there is
no NVIDIA GPU ("no NVIDIA GPU: skipped")."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from muster.services.agent.gpushare import MPS_CONTROL, MpsDaemons, NvidiaMps, mps_available, share_env
from muster.services.agent.inventory import discover_gpus
from muster.shared.messages import GpuSharing

# One task: allocate GiB on its (only) device, say which device and process, and hold the memory
# until `peers` tasks have allocated theirs (a directory of marks), bounded.
TASK = r"""
import json, os, sys, time
gib, marks, me = float(sys.argv[1]), sys.argv[2], sys.argv[3]
peers, hold = int(sys.argv[4]), float(sys.argv[5])
out = {"task": me, "pid": os.getpid(), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
    if k in os.environ:
        out[k] = os.environ[k]
try:
    import torch
    props = torch.cuda.get_device_properties(0)
    out["device"] = props.name
    out["uuid"] = str(getattr(props, "uuid", ""))
    x = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
    x.fill_(1)
    torch.cuda.synchronize()
    out["allocated_gib"] = gib
    if marks:
        open(os.path.join(marks, me), "w").close()
        deadline = time.time() + hold
        while len(os.listdir(marks)) < peers and time.time() < deadline:
            time.sleep(0.05)
        out["peers_holding"] = len(os.listdir(marks))
    out["ok"] = True
except Exception as exc:
    out["ok"] = False
    out["error"] = (type(exc).__name__ + ": " + str(exc))[:400]
print(json.dumps(out), flush=True)
sys.exit(0 if out["ok"] else 1)
"""


def base_env() -> dict[str, str]:
    """The check's own environment without any GPU or MPS variable (each task gets its own)."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CUDA_VISIBLE", "NVIDIA_VISIBLE", "CUDA_MPS_", "MUSTER_GPU_"))
    }


async def run_tasks(
    envs: list[dict[str, str]], gib: float, timeout: float, together: bool
) -> list[dict[str, Any]]:
    """Start one task per env at once; their JSON reports (or what went wrong)."""
    marks = tempfile.mkdtemp(prefix="muster-gpu-marks-") if together else ""
    procs = []
    for i, env in enumerate(envs):
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                TASK,
                str(gib),
                marks,
                f"t{i}",
                str(len(envs)),
                str(timeout / 2),
                env={**base_env(), **env},
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        )
    reports = []
    for i, proc in enumerate(procs):
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            reports.append({"task": f"t{i}", "ok": False, "error": f"did not end within {timeout:g} s"})
            continue
        lines = [line for line in out.decode(errors="replace").splitlines() if line.startswith("{")]
        report = json.loads(lines[-1]) if lines else {"task": f"t{i}", "ok": False}
        report["exit_code"] = proc.returncode
        if not lines:
            report["error"] = err.decode(errors="replace")[-400:]
        reports.append(report)
    if marks:
        shutil.rmtree(marks, ignore_errors=True)
    return reports


def same_device_at_once(reports: list[dict[str, Any]]) -> bool:
    return (
        len(reports) == 2
        and all(r.get("ok") for r in reports)
        and len({r.get("uuid") for r in reports}) == 1
        and all(r.get("peers_holding", 0) >= 2 for r in reports)
    )


def control(pipe: Path, command: str) -> str:
    """What the daemon of `pipe` answers to `command`."""
    done = subprocess.run(
        [MPS_CONTROL],
        input=command + "\n",
        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)},
        capture_output=True,
        text=True,
        timeout=10,
    )
    return (done.stdout + done.stderr).strip()


async def check(args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {"bench": "gpu_check", "checks": {}}
    checks: dict[str, bool] = summary["checks"]
    gpus = discover_gpus()
    print("a. NVML discovery:", [g.model_dump() for g in gpus] if gpus else gpus)
    if not gpus:
        summary["skipped"] = "no NVIDIA GPU"
        print("no NVIDIA GPU: skipped")
        return summary
    gpu = gpus[0]
    summary["gpu"] = gpu.model_dump()
    checks["a_discovery"] = gpu.memory_mb > 0 and bool(gpu.model)
    why = mps_available()
    if why is not None:
        summary["mps"] = why
        checks["b_mps_daemon"] = False
        print("b. MPS:", why)
    else:
        work = tempfile.mkdtemp(prefix="muster-gpu-check-")
        daemons = MpsDaemons(work, NvidiaMps())
        t0 = time.monotonic()
        pipe = await daemons.acquire(0, "t0")
        await daemons.acquire(0, "t1")
        running = await daemons.control.running(pipe)
        print(f"b. MPS daemon of GPU 0 at {pipe}: running={running} ({time.monotonic() - t0:.1f} s)")
        checks["b_mps_daemon"] = running

        envs = [share_env([0], 500, GpuSharing.MPS, str(pipe), gpu.memory_mb) for _ in range(2)]
        reports = await run_tasks(envs, args.gib, args.timeout, together=True)
        servers = control(pipe, "get_server_list")
        for r in reports:
            print("c. MPS task:", json.dumps(r))
        print("c. MPS servers listed by the daemon:", servers or "(none)")
        summary["c_mps"] = {"tasks": reports, "servers": servers}
        checks["c_mps_same_device_at_once"] = same_device_at_once(reports)
        checks["c_mps_server_listed"] = bool(servers.strip()) and servers.strip().split()[0].isdigit()

        limit = args.limit_mib
        env = share_env([0], 500, GpuSharing.MPS, str(pipe), gpu.memory_mb)
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={limit}M"
        over, under = 1.5 * limit / 1024, 0.75 * limit / 1024
        (refused,) = await run_tasks([env], over, args.timeout, together=False)
        (allowed,) = await run_tasks([env], under, args.timeout, together=False)
        print(f"d. limit {limit} MiB, {over:g} GiB:", json.dumps(refused))
        print(f"d. limit {limit} MiB, {under:g} GiB:", json.dumps(allowed))
        summary["d_limit"] = {"limit_mib": limit, "over": refused, "under": allowed}
        checks["d_over_limit_is_out_of_memory"] = (
            not refused.get("ok") and "out of memory" in str(refused.get("error", "")).lower()
        )
        checks["d_under_limit_succeeds"] = bool(allowed.get("ok"))

        # An agent restart: a new MpsDaemons finds the daemon its predecessor left, and quits it.
        again = MpsDaemons(work, NvidiaMps())
        swept = await again.sweep()
        still = await again.control.running(pipe)
        print(f"r. restarted agent swept GPUs {swept}; daemon running after: {still}")
        checks["r_left_daemon_quit"] = swept == [0] and not still
        await daemons.close()
        shutil.rmtree(work, ignore_errors=True)

    envs = [share_env([0], 500, GpuSharing.TIMESLICE) for _ in range(2)]
    reports = await run_tasks(envs, args.gib, args.timeout, together=True)
    for r in reports:
        print("e. time-sliced task:", json.dumps(r))
    summary["e_timeslice"] = {"tasks": reports}
    checks["e_timeslice_same_device_at_once"] = same_device_at_once(reports)
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="GiB each of the two sharing tasks allocates")
    p.add_argument("--limit-mib", type=int, default=4096, help="the pinned memory limit of check d")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds a task may take")
    args = p.parse_args()
    summary = asyncio.run(check(args))
    failed = [name for name, ok in summary["checks"].items() if not ok]
    summary["failed"] = failed
    print(json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
