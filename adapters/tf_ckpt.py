"""Checkpoint codec for TensorFlow/Keras 3: weights and optimizer variables in a ``.npz``.

Arrays go to ``arrays.npz`` (read back with ``allow_pickle=False``); everything
else (RNG states, plait state structure, ``extra``) to ``meta.json``-like
``state.json``. Nothing is pickled. The RNG states are numpy's and Python's global
ones, TensorFlow's global generator (``tf.random.get_global_generator()``) and the
Keras seed generators (the model's layers', e.g. Dropout, and Keras' global one).
TensorFlow's op-level seeds (``tf.random.set_seed`` and per-op counters) cannot be
read back and are not saved; with op determinism on, TensorFlow refuses to make a
global generator, so none is saved until the program sets one.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
from plait.adapters import ops_for

from plait.checkpoint.atomic import CheckpointError
from plait.checkpoint.state import Stateful

__all__ = ["CODEC", "KerasCodec"]

_ARRAYS = "arrays.npz"
_STATE = "state.json"


class _Flat:
    """Flattens nested plain data with array leaves into JSON + a dict of named arrays."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def add(self, array: np.ndarray) -> dict[str, str]:
        key = f"a{len(self.arrays):05d}"
        self.arrays[key] = np.asarray(array)
        return {"__array__": key}

    def encode(self, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {"__dict__": [[str(k), self.encode(v)] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            return [self.encode(v) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, np.ndarray) or hasattr(value, "shape"):
            return self.add(ops_for(value).to_numpy(value) if not isinstance(value, np.ndarray) else value)
        raise CheckpointError(f"cannot checkpoint a value of type {type(value).__qualname__}")


def _decode(value: Any, arrays: Mapping[str, np.ndarray], to_tensor: Any) -> Any:
    if isinstance(value, dict) and "__array__" in value:
        return to_tensor(arrays[value["__array__"]])
    if isinstance(value, dict) and "__dict__" in value:
        return {k: _decode(v, arrays, to_tensor) for k, v in value["__dict__"]}
    if isinstance(value, list):
        return [_decode(v, arrays, to_tensor) for v in value]
    return value


def _layer_seed_states(model: Any) -> list[Any]:
    """The model's Keras seed-generator state variables (e.g. a Dropout layer's
    ``SeedGenerator``): what ``model.variables`` holds beyond the weights."""
    weights = {id(w) for w in model.weights}
    return [v for v in getattr(model, "variables", []) if id(v) not in weights]


def _keras_global_seeds() -> Any:
    """Keras' internal global-state module, or None where it is not reachable.

    Keras 3 keeps its global seed generator (what ``keras.random`` calls without a seed
    draw from) there, with no public accessor.
    """
    try:
        from keras.src.backend.common import global_state
    except ImportError:
        return None
    return global_state


def _rng_state(flat: _Flat, model: Any) -> dict[str, Any]:
    import tensorflow as tf

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    try:
        tf_gen = tf.random.get_global_generator()
        generator: Any = [int(tf_gen.algorithm), flat.add(tf_gen.state.numpy())]
    except RuntimeError:  # op determinism on and no global generator made: none to save
        generator = None
    state: dict[str, Any] = {
        "numpy": [str(kind), flat.add(np.asarray(keys, dtype=np.uint32)), int(pos), int(has_gauss),
                  float(gauss)],
        "python": [int(version), list(py_state), py_gauss],
        "tensorflow": generator,
        "keras_layers": [flat.add(np.asarray(v.numpy())) for v in _layer_seed_states(model)],
    }
    keras_state = _keras_global_seeds()
    if keras_state is not None:
        gen = keras_state.get_global_attribute("global_seed_generator")
        # None: not made yet; the first keras.random call makes it from Python's random
        state["keras_global"] = None if gen is None else flat.add(np.asarray(gen.state.numpy()))
    return state


def _set_rng_state(state: Mapping[str, Any], arrays: Mapping[str, np.ndarray], model: Any,
                   path: str) -> None:
    import tensorflow as tf

    # checkpoints written before the TF/Keras generators were saved lack their keys
    if state.get("tensorflow") is not None:
        algorithm, tf_state = state["tensorflow"]
        tf.random.set_global_generator(
            tf.random.Generator.from_state(arrays[tf_state["__array__"]], algorithm))
    if "keras_layers" in state:
        saved = [arrays[r["__array__"]] for r in state["keras_layers"]]
        variables = _layer_seed_states(model)
        if len(saved) != len(variables):
            raise CheckpointError(f"checkpoint file {path}: {len(saved)} Keras seed generator "
                                  f"states of layers, the model has {len(variables)}")
        for var, value in zip(variables, saved, strict=True):
            var.assign(value)
    keras_state = _keras_global_seeds()
    if "keras_global" in state and keras_state is not None:
        if state["keras_global"] is None:
            keras_state.set_global_attribute("global_seed_generator", None)
        else:
            from keras.src.random.seed_generator import global_seed_generator

            global_seed_generator().state.assign(arrays[state["keras_global"]["__array__"]])
    # last: making Keras' global seed generator above draws from Python's random
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, arrays[keys["__array__"]], pos, has_gauss, gauss))
    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(py_state), py_gauss))


