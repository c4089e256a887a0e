"""Resumable data-parallel digits training: survives killed ranks with ``plait run --restarts``.

Run::

    plait run -np 2 --restarts 3 -- python examples/resumable_digits.py --ckpt /tmp/digits-ckpt

Kill any rank (``kill -9``) while it trains: ``plait run`` relaunches the job, which
resumes from the latest complete checkpoint and ends with the same weights as an
uninterrupted run (the last line prints a digest of them to compare). Relaunched on
fewer hosts (elastic by restart), every rank re-shards the data by its new rank/size
and keeps the global batch (``PLAIT_ELASTIC_POLICY=keep_batch``) or its own batch
with a scaled learning rate (``scale_lr``).
"""

from __future__ import annotations

import argparse
import hashlib

import numpy as np
import torch
from sklearn.datasets import load_digits

import plait
from plait.checkpoint import Checkpoint  # also exported as plait.Checkpoint
from plait.elastic import plan, restart_count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", default="digits-ckpt", help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--base-size", type=int, default=None,
                        help="ranks the batch/LR were tuned for (default: this run's size)")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    comm = plait.init()
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    p = plan(args.batch, 0.05, comm.size, args.base_size or comm.size)
    opt = torch.optim.SGD(model.parameters(), lr=p.lr, momentum=0.9)
    ckpt = Checkpoint(args.ckpt, every=args.every, keep=3, comm=comm)
    start = ckpt.restore(model, opt)
    if comm.rank == 0:
        print(f"restart {restart_count()}: {comm.size} ranks, resuming at step {start}", flush=True)
    per_epoch = len(y) // p.global_batch
    loss = torch.zeros(())
    for step in range(start, args.steps):
        order = np.random.RandomState(step // per_epoch).permutation(len(y))
        batch = order[(step % per_epoch) * p.global_batch:][: p.global_batch]
        mine = torch.from_numpy(batch[comm.rank * p.local_batch:(comm.rank + 1) * p.local_batch])
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[mine]), y[mine])
        loss.backward()
        grads = comm.grouped_allreduce([q.grad for q in model.parameters()], "average", "grads")
        for q, g in zip(model.parameters(), grads, strict=True):
            q.grad = g
        opt.step()
        ckpt.step_done(step + 1, model, opt)
    if comm.rank == 0:
        digest = hashlib.sha256(b"".join(q.detach().numpy().tobytes() for q in model.parameters()))
        print(f"done: {args.steps} steps, last loss {loss.item():.4f}, "
              f"weights sha256 {digest.hexdigest()[:16]}", flush=True)


if __name__ == "__main__":
    main()
