"""Under horovodrun --gloo (no MPI): collective async modes work, point-to-point ones say why not."""

from __future__ import annotations

import pytest
import torch
from conftest import make_comm

import plait


def _train(comm, **options):
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 2)
    opt = plait.DataParallel(comm=comm, mode="async", **options).optimizer(
        torch.optim.SGD(m.parameters(), lr=0.1))
    for _ in range(6):
        m(torch.ones(4, 8) * (comm.rank + 1)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    everyone = comm.allgather(m.weight.detach().reshape(1, -1))
    assert torch.equal(everyone[0], everyone[-1])


@pytest.mark.parametrize("algorithm", ["local_sgd", "delayed"])
def test_collective_modes_work(algorithm):
    _train(make_comm("horovod"), algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ["parameter_server", "ssp", "gossip"])
def test_point_to_point_modes_raise_clearly(algorithm):
    with pytest.raises(NotImplementedError, match=f"algorithm='{algorithm}'.*mpirun"):
        _train(make_comm("horovod"), algorithm=algorithm)
