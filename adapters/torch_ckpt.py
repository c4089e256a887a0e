"""Checkpoint codec for PyTorch: model, optimizer, RNG states and plait state, no pickle.

Everything is turned into plain dicts of tensors, numbers, strings and lists,
written with ``torch.save`` and read back with ``torch.load(weights_only=True)``,
which refuses arbitrary objects.
"""

from __future__ import annotations

import io
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from plait.checkpoint.atomic import CheckpointError
from plait.checkpoint.state import Stateful

__all__ = ["CODEC", "TorchCodec", "get_rng_state", "set_rng_state"]

_FILE = "state.pt"


def get_rng_state() -> dict[str, Any]:
    """The torch, numpy and Python RNG states as tensors and numbers."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": int(version), "state": torch.tensor(py_state, dtype=torch.int64),
                   "gauss": py_gauss},
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss"]))


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, np.ndarray):  # framework-free plait state: kept as a tensor (weights_only)
        return torch.from_numpy(value.copy())
    if isinstance(value, Mapping):
        return {k: _detach(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_detach(v) for v in value]
    return value


class TorchCodec:
    """Turns torch training state into one ``state.pt`` file and back (``weights_only`` loading)."""

    framework = "torch"

    def gather(self, model: Any, optimizer: Any, states: Mapping[str, Stateful],
               extra: Mapping[str, Any]) -> dict[str, bytes]:
        """Serialise model, optimizer, RNG states, plait states and ``extra``.

        Returns:
            ``{"state.pt": bytes}``.
        """
        payload = {
            "model": _detach(model.state_dict()),
            "optimizer": None if optimizer is None else _detach(optimizer.state_dict()),
            "rng": get_rng_state(),
            "plait": {k: _detach(dict(s.state_dict())) for k, s in states.items()},
            "extra": _detach(dict(extra)),
        }
        buf = io.BytesIO()
        torch.save(payload, buf)
        return {_FILE: buf.getvalue()}

    def apply(self, files: Mapping[str, bytes], model: Any, optimizer: Any,
              states: Mapping[str, Stateful], where: str) -> dict[str, Any]:
        """Load ``files`` into the objects and restore the RNG states.

        Returns:
            The saved ``extra`` mapping.

        Raises:
            CheckpointError: naming the file when it is not a torch checkpoint of plain
                data or does not fit the objects.
        """
        path = f"{where}/{_FILE}"
        if _FILE not in files:
            raise CheckpointError(f"checkpoint {where}: has no {_FILE} (not a torch checkpoint?)")
        try:
            payload = torch.load(io.BytesIO(files[_FILE]), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises UnpicklingError, RuntimeError, ...
            raise CheckpointError(f"checkpoint file {path}: cannot be loaded safely ({exc})") from exc
        try:
            model.load_state_dict(payload["model"])
            if optimizer is not None:
                if payload["optimizer"] is None:
                    raise CheckpointError(f"checkpoint file {path}: holds no optimizer state")
                optimizer.load_state_dict(payload["optimizer"])
            for name, obj in states.items():
                if name not in payload["plait"]:
                    raise CheckpointError(
                        f"checkpoint file {path}: no plait state {name!r} "
                        f"(has {sorted(payload['plait'])})")
                obj.load_state_dict(payload["plait"][name])
            set_rng_state(payload["rng"])
        except CheckpointError:
            raise
        except (KeyError, RuntimeError, ValueError, TypeError) as exc:
            raise CheckpointError(
                f"checkpoint file {path}: does not fit the model/optimizer ({exc})") from exc
        extra: dict[str, Any] = payload["extra"]
        return extra


#: The codec :class:`plait.Checkpoint` uses for torch models.
CODEC = TorchCodec()
