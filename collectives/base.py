"""What every backend's communicator shares: handles, validation, the agreement
check, object collectives and topology. Backends supply a few raw primitives.

Nothing here imports mpi4py, horovod or a framework.
"""

from __future__ import annotations

import pickle
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from plait.adapters import ops_for

from plait.errors import ConfigError, PlaitTypeError, invalid
from plait.protocols import REDUCE_OPS, Handle, Tensor, TensorOps

from .check import Call, verify
from .graph_order import ordered

__all__ = ["CommunicatorBase", "Done", "MappedHandle", "Pending", "rank_list", "reducescatter_counts"]

_FLOATS = ("float16", "bfloat16", "float32", "float64")


class Done:
    """A :class:`~plait.protocols.Handle` whose result is already known."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def wait(self) -> Any:
        return self._value

    def done(self) -> bool:
        return True


class MappedHandle:
    """A :class:`~plait.protocols.Handle` whose result goes through ``fn`` (a face's
    postscale or 0-d shape, a compressed bucket's decode).

    Args:
        handle: the handle of the operation.
        fn: applied to its result.
    """

    def __init__(self, handle: Handle, fn: Callable[[Any], Any]) -> None:
        self._handle, self._fn = handle, fn

    def wait(self) -> Any:
        return self._fn(self._handle.wait())

    def done(self) -> bool:
        return bool(self._handle.done())


class Pending:
    """A :class:`~plait.protocols.Handle` over a backend request.

    Args:
        test: returns True once the request completed (must drive progress).
        wait: blocks until the request completed.
        finish: turns the completed request into the result (called once).
        keep: objects that must stay alive while the request is in flight.
        what: the operation in words, for messages (e.g. "a recv from rank 0 (tag 5) of 512 bytes").
    """

    def __init__(
        self,
        test: Callable[[], bool],
        wait: Callable[[], Any],
        finish: Callable[[], Any],
        keep: Any = None,
        what: str = "",
    ) -> None:
        self._test, self._wait, self._finish = test, wait, finish
        self._keep = keep
        self.what = what
        self._result: Any = None
        self._finished = False

    def done(self) -> bool:
        return self._finished or bool(self._test())

    def wait(self) -> Any:
        if not self._finished:
            self._wait()
            self._result = self._finish()
            self._finished = True
            self._keep = None
        return self._result


def reducescatter_counts(rows: int, size: int) -> list[int]:
    """Rows of the first dimension each rank receives (Horovod's rule: the first
    ``rows % size`` ranks get one extra)."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


class CommunicatorBase:
    """Shared behaviour of :class:`~plait.protocols.Communicator` implementations.

    Subclasses set ``backend``, ``rank``, ``size`` and implement the ``*_async``
    operations, ``barrier``, ``send``, ``recv``, ``split`` and the raw
    primitives ``_raw_allgather_bytes`` (ragged uint8 allgather) and
    ``_raw_bcast_bytes``, and either ``_raw_min`` (int64 MIN allreduce, with the
    timeout: the agreement check of :func:`~plait.collectives.check.verify`) or
    their own ``_verify`` (the MPI backend checks inside its header allgather).
    """

    backend = "base"
    rank = 0
    size = 1
    local_rank = 0
    local_size = 1
    cross_rank = 0
    cross_size = 1
    homogeneous = True

    def __init__(self, *, check: bool = True, timeout: float = 300.0) -> None:
        if timeout <= 0:
            raise invalid("timeout", timeout, "a positive number of seconds")
        self.check = bool(check)
        self.timeout = float(timeout)
        self.adasum = False
        self._call: Call | None = None  # the last call checked
        #: Bumped by every elastic reset: handles started in an older generation are
        #: gone with the library state they referred to (holders must drop them).
        self.generation = 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend={self.backend} rank={self.rank} size={self.size}>"

    # -- validation ---------------------------------------------------------------
    def _validate_op(self, op: str, dtype: str) -> None:
        valid = REDUCE_OPS + (("adasum",) if self.adasum else ())
        if op not in valid:
            raise invalid("op", op, f"one of {list(valid)} on the {self.backend} backend")
        if dtype == "bool" and op in ("average", "adasum"):
            raise invalid("op", op, "sum, min, max or product for a bool tensor")

    def _validate_rank(self, argument: str, value: int) -> None:
        if not isinstance(value, (int, np.integer)) or not 0 <= int(value) < self.size:
            raise invalid(argument, value, f"a rank in [0, {self.size})")

    def _verify(self, call: Call) -> None:
        if self.check and self.size > 1:
            self._call = call  # named if the check times out
            verify(call, self._raw_min, self._raw_allgather_rows,
                   f"the {self.backend} communicator of size {self.size}")

    def _raw_allgather_rows(self, row: np.ndarray) -> np.ndarray:
        return self._raw_allgather_bytes(row)

    # -- raw primitives (backends) ------------------------------------------------------
    def _raw_min(self, values: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _raw_allgather_bytes(self, data: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _raw_bcast_bytes(self, data: np.ndarray | None, root: int) -> np.ndarray:
        raise NotImplementedError

    # -- framework plumbing ------------------------------------------------------------
    @staticmethod
    def _ops(tensor: Tensor, what: str) -> TensorOps:
        try:
            return ops_for(tensor)
        except PlaitTypeError as exc:
            raise PlaitTypeError(f"{what}: {exc}") from None

    def _graph(self, ops: TensorOps, tensor: Tensor, sync: Callable[[Any], Any],
               same_shape: bool = True) -> Handle | None:
        """Inside a TensorFlow graph, run the numpy form of the op as a host op."""
        if not ops.is_symbolic(tensor):
            return None
        return Done(ops.host_call(ordered(self, sync), [tensor], tensor, same_shape=same_shape))

    # -- async operations (backends) -------------------------------------------------------
    def allreduce_async(self, tensor: Tensor, op: str = "average", name: str | None = None) -> Handle:
        raise NotImplementedError

    def allgather_async(self, tensor: Tensor, name: str | None = None) -> Handle:
        raise NotImplementedError

    def broadcast_async(self, tensor: Tensor, root: int = 0, name: str | None = None) -> Handle:
        raise NotImplementedError

    def alltoall(self, tensor: Tensor, splits: Sequence[int] | None = None,
                 name: str | None = None) -> tuple[Tensor, list[int]]:
        raise NotImplementedError

    # -- sync forms: op_async(...).wait() --------------------------------------------------
    def allreduce(self, tensor: Tensor, op: str = "average", name: str | None = None) -> Tensor:
        """Reduce ``tensor`` over all ranks; every rank gets the result."""
        return self.allreduce_async(tensor, op, name).wait()

    def allgather(self, tensor: Tensor, name: str | None = None) -> Tensor:
        """Concatenate every rank's ``tensor`` along the first dimension (sizes may differ)."""
        return self.allgather_async(tensor, name).wait()

    def broadcast(self, tensor: Tensor, root: int = 0, name: str | None = None) -> Tensor:
        """Return ``root``'s ``tensor`` on every rank."""
        return self.broadcast_async(tensor, root, name).wait()

    def grouped_allreduce(
        self, tensors: Sequence[Tensor], op: str = "average", name: str | None = None
    ) -> list[Tensor]:
        """Allreduce several tensors, started together and waited together."""
        handles = [
            self.allreduce_async(t, op, None if name is None else f"{name}.{i}")
            for i, t in enumerate(tensors)
        ]
        return [h.wait() for h in handles]

    def _graph_alltoall(self, ops: TensorOps, tensor: Tensor, splits: Any,
                        name: str | None) -> tuple[Tensor, Tensor]:
        """Alltoall of a symbolic (``tf.function``) tensor as two host ops: the data,
        then the received splits (an int32 tensor of the group size) that the first
        op found. ``splits`` may be a list or a tensor of the same framework."""
        received: list[np.ndarray] = []
        inputs = [tensor] if splits is None or not ops.owns(splits) else [tensor, splits]

        def move(a: np.ndarray, s: np.ndarray | None = None) -> np.ndarray:
            out, recv = self.alltoall(a, splits if s is None else [int(v) for v in s], name)
            received[:] = [np.asarray(recv, dtype=np.int32)]
            return np.asarray(out)

        out = ops.host_call(ordered(self, move), inputs, tensor, same_shape=False)
        like = ops.zeros([self.size], "int32", tensor)
        # ``out`` as input orders the second op after the first
        recv = ops.host_call(lambda _: received[0], [out], like)
        return out, recv

    # -- objects -----------------------------------------------------------------------------
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Send a picklable object from ``root`` to every rank (trusted: same job only).

        Args:
            obj: the object (only ``root``'s is used).
            root: the sending rank.

        Returns:
            ``root``'s object, on every rank.

        Raises:
            ConfigError: for a root outside the group.
            MismatchError: when other ranks make a different call.
            CollectiveTimeoutError: when other ranks do not arrive in time.
        """
        self._validate_rank("root", root)
        self._verify(Call("broadcast_object", (), "object", root=root))
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if self.rank == root else None
        out = self._raw_bcast_bytes(data, root)
        return obj if self.rank == root else pickle.loads(out.tobytes())  # noqa: S301

    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather one picklable object from every rank, in rank order.

        Args:
            obj: this rank's object.

        Returns:
            Every rank's object, in rank order.

        Raises:
            MismatchError: when other ranks make a different call.
            CollectiveTimeoutError: when other ranks do not arrive in time.
        """
        self._verify(Call("allgather_object", (), "object"))
        mine = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        sizes = self._raw_allgather_bytes(np.array([mine.size], dtype=np.int64).view(np.uint8))
        lengths = sizes.view(np.int64)
        data = self._raw_allgather_bytes(mine).tobytes()
        out, offset = [], 0
        for n in lengths:
            out.append(pickle.loads(data[offset : offset + int(n)]))  # noqa: S301
            offset += int(n)
        return out

    def join(self, device: int = -1) -> int:
        """Horovod's ``join()`` where every rank calls it: wait for all ranks (backends
        that let joined ranks take part in the others' allreduces override it).

        Args:
            device: unused (Horovod's GPU for the zeros).

        Returns:
            The rank that called ``join`` last.

        Raises:
            MismatchError: when another rank makes a different call.
        """
        arrived = self.allgather_object(time.time())
        return max(range(len(arrived)), key=arrived.__getitem__)

    def on_hosts(self, ranks: Sequence[int]) -> str:
        """``"host NAME; "`` or ``"hosts [...]; "`` (each once) of ``ranks`` of this
        group, for messages; ``""`` when the hosts are unknown."""
        names = getattr(self, "host_names", None)
        if not names:
            return ""
        hosts = list(dict.fromkeys(names[r] for r in ranks))
        return f"host {hosts[0]}; " if len(hosts) == 1 else f"hosts {hosts}; "

    def _topology(self) -> None:
        """Set local/cross rank and size from every rank's host name."""
        hosts = self.allgather_object(socket.gethostname())
        #: every rank's host name (by rank in this group), for messages
        self.host_names: list[str] = hosts
        order = list(dict.fromkeys(hosts))
        mine = hosts[self.rank]
        peers = [r for r, h in enumerate(hosts) if h == mine]
        self.local_rank, self.local_size = peers.index(self.rank), len(peers)
        self.cross_rank, self.cross_size = order.index(mine), len(order)
        #: every host runs the same number of ranks (a hierarchical layout is possible)
        self.homogeneous = len({hosts.count(h) for h in order}) == 1


def check_splits(splits: Sequence[int] | None, rows: int, size: int) -> list[int]:
    """Validate alltoall ``splits`` (default: equal parts).

    Raises:
        ConfigError: when the splits do not fit the tensor and the group.
    """
    if splits is None:
        if rows % size:
            raise invalid("splits", None, f"explicit splits: first dimension {rows} is not "
                          f"divisible by the group size {size}")
        return [rows // size] * size
    out = [int(s) for s in splits]
    if len(out) != size or any(s < 0 for s in out) or sum(out) != rows:
        raise ConfigError(
            f"invalid splits={list(splits)!r}: expected {size} non-negative counts "
            f"summing to the first dimension {rows}"
        )
    return out


def rank_list(ranks: Sequence[int]) -> str:
    """``"rank R"`` or ``"ranks [...]"``, for messages."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def floating(dtype: str) -> bool:
    """True for the floating dtypes."""
    return dtype in _FLOATS
