"""A training script for ``plait serve``: plain PyTorch DDP, with the group the service sets up.

The service gives every process ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
(``framework torch``) when ``PARALLEL_INSTANCES`` > 1, the hyper-parameters as JSON in
``PLAIT_PARAMETERS``, and ``PLAIT_OUTPUT_DIR``; the script reports its progress with
:func:`plait.progress.report` (rank 0's reports show in ``plait jobs status``) and rank 0
saves the model. Without the service it is a single-process run::

    plait serve --code-dir examples &
    plait jobs submit --name digits --framework torch --instances 3 -p epochs=15 service_torch_digits.py
    python examples/service_torch_digits.py          # the same, one process
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from plait.progress import report


def main() -> int:
    params = json.loads(os.environ.get("PLAIT_PARAMETERS", "{}"))
    epochs, lr = int(params.get("epochs", 15)), float(params.get("lr", 0.05))
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")  # env:// -- the variables the service set
    rank, size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
    train = TensorDataset(torch.tensor(x_tr, dtype=torch.float32), torch.tensor(y_tr))
    sampler = DistributedSampler(train, num_replicas=size, rank=rank, seed=0)
    loader = DataLoader(train, batch_size=32, sampler=sampler)
    model: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                                 torch.nn.Linear(128, 10))
    if distributed:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * size, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    step = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
            step += 1
        report(step=step, epoch=epoch, loss=loss.item())  # a no-op outside the service, and on rank > 0
    with torch.no_grad():
        accuracy = float((model(torch.tensor(x_te, dtype=torch.float32)).argmax(1) == torch.tensor(y_te))
                         .float().mean())
    if rank == 0:
        print(f"test accuracy: {accuracy:.4f} ({size} processes)", flush=True)
        out = os.environ.get("PLAIT_OUTPUT_DIR")
        if out:
            path = os.path.join(out, "model.pt")
            state = model.module.state_dict() if distributed else model.state_dict()  # type: ignore[union-attr]
            torch.save(state, path)
            report(artifact=path, accuracy=accuracy)
    if distributed:
        # every rank reaches the teardown together: rank 0 hosts the store and once died at
        # exit in c10d's teardown ("terminate called without an active exception")
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
