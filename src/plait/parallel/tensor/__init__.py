"""Tensor (Megatron-style) parallelism: conjugate collective mappings and plans.

Framework-free: the layers live in ``plait.adapters.torch_tp`` and
``plait.adapters.keras_tp``; this package holds the collective mappings and the
plan front end (:class:`TensorParallel`, :class:`Colwise`, :class:`Rowwise`, ...).
"""

from .mappings import copy_to_group, gather_from_group, reduce_from_group, scatter_to_group
from .plan import ChannelSplit, Colwise, Rowwise, Style, TensorParallel, VocabParallel

__all__ = [
    "ChannelSplit",
    "Colwise",
    "Rowwise",
    "Style",
    "TensorParallel",
    "VocabParallel",
    "copy_to_group",
    "gather_from_group",
    "reduce_from_group",
    "scatter_to_group",
]
