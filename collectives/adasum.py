"""Adasum (adaptive summation, Maleki et al. 2021) of every rank's gradient, as Horovod's
``op=Adasum`` computes it: ranks combined pairwise in a binary tree of rank order (0 with
1, 2 with 3, then those results...), each pair as

``(1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b``

with the products taken in float64 over the whole tensor (a zero vector's coefficient is
1). Parallel gradients average, orthogonal ones add. Pure numpy: the MPI backend gathers
the ranks' tensors and calls :func:`adasum` (MPI-free, so tested at any world size).
"""

from __future__ import annotations

import numpy as np

__all__ = ["ADASUM_DTYPES", "adasum", "power_of_two"]

#: The dtypes Horovod's Adasum takes.
ADASUM_DTYPES = ("float16", "float32", "float64")


def power_of_two(n: int) -> bool:
    """Whether ``n`` ranks can be combined by Adasum's tree (Horovod's condition)."""
    return n > 0 and n & (n - 1) == 0


def _pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot = float(a @ b)
    anorm, bnorm = float(a @ a), float(b @ b)
    acoeff = 1.0 - dot / (2.0 * anorm) if anorm > 0 else 1.0
    bcoeff = 1.0 - dot / (2.0 * bnorm) if bnorm > 0 else 1.0
    return acoeff * a + bcoeff * b  # type: ignore[no-any-return]


def adasum(parts: np.ndarray) -> np.ndarray:
    """Adasum of the rows of ``parts`` (one flat tensor per rank, in rank order).

    Args:
        parts: shape ``(ranks, n)``, a float dtype; ``ranks`` a power of two.

    Returns:
        The combined tensor, shape ``(n,)``, in ``parts``' dtype.

    Raises:
        ValueError: when the number of rows is not a power of two.
    """
    if not power_of_two(parts.shape[0]):
        raise ValueError(f"Adasum combines a power-of-two number of tensors, got {parts.shape[0]}")
    level = [row.astype(np.float64) for row in parts]
    while len(level) > 1:
        level = [_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0].astype(parts.dtype)
