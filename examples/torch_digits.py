"""Train a digits classifier with PyTorch, written exactly like a Horovod script.

The only change from a Horovod script is the import: ``import plait.torch as hvd``.
Run it with any of:

    plait run -np 2 -- python examples/torch_digits.py
    mpirun -np 2 python examples/torch_digits.py            # MPI backend
    horovodrun -np 2 python examples/torch_digits.py        # Horovod backend

``--backend mpi|horovod`` (or PLAIT_BACKEND) picks what carries the bytes; by
default horovodrun means Horovod and mpirun means MPI.
"""

from __future__ import annotations

import argparse
import sys

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import plait.torch as hvd


def data() -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
    as_set = lambda a, b: TensorDataset(torch.tensor(a, dtype=torch.float32), torch.tensor(b))  # noqa: E731
    return as_set(x_tr, y_tr), as_set(x_te, y_te)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="mpi, horovod or auto")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="single-process rate (scaled by size)")
    parser.add_argument("--save", default=None, help="where rank 0 saves the model state")
    args = parser.parse_args()

    hvd.init(backend=args.backend)
    torch.manual_seed(0)
    train, test = data()
    sampler = DistributedSampler(train, num_replicas=hvd.size(), rank=hvd.rank(), seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    epochs = range(args.epochs)
    if hvd.rank() == 0:
        from tqdm import tqdm

        epochs = tqdm(epochs, desc=f"digits on {hvd.size()} ranks ({hvd.backend()})", file=sys.stdout)
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in epochs:
        sampler.set_epoch(epoch)
        model.train()
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
        avg = hvd.allreduce(loss.detach(), name="loss")
        if hvd.rank() == 0:
            epochs.set_postfix(loss=f"{avg.item():.4f}")  # type: ignore[attr-defined]

    # every rank scores its shard of the test set; counts are summed over ranks
    model.eval()
    xs, ys = test.tensors
    mine = slice(hvd.rank(), None, hvd.size())
    with torch.no_grad():
        correct = (model(xs[mine]).argmax(1) == ys[mine]).sum()
    totals = hvd.allreduce(torch.stack([correct, torch.tensor(len(ys[mine]))]).double(), op=hvd.Sum)
    accuracy = (totals[0] / totals[1]).item()
    if hvd.rank() == 0:
        print(f"test accuracy: {accuracy:.4f} ({int(totals[1])} images, {hvd.size()} ranks, "
              f"backend {hvd.backend()})")
        if args.save:
            torch.save(model.state_dict(), args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
