"""A Philly-shaped workload for `bench.replay`, seeded: a `submit_time,duration,gpus` CSV.

    python -m bench.replay_workload --jobs N [--seed S] [--load L] [--gpus 64] [--out F]
    python -m bench.replay --trace F --nodes 8 --policies all

The shape of Microsoft's Philly trace (Jeon et al., "Analysis of large-scale multi-tenant GPU
clusters for DNN training workloads", ATC'19), not its numbers: most jobs take one GPU, some 2, 4
or 8 (one server), a few 16 or more spanning servers (the replay runs those as gangs of whole
8-GPU nodes); run times from minutes to days, heavy-tailed (log-normal: median 30 minutes, σ 2,
cut to 1 minute .. 14 days, so the mean is some hours and the longest days); arrivals a Poisson
process whose mean GPU demand is `--load` times the cluster's GPUs (`--gpus`), so with the default
1.2 jobs arrive faster than they complete and the queue grows. Job size and run time are drawn
independently. Every draw comes from `random.Random(seed)`: the same arguments write the same file.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path
from typing import TextIO

GPUS = (1, 2, 4, 8, 16, 32)
GPU_WEIGHTS = (0.70, 0.10, 0.09, 0.07, 0.03, 0.01)
MEDIAN_S = 1800.0
SIGMA = 2.0
MIN_S, MAX_S = 60.0, 14 * 86400.0


def mean_gpu_seconds() -> float:
    """Expected GPUs × run time of one job (the log-normal's mean; the cut changes it little)."""
    gpus = sum(g * w for g, w in zip(GPUS, GPU_WEIGHTS, strict=True)) / sum(GPU_WEIGHTS)
    return gpus * MEDIAN_S * math.exp(SIGMA**2 / 2)


def philly_like(
    jobs: int, seed: int = 0, load: float = 1.2, cluster_gpus: int = 64
) -> list[tuple[float, float, int]]:
    """`jobs` rows of (submit_time, duration, gpus), by submit time."""
    if jobs < 1 or load <= 0 or cluster_gpus < 1:
        raise ValueError("jobs and cluster GPUs must be ≥ 1 and load > 0")
    rng = random.Random(seed)
    rate = load * cluster_gpus / mean_gpu_seconds()  # jobs per second
    now = 0.0
    rows: list[tuple[float, float, int]] = []
    for _ in range(jobs):
        gpus = rng.choices(GPUS, GPU_WEIGHTS)[0]
        duration = min(MAX_S, max(MIN_S, rng.lognormvariate(math.log(MEDIAN_S), SIGMA)))
        rows.append((round(now), round(duration), gpus))
        now += rng.expovariate(rate)
    return rows


def write(out: TextIO, rows: list[tuple[float, float, int]]) -> None:
    out.write("submit_time,duration,gpus\n")
    out.writelines(f"{t:.0f},{d:.0f},{g}\n" for t, d, g in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.replay_workload", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load", type=float, default=1.2, help="offered GPU demand / cluster GPUs")
    p.add_argument("--gpus", type=int, default=64, help="the cluster's GPUs (8 nodes × 8)")
    p.add_argument("--out", type=Path, default=None, help="the CSV to write (default: stdout)")
    args = p.parse_args(argv)
    try:
        rows = philly_like(args.jobs, args.seed, args.load, args.gpus)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if args.out is None:
        write(sys.stdout, rows)
    else:
        with args.out.open("w") as f:
            write(f, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
