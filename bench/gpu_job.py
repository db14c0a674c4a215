"""Real jobs through `muster up` on a machine with an NVIDIA GPU: the shipped GPU examples, end to end.

    python3 -m bench.gpu_job [--modes mps,timeslice] [--timeout 300]

Run from the repository root, as root or the GPU's user; needs python3 with CUDA PyTorch on PATH
(the process runtime runs tasks with it), the NVIDIA driver (nvidia-cuda-mps-control for mps) and
Muster's own dependencies. No Docker. For each sharing mode it starts `muster up --runtime process
--gpu-sharing MODE` (its own NATS, every service, a local agent that finds the GPUs through NVML)
on a scratch data dir, and with the CLI:

  gpu:     submits examples/gpu/job.json (one whole GPU, a CUDA matmul; its gpuType set to the
           model the agent found) and waits: SUCCEEDED, `matmul ok True` in its logs;
  sharing: submits examples/gpu-sharing/job.json as shipped (two tasks of 0.5 of a GPU, side by
           side) and waits: SUCCEEDED, both tasks on one device (one UUID) in this mode, and past
           the share "the limit holds" under MPS, "not isolated" time-sliced;
  allreduce: two ranks of 0.5 of a GPU meet through MASTER_ADDR/RANK/WORLD_SIZE and all-reduce a
           CUDA tensor over gloo: SUCCEEDED, both print `sum 3.0 on cuda`;
  limit:   (mps) a task of the smallest share whose memory limit is at least 4 GiB allocates 3 GiB
           and then fails to allocate 6 GiB (CUDA out of memory): SUCCEEDED.

Prints each job's log, then one JSON line; exits 1 if a check failed, 0 if all passed or there
is no NVIDIA GPU ("no NVIDIA GPU: skipped")."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from muster.services.agent.gpushare import mps_available
from muster.services.agent.inventory import discover_gpus
from muster.shared.loader import loads

ROOT = Path(__file__).resolve().parent.parent

LIMIT = (
    "python3 -c \"import os, torch; held = torch.empty(3 << 30, dtype=torch.uint8, device='cuda'); "
    "print('3 GiB allocated under', os.environ.get('CUDA_MPS_PINNED_DEVICE_MEM_LIMIT'), flush=True)\n"
    "try:\n    torch.empty(6 << 30, dtype=torch.uint8, device='cuda'); print('6 GiB allocated: the limit "
    "did not hold'); raise SystemExit(3)\nexcept torch.OutOfMemoryError:\n    print('6 GiB: out of "
    "memory, the limit holds')\""
)

ALLREDUCE = (
    "python3 -c \"import os, torch, torch.distributed as dist; dist.init_process_group('gloo'); "
    "r = dist.get_rank(); x = torch.full((4,), float(r + 1), device='cuda'); dist.all_reduce(x); "
    "print('rank', r, 'of', dist.get_world_size(), 'master', os.environ['MASTER_ADDR'], 'sum', "
    "x[0].item(), 'on', x.device.type, torch.cuda.get_device_properties(0).uuid, flush=True); "
    'dist.destroy_process_group()"'
)


def cli(env: dict[str, str], *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "muster.services.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def example(name: str) -> dict[str, Any]:
    return loads((ROOT / "examples" / name / "job.json").read_text())


def submit(env: dict[str, str], config: dict[str, Any], work: Path, timeout: float) -> dict[str, Any]:
    """Submit, wait for the end, and return what it printed and the job's logs."""
    path = work / f"{config['jobName']}.json"
    path.write_text(json.dumps(config))
    t0 = time.monotonic()
    done = cli(env, "submit", str(path), "--wait", "--timeout", str(timeout), timeout=timeout + 30)
    logs = cli(env, "logs", config["jobName"], timeout=60)
    out = {
        "job": config["jobName"],
        "exit_code": done.returncode,
        "seconds": round(time.monotonic() - t0, 1),
        "submit": (done.stdout + done.stderr).strip()[-1500:],
        "logs": logs.stdout[-4000:] + logs.stderr[-1000:],
    }
    print(f"--- {config['jobName']}: exit {done.returncode} in {out['seconds']} s")
    print(out["submit"], out["logs"], sep="\n")
    return out


