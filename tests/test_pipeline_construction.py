"""Single-process tests of per-stage construction: building a model's layers one stage at a time
gives the weights of building it whole (torch meta-device models, Keras layers not built)."""

from __future__ import annotations

import numpy as np
import pytest

from plait.parallel.pipeline import PartitionError


def meta_mlp():
    import torch

    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.LayerNorm(8),
                                   torch.nn.Linear(8, 3))


def test_torch_stages_built_apart_equal_the_whole_model_built_at_once():
    import torch
    from plait.adapters.torch_pipeline import is_deferred, materialize

    whole, parts = meta_mlp(), meta_mlp()
    assert is_deferred(list(whole)) and is_deferred(list(parts))
    torch.manual_seed(5)
    before = torch.get_rng_state()
    materialize(whole, seed=3)
    materialize(parts, [2, 3], seed=3)  # the second stage first, as another rank would
    assert not any(p.is_meta for p in parts[2].parameters()) and parts[0].weight.is_meta
    materialize(parts, [0, 1], seed=3)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG is untouched
    for a, b in zip(whole.parameters(), parts.parameters()):
        assert torch.equal(a, b)
    other = meta_mlp()
    materialize(other, seed=4)
    assert not torch.equal(other[0].weight, whole[0].weight)


def test_torch_layer_without_reset_parameters_is_a_clear_error():
    import torch

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.s = torch.nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), Scale())
    with pytest.raises(PartitionError, match=r"model\[1\] \(Scale\).*no reset_parameters"):
        materialize_all(model)


def materialize_all(model):
    from plait.adapters.torch_pipeline import materialize

    materialize(model)


def keras_mlp():
    import keras

    keras.utils.set_random_seed(0)
    return [keras.layers.Dense(8), keras.layers.Activation("tanh"), keras.layers.Dense(3)]


def test_keras_stages_built_apart_equal_the_whole_model_built_at_once():
    from plait.adapters.keras_pipeline import is_deferred, materialize

    whole, parts = keras_mlp(), keras_mlp()
    assert is_deferred(whole)
    materialize(whole, input_shape=(6,))
    materialize(parts, [2], input_shape=(6,))  # the last stage alone: its input has 8 features
    assert parts[2].built and not parts[0].built
    assert tuple(parts[2].kernel.shape) == (8, 3)
    materialize(parts, [0, 1], input_shape=(6,))
    for a, b in zip(whole, parts):
        for va, vb in zip(a.weights, b.weights):
            np.testing.assert_array_equal(np.asarray(va), np.asarray(vb))


def test_keras_building_needs_an_input_shape_that_fits():
    import keras
    from plait.adapters.keras_pipeline import materialize

    with pytest.raises(PartitionError, match="input_shape .* is required"):
        materialize(keras_mlp(), [0])
    bad = [keras.layers.Reshape((5, 5)), keras.layers.Dense(2)]
    with pytest.raises(PartitionError,
                       match=r"model\[0\] \(reshape.*\) cannot be built on input shape \(None, 6\)"):
        materialize(bad, [1], input_shape=(6,))
