"""Service test job: a plait script over MPI (framework 'mpi' or 'horovod'): check the world, allreduce.

Rank 0 reports progress; every rank prints its place. Exits non-zero with a message on any mismatch.
"""

import os
import socket
import sys

import numpy as np

import plait
from plait.progress import report

comm = plait.init()
per_worker = int(os.environ["PLAIT_SVC_PER_WORKER"])
if comm.size != int(os.environ["PARALLEL_INSTANCES"]) * per_worker:
    sys.exit(f"size {comm.size} != PARALLEL_INSTANCES={os.environ['PARALLEL_INSTANCES']} x {per_worker}")
out = comm.allreduce(np.array([comm.rank + 1.0]), op="sum", name="svc")
if float(np.asarray(out)[0]) != comm.size * (comm.size + 1) / 2:
    sys.exit(f"allreduce gave {out}")
report(step=2, loss=0.5)
total = float(np.asarray(out)[0])
print(f"plait rank {comm.rank}/{comm.size} backend {comm.backend} sum={total:g} on {socket.gethostname()}",
      flush=True)
plait.shutdown()
