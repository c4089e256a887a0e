"""Asynchronous data parallelism on the digits data set (torch).

    mpirun -np 3 python examples/async_digits.py --algorithm parameter_server
    mpirun -np 2 python examples/async_digits.py --algorithm local_sgd --period 8

Every rank trains on its own slice; the parameter server's rank 0 serves instead.
``synchronize()`` at the end leaves one model on every rank before evaluation.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from sklearn.datasets import load_digits

import plait


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="local_sgd",
                   choices=["parameter_server", "ssp", "local_sgd", "delayed", "gossip"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--period", type=int, default=4, help="local_sgd: steps between averages")
    p.add_argument("--staleness", type=int, default=2, help="ssp: the bound s")
    args = p.parse_args()
    options = {"local_sgd": {"period": args.period}, "ssp": {"staleness": args.staleness}}
    dp = plait.DataParallel("mpi", mode="async", algorithm=args.algorithm,
                            **options.get(args.algorithm, {}))
    comm = dp.comm
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[order])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
    opt = dp.optimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5))
    if opt.is_server:
        opt.serve()
    else:
        loss_fn = torch.nn.CrossEntropyLoss()
        for step in range(args.steps):
            start = (step * 48 + comm.rank * 16) % (1500 - 16)
            loss_fn(model(x[start : start + 16]), y[start : start + 16]).backward()
            opt.step()
            opt.zero_grad()
    opt.synchronize()
    metrics = opt.gather_metrics()
    with torch.no_grad():
        acc = float((model(x[1500:]).argmax(1) == y[1500:]).float().mean()) * 100
    if comm.rank == 0:
        for m in metrics:
            print(m)
        print(f"{args.algorithm}: held-out accuracy {acc:.1f}%")


if __name__ == "__main__":
    main()
