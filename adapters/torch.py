"""PyTorch adapter: the only plait module that imports torch.

Host tensors are shared with numpy without a copy; CUDA tensors are staged
through host memory (plait's MPI path is not CUDA-aware). bfloat16, which
numpy lacks, travels as its 16-bit pattern.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from plait.errors import PlaitTypeError

from .numpy import BYTE_BITS
from .numpy import OPS as _NUMPY
from .topk import sample_size, sampled_topk

__all__ = ["OPS", "TorchOps", "collective_function", "grouped_collective_function", "pooled_empty"]

_TO_NAME = {
    torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
    torch.float64: "float64", torch.int8: "int8", torch.uint8: "uint8", torch.int16: "int16",
    torch.int32: "int32", torch.int64: "int64", torch.bool: "bool",
}
_FROM_NAME = {v: k for k, v in _TO_NAME.items()}


_HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_HOST_OPS: dict[str, Callable[..., Any]] = {"sum": torch.add, "average": torch.add, "min": torch.minimum,
                                            "max": torch.maximum, "product": torch.mul}


def _as_half(a: np.ndarray, half: torch.dtype) -> torch.Tensor:
    """A 16-bit host buffer (float16, or bfloat16 bit patterns) as a torch tensor, no copy."""
    return torch.from_numpy(a.view(np.int16)).view(half)


def _sampled_topk(flat: torch.Tensor, k: int, gen: torch.Generator, magnitude: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`~plait.adapters.topk.sampled_topk` of a large 1-d float32/float64 CPU tensor
    (sampled with ``gen``); None for other tensors, small ones, or when the sample misled:
    the caller falls back to ``torch.topk``."""
    if flat.device.type != "cpu" or flat.dtype not in (torch.float32, torch.float64) or flat.requires_grad:
        return None
    n = flat.numel()
    m = sample_size(n, k)
    if m is None:
        return None
    # numpy from here: its gathers of a few 100K elements take 0.5 ms where torch's
    # advanced indexing took 2.5 ms, and its partition 0.4 ms where torch.topk took 1.9
    found = sampled_topk(flat.numpy(), k, torch.randint(0, n, (m,), generator=gen).numpy(), magnitude)
    return None if found is None else (torch.from_numpy(found[0]), torch.from_numpy(found[1]))


#: Bytes of output :meth:`TorchOps.matmul_pooled` computes per product.
_BAND_BYTES = 1 << 21


