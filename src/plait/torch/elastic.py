"""Horovod's ``horovod.torch.elastic`` (``from plait.torch.elastic import run``): each name
is read from ``plait.torch.elastic`` as the face's ``hvd.elastic`` stands when it is read
(Horovod's elastic mode, or ``plait run --elastic`` on the MPI backend)."""

from __future__ import annotations

from plait._face import elastic_attribute

__all__: list[str] = []

__getattr__ = elastic_attribute(__name__, "plait.collectives.horovod_elastic_torch")
