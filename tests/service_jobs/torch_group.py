"""Service test job: check the torch contract, form a gloo group, allreduce, report progress.

Rank 0 saves a model and reports it as the artifact. Exits non-zero with a message on any mismatch.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist

from plait.progress import report

rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
per_worker = int(os.environ["LOCAL_WORLD_SIZE"])
if size != int(os.environ["PARALLEL_INSTANCES"]) * per_worker:
    sys.exit(f"WORLD_SIZE={size} but PARALLEL_INSTANCES={os.environ['PARALLEL_INSTANCES']} x {per_worker}")
if int(os.environ["LOCAL_RANK"]) != rank % per_worker or int(os.environ["GROUP_RANK"]) != rank // per_worker:
    sys.exit(f"bad LOCAL_RANK/GROUP_RANK for rank {rank}: {os.environ['LOCAL_RANK']}, "
             f"{os.environ['GROUP_RANK']}")
dist.init_process_group("gloo")
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
if t.item() != size * (size + 1) / 2:
    sys.exit(f"allreduce gave {t.item()}")
report(step=3, epoch=1, loss=0.25, accuracy=0.75)
if rank == 0:
    path = os.path.join(os.environ["PLAIT_OUTPUT_DIR"], "model.pt")
    torch.save({"w": t}, path)
    report(artifact=path)
print(f"torch rank {rank}/{size} group of {dist.get_world_size()} via "
      f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} sum={t.item():g} on {socket.gethostname()}",
      flush=True)
dist.destroy_process_group()
