"""Horovod's elastic torch API on the MPI backend (``plait.torch.elastic`` there).

``hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0)``,
``hvd.elastic.ElasticSampler`` and ``@hvd.elastic.run`` as in Horovod; membership
changes are relaunches by ``plait run --elastic`` (see :mod:`plait.elastic_relaunch`).
Commits are in memory and, for a relaunch, on disk.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch

from plait import runtime
from plait.elastic_relaunch import HostsUpdatedInterrupt, ObjectState, State, run

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Horovod's ``ElasticSampler``: this rank's share of a dataset's indices, skipping the
    ones any rank processed this epoch (recorded with :meth:`record_batch`), so a job
    resumed with another number of ranks does not see a sample twice in an epoch.

    Args:
        dataset: a sized dataset.
        shuffle: shuffle the indices (the same permutation on every rank, from ``seed + epoch``).
        seed: the shuffling seed.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.shared: set[int] = set()  # processed indices every rank already knows
        self.indices: list[int] = []
        self.num_replicas = self.rank = self.num_samples = self.total_size = 0
        #: Horovod 0.28's count of samples processed this epoch (every rank's batches);
        #: informative here, the indices above say which
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing is processed yet."""
        self.epoch = epoch
        self.processed_indices, self.shared = set(), set()
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record batch ``batch_idx`` (of ``batch_size``) of this rank's indices as processed
        (and, as Horovod 0.28, ``batch_size`` samples of every rank in ``processed_num``)."""
        self.record_indices(self.get_indices(batch_idx, batch_size))
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Iterable[int]) -> None:
        """Record dataset indices as processed."""
        self.processed_indices.update(indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's indices of batch ``batch_idx``."""
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def state_dict(self) -> dict[str, Any]:
        """The epoch, the processed indices and Horovod 0.28's ``processed_num``."""
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices),
                "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the epoch and processed indices, and re-shard the rest. A state saved by
        Horovod 0.28's sampler has only ``processed_num``: the first that many indices of
        its epoch's order (``seed + epoch`` shuffled) are the processed ones."""
        self.epoch = state_dict["epoch"]
        self.processed_num = int(state_dict.get("processed_num", 0))
        if "processed_indices" in state_dict:
            self.processed_indices = set(state_dict["processed_indices"])
        else:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(self.seed + self.epoch).shuffle(order)
            self.processed_indices = set(order[: self.processed_num])
        self.shared = set(self.processed_indices)  # every rank loads the same state
        self.reset()

    def reset(self) -> None:
        """Share the indices not processed yet among the current ranks (padded to equal shares)."""
        world = runtime.world() if runtime.is_initialized() else None
        self.num_replicas, self.rank = (world.size, world.rank) if world is not None else (1, 0)
        rest = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(rest)
        self.num_samples = math.ceil(len(rest) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        rest += rest[:self.total_size - len(rest)]
        self.indices = rest[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


_HANDLED = (torch.nn.Module, torch.optim.Optimizer, ElasticSampler)


class TorchState(State):
    """Torch modules, optimizers, elastic samplers and plain attributes, committed together.

    As in Horovod, every keyword whose value is a module, an optimizer or an
    :class:`ElasticSampler` is committed through its ``state_dict`` and restored into the
    same object; other keywords are plain attributes.

    Args:
        model: a ``torch.nn.Module`` (or None).
        optimizer: a ``torch.optim.Optimizer``, plait's ``DistributedOptimizer`` too (or None).
        **kwargs: more such objects, plain attributes (``epoch=0``, ``batch=0``), exposed as
            attributes, and ``state=``: plait state objects by name (see
            :class:`~plait.elastic_relaunch.State`).
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: Any = None,
                 **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        handled = {"model": model, "optimizer": optimizer,
                   **{k: v for k, v in kwargs.items() if isinstance(v, _HANDLED)}}
        self._handled = {k: v for k, v in handled.items() if v is not None}
        for name in self._handled:
            setattr(self, name, self._handled[name])
        super().__init__(**{k: v for k, v in kwargs.items() if k not in self._handled})

    def gather(self) -> None:
        """Before a commit or sync: every sampler records what any rank processed (each rank
        sends only the indices not shared at the last commit, so a commit per batch does not
        send the whole epoch's again)."""
        samplers = [s for s in self._handled.values() if isinstance(s, ElasticSampler)]
        world = runtime.world()
        if not samplers or world.size == 1:
            return
        every = world.allgather_object([s.processed_indices - s.shared for s in samplers])
        for i, sampler in enumerate(samplers):
            sampler.processed_indices |= set().union(*(sets[i] for sets in every))
            sampler.shared = set(sampler.processed_indices)

    def snapshot(self) -> dict[str, Any]:
        """Each object's state dict (tensors copied to the host) and the attributes."""
        snap = super().snapshot()
        for name, obj in self._handled.items():
            if isinstance(obj, torch.nn.Module):
                snap[name] = {k: v.detach().to("cpu", copy=True) for k, v in obj.state_dict().items()}
            else:
                snap[name] = copy.deepcopy(obj.state_dict())
        return snap

    def load_snapshot(self, snap: dict[str, Any]) -> None:
        """Load each object's state dict and the attributes from a snapshot."""
        super().load_snapshot(snap)
        for name, obj in self._handled.items():
            if name in snap:
                obj.load_state_dict(snap[name])
