"""Horovod-backend waits are bounded (run by tests/test_wait_bounded.py under horovodrun --gloo
and under mpirun).

Not a pytest file: each phase prints one line for the outer test to check.

1. Rank 0 starts an allreduce that rank 1 joins only 4 s later, with the agreement check
   off, so only the handle's ``wait()`` can notice: it must raise ``CollectiveTimeoutError``
   after the 1 s timeout, naming the collective (under mpirun also rank 1, which is not
   waiting in plait, and its host). Rank 1's late call then completes the abandoned op.
2. Rank 0 calls an allreduce rank 1 never joins and does not catch the timeout: the
   process must end by itself (under horovodrun --gloo status 3, as there is no MPI to
   abort with; under mpirun MPI_Abort) instead of hanging in Horovod's shutdown, and the
   launcher then ends rank 1 (asleep for 10 minutes).
"""

from __future__ import annotations

import time

import torch

import plait
from plait.errors import CollectiveTimeoutError

comm = plait.init("horovod", check=False, timeout=1.0)
x = torch.ones(1000)
if comm.rank == 0:
    handle = comm.allreduce_async(x, "sum", name="late")
    start = time.monotonic()
    try:
        handle.wait()
        print("phase 1: rank 0 waited for rank 1 (no timeout)", flush=True)
    except CollectiveTimeoutError as exc:
        print(f"phase 1: rank 0 timed out after {time.monotonic() - start:.1f}s: {exc}", flush=True)
else:
    time.sleep(4)
    comm.allreduce(x, "sum", name="late")
comm.check, comm.timeout = True, 60.0  # rank 1 arrives 3 s after rank 0 here
comm.barrier()
comm.timeout = 1.0
print(f"phase 2: rank {comm.rank} starts", flush=True)
if comm.rank == 0:
    comm.allreduce(x, "sum", name="never")  # uncaught: ends this process
else:
    time.sleep(600)
