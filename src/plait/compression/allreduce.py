"""compressed_allreduce: error feedback, compression and the exchange in one call.

The one function a data-parallel optimiser calls per gradient::

    compressed_allreduce(comm, grad, name, compressor, memory)

It runs compensate -> compress -> update memory -> send -> decompress:

* a :class:`~plait.compression.base.Exchanger` (PowerSGD) runs its own collectives;
* a ``summable`` payload is allreduced entry by entry and decoded once;
* any other payload is allgathered (after its lengths, for ``ragged``
  compressors), each rank's part decoded, and the parts merged by
  ``compressor.combine``.

Works for numpy, torch and TensorFlow tensors on the MPI and Horovod
communicators. Inside ``tf.function`` the ``graph_safe`` ones (none, fp16,
bf16, with no error feedback) become graph ops (their traffic is not counted);
every other compressor runs the whole call in one host op of the graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from plait.adapters import ops_for
from plait.collectives.graph_order import ordered
from plait.errors import PlaitTypeError, invalid
from plait.protocols import Communicator, Tensor

from .base import FLOATS, Compressor, Exchanger, nbytes
from .cast import NoneCompressor
from .memory import Memory, NoMemory
from .stats import WireStats

__all__ = ["compressed_allreduce", "exchange_payload"]


def compressed_allreduce(
    comm: Communicator,
    tensor: Tensor,
    name: str,
    compressor: Compressor | None = None,
    memory: Memory | None = None,
    average: bool = True,
    *,
    stats: WireStats | None = None,
) -> Tensor:
    """Reduce ``tensor`` over all ranks of ``comm``, sending it compressed.

    Every rank of ``comm`` must call this with the same ``name``, shape, dtype
    and compressor settings, in the same order as its other collectives.

    Args:
        comm: the communicator.
        tensor: this rank's tensor (a gradient).
        name: the tensor's name: keys the memory and the compressor's state and
            names the collectives.
        compressor: how to encode it (default: :class:`NoneCompressor`).
        memory: error feedback (default: :class:`NoMemory`).
        average: average over ranks (else sum).
        stats: where to count the bytes sent, if given (``compressor.stats``, when set,
            counts them as well).

    Returns:
        The reduced tensor, with ``tensor``'s framework, shape and dtype; equal on every rank.

    Raises:
        ConfigError: for an empty or non-string name.
        PlaitTypeError: for a tensor the compressor cannot encode (e.g. integers).
    """
    if not isinstance(name, str) or not name:
        raise invalid("name", name, "a non-empty str naming the tensor (the same on every rank)")
    compressor = NoneCompressor() if compressor is None else compressor
    memory = NoMemory() if memory is None else memory
    ops = ops_for(tensor)
    symbolic = ops.is_symbolic(tensor)
    if symbolic and not (getattr(compressor, "graph_safe", False) and isinstance(memory, NoMemory)):
        return _on_host(comm, ops, tensor, name, compressor, memory, average, stats)
    compensated = getattr(memory, "compensate_in_place", memory.compensate)(tensor, name)
    if isinstance(compressor, Exchanger):
        payload, ctx, sent = compressor.exchange(comm, compensated, name, average)
        result = compressor.decompress(payload, ctx)
        known = getattr(memory, "update_decoded", None)  # the payload came back: decode it once
        if known is not None:
            known(compensated, name, result)
        else:
            memory.update(compensated, name, compressor, payload, ctx)
    else:
        payload, ctx = compressor.compress(compensated, name)
        memory.update(compensated, name, compressor, payload, ctx)
        result, sent = exchange_payload(comm, compressor, payload, ctx, name, average)
    if not symbolic:
        for sink in {id(s): s for s in (stats, getattr(compressor, "stats", None)) if s is not None}.values():
            sink.record(name, sent, nbytes(tensor))
    return result


def _on_host(comm: Communicator, ops: Any, tensor: Tensor, name: str, compressor: Compressor,
             memory: Memory, average: bool, stats: WireStats | None) -> Tensor:
    """:func:`compressed_allreduce` of a symbolic TensorFlow tensor (inside ``tf.function``,
    Keras ``model.fit``) by a compressor that picks data-dependent sizes (top-k, PowerSGD,
    any with error feedback): one host op of the graph runs the whole call on the
    tensor's numpy value, ordered among the graph's other collectives as they are (see
    :mod:`plait.collectives.graph_order`); its memory and state live on the host across
    the graph's runs, as in eager steps.

    Raises:
        PlaitTypeError: for a tensor that is not floating (checked when the graph is built).
    """
    dtype = ops.dtype_name(tensor)
    if dtype not in FLOATS:
        raise PlaitTypeError(
            f"compressed_allreduce of {name!r}: {compressor!r} with {memory!r} compresses "
            f"floating tensors ({', '.join(FLOATS)}), not {dtype}")

    def host(value: np.ndarray) -> np.ndarray:
        out = compressed_allreduce(comm, value, name, compressor, memory, average, stats=stats)
        return np.asarray(out, dtype=value.dtype)

    return ops.host_call(ordered(comm, host), [tensor], tensor)


def exchange_payload(
    comm: Communicator,
    compressor: Compressor,
    payload: Sequence[Tensor],
    ctx: Any,
    name: str,
    average: bool,
) -> tuple[Tensor, int]:
    """Send a payload to every rank and decode the reduction.

    Args:
        comm: the communicator.
        compressor: the compressor that produced ``payload``.
        payload: this rank's payload.
        ctx: this rank's context.
        name: the tensor's name (names the collectives).
        average: average over ranks (else sum).

    Returns:
        ``(reduced tensor, bytes this rank sent)``.
    """
    if getattr(compressor, "summable", False):
        op = "average" if average else "sum"
        if len(payload) == 1:
            summed = [comm.allreduce(payload[0], op=op, name=name)]
        else:
            summed = comm.grouped_allreduce(list(payload), op=op, name=name)
        sent = 0 if ops_for(payload[0]).is_symbolic(payload[0]) else sum(nbytes(p) for p in payload)
        return compressor.decompress(summed, ctx), sent
    sent = sum(nbytes(p) for p in payload)
    mine = [ops_for(p).shape(p)[0] for p in payload]
    if getattr(compressor, "ragged", False):
        lengths = np.array(mine, dtype=np.int64)
        sent += lengths.nbytes
        table = np.asarray(comm.allgather(lengths, name=f"{name}.lengths")).reshape(comm.size, -1)
    else:
        table = np.tile(np.array(mine, dtype=np.int64), (comm.size, 1))
    handles = [comm.allgather_async(p, name=f"{name}.{i}") for i, p in enumerate(payload)]
    gathered = [h.wait() for h in handles]
    return compressor.decode_gathered(gathered, table, ctx, average), sent