def pooled_empty(pool: Any, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU tensor of ``numel`` elements of ``dtype`` on a buffer of ``pool`` (a
    :class:`~plait.collectives.pool.BufferPool`): a reused buffer has no first-touch page
    faults (10.8M floats cast to float16: 7.6 ms into a fresh tensor, 1.8 ms into a
    reused one). Its contents are whatever the buffer held.

    Args:
        pool: the pool.
        numel: elements.
        dtype: the tensor's dtype.

    Returns:
        The tensor (it shares memory with the pool's buffer).
    """
    raw = pool.empty((numel * dtype.itemsize,), np.dtype(np.uint8))
    return torch.from_numpy(raw).view(dtype)


def torch_dtype(name: str) -> torch.dtype:
    """Map a canonical dtype name to ``torch.dtype``."""
    return _FROM_NAME[name]


class TorchOps:
    """:class:`~plait.protocols.TensorOps` for ``torch.Tensor``."""

    framework = "torch"

    def owns(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def dtype_name(self, x: torch.Tensor) -> str:
        try:
            return _TO_NAME[x.dtype]
        except KeyError:
            raise PlaitTypeError(
                f"unsupported torch dtype {x.dtype}: expected one of {sorted(_FROM_NAME)}"
            ) from None

    def shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(x.shape)

    def is_symbolic(self, x: torch.Tensor) -> bool:
        return False

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        # every collective passes through: ``is_cpu`` and ``requires_grad`` are cheaper
        # than ``device.type`` and ``detach()`` (~0.6 us of a small collective)
        t = x.detach() if x.requires_grad else x
        if not t.is_cpu:
            t = t.cpu()
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    def from_numpy(self, a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        if not a.flags.writeable:
            a = a.copy()
        if like.dtype == torch.bfloat16 and a.dtype == np.uint16:
            t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(a)
        if not like.is_cpu:
            t = t.to(like.device)
        return t

    def host_call(
        self, fn: Callable[..., Any], inputs: Sequence[Any], like: Any, same_shape: bool = True
    ) -> Any:
        return fn(*inputs)

    # -- math -----------------------------------------------------------------
    def cast(self, x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x.to(_FROM_NAME[dtype])

    def cast_pooled(self, x: torch.Tensor, dtype: str, pool: Any) -> torch.Tensor:
        """``x`` cast to ``dtype`` in a buffer of ``pool`` (a
        :class:`~plait.collectives.pool.BufferPool`) on the CPU (see
        :func:`pooled_empty`), else a new tensor."""
        target = _FROM_NAME[dtype]
        if x.device.type != "cpu" or x.dtype == target:
            return x.to(target)
        out = pooled_empty(pool, x.numel(), target).view(x.shape)
        out.copy_(x)
        return out

    def reshape(self, x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        return x.reshape(tuple(shape))

    def zeros(self, shape: Sequence[int], dtype: str, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=_FROM_NAME[dtype], device=like.device)

    def abs(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs()

    def sign(self, x: torch.Tensor) -> torch.Tensor:
        return x.sign()

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return x.norm()

    def topk(self, x: torch.Tensor, k: int, magnitude: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1)
        found = _sampled_topk(flat, k, self._generator(), magnitude)
        if found is not None:
            return found
        _, indices = torch.topk(flat.abs() if magnitude else flat, k, sorted=False)
        return flat[indices], indices

    def host_reduce(self, op: str, dtype: str) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None:
        """``fn(out, a, b)``: ``out = a (op) b`` on numpy host buffers of a 16-bit float
        ``dtype`` (bfloat16 as its bit patterns) with torch's vectorised kernels, for the
        MPI backend's ring (numpy's float16 arithmetic converts element by element: 20x
        slower here); None for other dtypes, where numpy is as fast.

        Args:
            op: "sum" (also for "average"), "min", "max" or "product".
            dtype: the buffers' plait dtype name.
        """
        fn = _HOST_OPS.get(op)
        half = _HALF.get(dtype)
        if fn is None or half is None:
            return None

        def reduce(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
            fn(_as_half(a, half), _as_half(b, half), out=_as_half(out, half))
        return reduce

    def host_divide(self, dtype: str) -> Callable[[np.ndarray, int], None] | None:
        """``fn(out, n)``: ``out /= n`` in place on a numpy host buffer of a 16-bit float
        ``dtype`` (see :meth:`host_reduce`); None for other dtypes."""
        half = _HALF.get(dtype)
        if half is None:
            return None

        def divide(out: np.ndarray, n: int) -> None:
            _as_half(out, half).div_(n)
        return divide

    def _generator(self) -> torch.Generator:
        """This adapter's own random stream (sampling must not move the user's RNG)."""
        gen = self.__dict__.get("_gen")
        if gen is None:
            gen = self.__dict__["_gen"] = torch.Generator().manual_seed(0)
        return gen

    def gather(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1)[indices]

    def scatter(self, indices: torch.Tensor, values: torch.Tensor, size: int) -> torch.Tensor:
        out = torch.zeros(size, dtype=values.dtype, device=values.device)
        return out.index_add_(0, indices, values)

    def scatter_pooled(self, indices: torch.Tensor, values: torch.Tensor, size: int,
                       pool: Any) -> torch.Tensor:
        """:meth:`scatter` into a zeroed buffer of ``pool`` (a
        :class:`~plait.collectives.pool.BufferPool`) on the CPU: zeroing a reused 43 MB
        buffer takes a few ms, a fresh one ~20 ms of page faults more."""
        if values.device.type != "cpu":
            return self.scatter(indices, values, size)
        out = pooled_empty(pool, size, values.dtype)
        out.zero_()
        return out.index_add_(0, indices, values)

    def zero_at(self, x: torch.Tensor, indices: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        flat = x.view(-1) if inplace and x.is_contiguous() else x.reshape(-1).clone()
        return flat.index_fill_(0, indices, 0)

    def add_into(self, acc: torch.Tensor, x: torch.Tensor, a: float = 1.0, b: float = 1.0,
                 own: bool = False) -> torch.Tensor:
        if a != 1.0:
            acc.mul_(a)
        return acc.add_(x, alpha=b)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b``; a tall, narrow product of 2-d CPU tensors (PowerSGD's ``M Q``) as
        ``(b^T a^T)^T`` (views, no copy): torch's CPU BLAS here took 13 ms for a 4096 x
        2560 by 2560 x 4 product, 4.8 ms that way (single thread)."""
        if a.dim() == 2 and b.dim() == 2 and 8 * b.shape[1] <= a.shape[0] and a.is_cpu:
            return (b.t() @ a.t()).t().contiguous()
        return a @ b

    def matmul_pooled(self, a: torch.Tensor, b: torch.Tensor, pool: Any) -> torch.Tensor:
        """``a @ b`` (2-d) into a buffer of ``pool`` on the CPU (see :meth:`cast_pooled`),
        a band of rows at a time (about 2 MB of the output each: PowerSGD's ``P Q^T`` of
        4096 x 2560 took 8.6 ms in one product here, 4.7-5.2 ms in bands)."""
        if a.device.type != "cpu" or a.dim() != 2 or b.dim() != 2 or a.dtype != b.dtype:
            return a @ b
        out = pooled_empty(pool, a.shape[0] * b.shape[1], a.dtype).view(a.shape[0], b.shape[1])
        rows = max(1, _BAND_BYTES // max(1, b.shape[1] * a.element_size()))
        if rows >= a.shape[0]:
            return torch.matmul(a, b, out=out)
        for i in range(0, a.shape[0], rows):
            torch.mm(a[i:i + rows], b, out=out[i:i + rows])
        return out

    def scaled_codes_sum(self, codes: Sequence[torch.Tensor], factors: Sequence[torch.Tensor],
                         dtype: str, divide: int, pool: Any) -> torch.Tensor:
        """``(sum_r codes[r] * factors[r]) / divide`` as a flat tensor of ``dtype``, in
        buffers of ``pool`` on the CPU (see :func:`pooled_empty`), each step as decoding
        every part and summing them would do it, in that order.

        Args:
            codes: each rank's integer codes, as many elements each.
            factors: each rank's one-element factor.
            dtype: the result's dtype name.
            divide: divide the sum by this (1: not at all).
            pool: the buffer pool.

        Returns:
            The sum (it shares memory with a buffer of ``pool`` on the CPU).
        """
        target, n = _FROM_NAME[dtype], codes[0].numel()
        cpu = codes[0].device.type == "cpu"
        out = (pooled_empty(pool, n, target) if cpu
               else torch.empty(n, dtype=target, device=codes[0].device))
        out.copy_(codes[0].reshape(-1))
        out.mul_(factors[0])
        tmp = out.new_empty(0)
        for c, f in zip(codes[1:], factors[1:]):
            if not tmp.numel():
                tmp = pooled_empty(pool, n, target) if cpu else torch.empty_like(out)
            tmp.copy_(c.reshape(-1))
            tmp.mul_(f)
            out.add_(tmp)
        if divide != 1:
            out.div_(divide)
        return out

    def qr(self, x: torch.Tensor) -> torch.Tensor:
        q, _ = torch.linalg.qr(x)
        return q

    def concat(self, xs: Sequence[torch.Tensor], axis: int = 0) -> torch.Tensor:
        return torch.cat(list(xs), dim=axis)

    def split(self, x: torch.Tensor, sizes: Sequence[int], axis: int = 0) -> list[torch.Tensor]:
        return list(torch.split(x, list(sizes), dim=axis))

    def uniform(self, shape: Sequence[int], seed: int, like: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator(device=like.device)
        gen.manual_seed(int(seed))
        return torch.rand(tuple(shape), generator=gen, device=like.device, dtype=torch.float32)

    def choose(self, n: int, k: int, seed: int, like: torch.Tensor) -> torch.Tensor:
        """``k`` distinct positions out of ``n`` (int64, increasing, on ``like``'s device),
        drawn uniformly from ``seed`` by numpy (10.8M elements, k = 1%: 7 ms, where the
        top k of ``n`` uniform numbers took 66 ms)."""
        return torch.from_numpy(_NUMPY.choose(n, k, seed, None)).to(like.device)

    def random_round(self, x: torch.Tensor, scale: Any, seed: int, code: str) -> torch.Tensor:
        flat = x.reshape(-1)
        host = flat.device.type == "cpu" and flat.dtype in (torch.float32, torch.float64)
        if host and not flat.requires_grad:
            s = scale.reshape(-1)[0].item() if isinstance(scale, torch.Tensor) else scale
            return torch.from_numpy(_NUMPY.random_round(flat.numpy(), s, seed, code))
        u = self.uniform(self.shape(flat), seed, flat).to(flat.dtype)
        return (torch.floor(flat.abs() * scale + u) * flat.sign()).to(_FROM_NAME[code])

    def floor(self, x: torch.Tensor) -> torch.Tensor:
        return torch.floor(x)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum()

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        return x.amax()

    def clamp_min(self, x: torch.Tensor, value: float) -> torch.Tensor:
        return x.clamp_min(value)

    def transpose(self, x: torch.Tensor) -> torch.Tensor:
        return x.t().contiguous()

    def nonzero(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(x.reshape(-1)).reshape(-1)

    def packbits(self, bits: torch.Tensor) -> torch.Tensor:
        flat = bits.reshape(-1)
        if flat.device.type == "cpu":  # numpy packs 10M bits in under a millisecond
            return torch.from_numpy(np.packbits(flat.to(torch.bool).numpy()))
        return _shift_pack(flat)

    def unpackbits(self, packed: torch.Tensor, count: int) -> torch.Tensor:
        if packed.device.type == "cpu":
            bits = np.unpackbits(packed.reshape(-1).numpy(), count=count)
            return torch.from_numpy(bits.view(np.bool_))
        return _shift_unpack(packed, count)

    def decode_bits(self, packed: torch.Tensor, count: int, one: Any, zero: Any, dtype: str) -> torch.Tensor:
        table = torch.where(_BYTE_BITS.to(packed.device), torch.as_tensor(one, dtype=_FROM_NAME[dtype]),
                            torch.as_tensor(zero, dtype=_FROM_NAME[dtype]))
        return torch.index_select(table, 0, packed.reshape(-1).to(torch.int32)).reshape(-1)[:count]


def _shift_pack(flat: torch.Tensor) -> torch.Tensor:
    """:meth:`TorchOps.packbits` on any device: eight shifted uint8 columns or-ed together."""
    wide = torch.nn.functional.pad(flat.to(torch.uint8), (0, (-flat.numel()) % 8)).reshape(-1, 8)
    out = wide[:, 0] << 7
    for i in range(1, 8):
        out |= wide[:, i] << (7 - i)
    return out


def _shift_unpack(packed: torch.Tensor, count: int) -> torch.Tensor:
    """:meth:`TorchOps.unpackbits` on any device."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    return ((packed.reshape(-1, 1) >> shifts) & 1).reshape(-1)[:count].to(torch.bool)


_BYTE_BITS = torch.from_numpy(BYTE_BITS)


def collective_function(
    forward: Callable[[torch.Tensor], torch.Tensor],
    backward: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Make a differentiable function whose forward and backward are two collectives.

    Args:
        forward: applied to the input in the forward pass.
        backward: applied to the upstream gradient in the backward pass.

    Returns:
        A function of one tensor, usable inside autograd.
    """

    class _Collective(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return forward(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return backward(grad)

    def apply(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Collective.apply(x)
        return out

    return apply


def grouped_collective_function(
    forward: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    backward: Callable[[list[torch.Tensor]], list[torch.Tensor]],
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """:func:`collective_function` of several tensors at once (Horovod's grouped forms).

    Args:
        forward: applied to the inputs in the forward pass.
        backward: applied to the upstream gradients (zeros for unused outputs).

    Returns:
        A function of the tensors returning one output per input.
    """

    class _Grouped(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(forward(list(xs)))

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(backward(list(grads)))

    def apply(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out: tuple[torch.Tensor, ...] = _Grouped.apply(*xs)
        return out

    return apply


OPS = TorchOps()