def _optimizer_variables(optimizer: Any, model: Any) -> list[Any]:
    if not getattr(optimizer, "built", True):
        optimizer.build(model.trainable_variables)
    return list(optimizer.variables)


class KerasCodec:
    """Turns Keras 3 model weights, optimizer variables and plait state into npz + JSON."""

    framework = "tensorflow"

    def gather(self, model: Any, optimizer: Any, states: Mapping[str, Stateful],
               extra: Mapping[str, Any]) -> dict[str, bytes]:
        """Serialise model weights, optimizer variables, RNG states (numpy, Python, TensorFlow's
        global generator, Keras' seed generators), plait states and ``extra``.

        Returns:
            ``{"arrays.npz": ..., "state.json": ...}``.
        """
        flat = _Flat()
        doc = {
            "model": [flat.add(w) for w in model.get_weights()],
            "optimizer": None if optimizer is None else
            [flat.add(np.asarray(v.numpy())) for v in _optimizer_variables(optimizer, model)],
            "rng": _rng_state(flat, model),
            "plait": {k: flat.encode(dict(s.state_dict())) for k, s in states.items()},
            "extra": flat.encode(dict(extra)),
        }
        buf = io.BytesIO()
        np.savez(buf, **flat.arrays)  # type: ignore[arg-type]
        return {_ARRAYS: buf.getvalue(), _STATE: json.dumps(doc).encode()}

    def apply(self, files: Mapping[str, bytes], model: Any, optimizer: Any,
              states: Mapping[str, Stateful], where: str) -> dict[str, Any]:
        """Load ``files`` into the objects and restore the RNG states (numpy, Python,
        TensorFlow's global generator, Keras' seed generators).

        Returns:
            The saved ``extra`` mapping.

        Raises:
            CheckpointError: naming the file when it cannot be read or does not fit.
        """
        import tensorflow as tf

        if _ARRAYS not in files or _STATE not in files:
            raise CheckpointError(f"checkpoint {where}: has no {_ARRAYS}/{_STATE} (not a Keras checkpoint?)")
        try:
            with np.load(io.BytesIO(files[_ARRAYS]), allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
        except (ValueError, OSError) as exc:
            raise CheckpointError(f"checkpoint file {where}/{_ARRAYS}: unreadable ({exc})") from exc
        try:
            doc = json.loads(files[_STATE])
        except ValueError as exc:
            raise CheckpointError(f"checkpoint file {where}/{_STATE}: unreadable ({exc})") from exc
        path = f"{where}/{_ARRAYS}"
        try:
            model.set_weights([arrays[r["__array__"]] for r in doc["model"]])
            if optimizer is not None:
                if doc["optimizer"] is None:
                    raise CheckpointError(f"checkpoint file {path}: holds no optimizer state")
                variables = _optimizer_variables(optimizer, model)
                saved = [arrays[r["__array__"]] for r in doc["optimizer"]]
                if len(saved) != len(variables):
                    raise CheckpointError(
                        f"checkpoint file {path}: {len(saved)} optimizer variables, the optimizer "
                        f"has {len(variables)}")
                for var, value in zip(variables, saved, strict=True):
                    if tuple(var.shape) != value.shape:
                        raise CheckpointError(
                            f"checkpoint file {path}: optimizer variable {var.name} has shape "
                            f"{tuple(var.shape)}, saved {value.shape}")
                    var.assign(value)
            for name, obj in states.items():
                if name not in doc["plait"]:
                    raise CheckpointError(f"checkpoint file {path}: no plait state {name!r}")
                obj.load_state_dict(_decode(doc["plait"][name], arrays, tf.convert_to_tensor))
            _set_rng_state(doc["rng"], arrays, model, path)
        except CheckpointError:
            raise
        except (KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(
                f"checkpoint file {path}: does not fit the model/optimizer ({exc})") from exc
        extra: dict[str, Any] = _decode(doc["extra"], arrays, lambda a: a)
        return extra


#: The codec :class:`plait.Checkpoint` uses for Keras models.
CODEC = KerasCodec()
