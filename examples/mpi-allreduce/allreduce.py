"""Every rank adds rank+1 with MPI_Allreduce; each says where it ran (its task, the task's GPUs and
address) and checks the sum."""

import os
import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
total = comm.allreduce(rank + 1, op=MPI.SUM)
where = f"{os.environ.get('MUSTER_TASK_ROLE')}.{os.environ.get('MUSTER_TASK_INDEX')}"
gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
if gpus:  # the task's own: each task's ranks run in that task
    where += f" (GPUs {gpus})"
host = os.environ.get("PAI_CURRENT_CONTAINER_IP")
print(f"rank {rank} of {size} in task {where} at {host}: sum = {total}", flush=True)
sys.exit(0 if total == size * (size + 1) // 2 else 1)
