"""The MPI backend's output buffers are reused only once nothing refers to them."""

from __future__ import annotations

import numpy as np
import pytest
from plait.collectives import pool as pool_module
from plait.collectives.pool import BufferPool

torch = pytest.importorskip("torch")
SHAPE = (256, 128)  # 128 KiB of float32: pooled


def test_a_released_buffer_is_reused_and_a_held_one_never() -> None:
    pool = BufferPool()
    a = pool.empty(SHAPE, np.dtype(np.float32))
    a[...] = 1.0
    b = pool.empty(SHAPE, np.dtype(np.float32))
    assert not np.shares_memory(a, b)  # a is held
    base = id(a.base)  # the pooled buffer (the pool keeps it alive: its id stays)
    del a
    c = pool.empty((SHAPE[0] * SHAPE[1],), np.dtype(np.float32))  # same bytes, other shape
    assert id(c.base) == base


def test_views_and_torch_tensors_keep_a_buffer_in_use() -> None:
    pool = BufferPool()
    t = torch.from_numpy(pool.empty(SHAPE, np.dtype(np.float32)))
    row = t[3]  # a view of a view
    del t
    held = row.numpy()
    for _ in range(3):
        other = pool.empty(SHAPE, np.dtype(np.float32))
        assert not np.shares_memory(other, held)
    ids = {id(b) for b, _ in pool._by_size[other.nbytes]}
    del row, held, other
    again = pool.empty(SHAPE, np.dtype(np.float32))
    assert id(again.base) in ids  # one of them was free again


def test_small_buffers_are_not_pooled_and_the_pool_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = BufferPool(max_bytes=4 * SHAPE[0] * SHAPE[1] * 4)
    small = pool.empty((10,), np.dtype(np.float32))
    assert small.base is None
    monkeypatch.setattr(pool_module, "MAX_PER_SIZE", 3)
    kept = [pool.empty(SHAPE, np.dtype(np.float32)) for _ in range(5)]  # all held
    assert len({id(k.base) for k in kept}) == 5
    assert pool._bytes <= 3 * kept[0].nbytes
    pool.empty((512, 128), np.dtype(np.float32))  # another size: over max_bytes, the oldest size goes
    assert pool._bytes <= pool.max_bytes


def test_buffers_are_aligned_for_tensorflow_to_take_them_without_a_copy() -> None:
    pool = BufferPool()
    for shape in (SHAPE, (SHAPE[0] * SHAPE[1] + 3,), (70_001,)):
        held = [pool.empty(shape, np.dtype(np.float32)) for _ in range(3)]
        assert all(a.ctypes.data % pool_module.ALIGN == 0 for a in held)
        assert all(a.base is not None and a.base.base is None for a in held)  # the pooled owner itself