def run_mode(mode: str, model: str, memory_mb: int, timeout: float) -> tuple[dict[str, Any], dict[str, bool]]:
    work = Path(tempfile.mkdtemp(prefix=f"muster-gpu-job-{mode}-"))
    env = {**os.environ, "MUSTER_DATA_DIR": str(work / "data")}
    flags = ["--runtime", "process", "--gpu-sharing", mode, "--cpus", "8", "--portal-port", "0"]
    with open(work / "up.log", "w") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "muster.services.cli.main", "up", *flags, "--metrics-port", "0"],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    report: dict[str, Any] = {}
    checks: dict[str, bool] = {}
    try:
        gpu = example("gpu")
        gpu["gpuType"] = model
        r = report["gpu"] = submit(env, gpu, work, timeout)
        checks[f"{mode}_gpu_job"] = r["exit_code"] == 0 and "matmul ok True" in r["logs"]

        r = report["sharing"] = submit(env, example("gpu-sharing"), work, timeout)
        uuids = set(re.findall(r"device (\S+)", r["logs"]))
        said = "the limit holds" if mode == "mps" else "allocated, not isolated"
        checks[f"{mode}_sharing_job"] = (
            r["exit_code"] == 0
            and r["logs"].count(f"sharing {mode}") == 2
            and len(uuids) == 1
            and r["logs"].count(said) == 2
        )
        report["sharing"]["uuids"] = sorted(uuids)

        # A distributed job on the shared GPU: two ranks of half a GPU each meet through the
        # environment Muster gives them (MASTER_ADDR, RANK, WORLD_SIZE) and all-reduce a CUDA
        # tensor over gloo (NCCL refuses two ranks on one device).
        ddp = {
            "jobName": "gpu-allreduce",
            "image": "local",
            "taskRoles": [
                {"name": "worker", "taskNumber": 2, "cpuNumber": 1, "memoryMB": 4096}
                | {"gpuNumber": 0.5, "command": ALLREDUCE}
            ],
        }
        r = report["allreduce"] = submit(env, ddp, work, timeout)
        checks[f"{mode}_allreduce_job"] = r["exit_code"] == 0 and r["logs"].count("sum 3.0 on cuda") == 2

        if mode == "mps":
            share = math.ceil(4096 / memory_mb * 100) / 100  # the smallest share of at least 4 GiB
            limit = {
                "jobName": "gpu-limit",
                "image": "local",
                "taskRoles": [
                    {"name": "main", "taskNumber": 1, "cpuNumber": 1, "memoryMB": 4096}
                    | {"gpuNumber": share, "command": LIMIT}
                ],
            }
            r = report["limit"] = submit(env, limit, work, timeout)
            report["limit"]["share"] = share
            checks["mps_limit_job"] = r["exit_code"] == 0 and "out of memory, the limit holds" in r["logs"]
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
        report["up_log_tail"] = (work / "up.log").read_text()[-1500:]
    return report, checks


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="mps,timeslice", help="sharing modes to run, comma-separated")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each job may take")
    args = p.parse_args()
    gpus = discover_gpus()
    if not gpus:
        print("no NVIDIA GPU: skipped")
        print(json.dumps({"bench": "gpu_job", "skipped": "no NVIDIA GPU"}))
        return 0
    summary: dict[str, Any] = {"bench": "gpu_job", "gpu": gpus[0].model_dump(), "checks": {}}
    for mode in args.modes.split(","):
        if mode == "mps" and (why := mps_available()) is not None:
            summary["checks"]["mps_available"] = False
            summary["mps"] = why
            continue
        report, checks = run_mode(mode, gpus[0].model, gpus[0].memory_mb, args.timeout)
        summary[mode] = report
        summary["checks"].update(checks)
    summary["failed"] = [name for name, ok in summary["checks"].items() if not ok]
    print(json.dumps(summary))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
