"""Tensor (Megatron-style) parallelism: conjugate collective mappings and plans.

Framework-free: the layers live in ``plait.adapters.torch_tp`` and
``plait.adapters.keras_tp``; this package holds the collective mappings and the
plan front end (:class:`TensorParallel`, :class:`Colwise`, :class:`Rowwise`, ...),
and Ulysses sequence parallelism (:func:`seq_to_heads` / :func:`heads_to_seq`).
"""

from .mappings import copy_to_group, gather_from_group, reduce_from_group, scatter_to_group
from .plan import ChannelSplit, Colwise, Rowwise, Style, TensorParallel, VocabParallel
from .sequence import heads_to_seq, seq_to_heads

__all__ = [
    "ChannelSplit",
    "Colwise",
    "Rowwise",
    "Style",
    "TensorParallel",
    "VocabParallel",
    "copy_to_group",
    "gather_from_group",
    "heads_to_seq",
    "reduce_from_group",
    "scatter_to_group",
    "seq_to_heads",
]
