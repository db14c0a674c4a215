"""A real PyTorch gang: every rank joins the process group through the environment Muster sets
(MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK: init_method="env://"), all-reduces a tensor over gloo
and checks the sum. Run by examples/pytorch-allreduce/job.json."""

import os
import sys

try:
    import torch
    import torch.distributed as dist
except ImportError as exc:
    sys.exit(
        f"pytorch-allreduce needs torch ({exc}): in Docker, run it in the image its job.json names, "
        "muster/torch:bookworm (build it with deploy/build-torch-image.sh); on the process runtime, "
        f"install torch for {sys.executable} (pip install torch) or put a python3 that has it first "
        "on the agent's PATH"
    )


def main() -> None:
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
    tensor = torch.full((4,), float(rank + 1))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    expected = world * (world + 1) / 2
    if not torch.equal(tensor, torch.full((4,), expected)):
        sys.exit(f"rank {rank}: all_reduce gave {tensor.tolist()}, expected {expected}")
    print(f"rank {rank}/{world}: all_reduce sum {tensor[0].item():g} ok (master {os.environ['MASTER_ADDR']})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
