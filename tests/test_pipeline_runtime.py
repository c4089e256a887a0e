"""Single-process tests of the pipeline's pure parts: tags, wire headers, model type, batch checks."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from plait.collectives.base import Pending

from plait.errors import CollectiveTimeoutError
from plait.parallel.pipeline import PartitionError, PipelineError, PipelineTypeError, framework_of
from plait.parallel.pipeline.api import ABSENT, SCALAR, batch_error
from plait.parallel.pipeline.runtime import MAX_TAG, check_tags, message_tag
from plait.parallel.pipeline.wire import Notices, spans_hosts
from plait.parallel.pipeline.wire import header as _header
from plait.parallel.pipeline.wire import template as _template


def test_tags_are_unique_per_family_stage_and_microbatch():
    v, m = 4, 6
    tags = [message_tag(f, s, mb, v, m) for f in range(3) for s in range(v) for mb in range(m)]
    assert len(set(tags)) == len(tags)
    assert min(tags) >= 1 and max(tags) <= MAX_TAG


def test_too_many_tags_is_an_error_naming_both_counts():
    check_tags(8, 1000)
    with pytest.raises(PipelineError, match="microbatches=2000, stages=8"):
        check_tags(8, 2000)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "float16"])
@pytest.mark.parametrize("shape", [(3,), (4, 5), (2, 3, 4, 5)])
def test_header_round_trip(dtype, shape):
    a = np.zeros(shape, dtype=dtype)
    t = _template(_header(a))
    assert t.shape == a.shape and t.dtype == a.dtype


def test_header_rejects_unsupported_activations():
    with pytest.raises(PipelineError, match="at most 8 dims"):
        _header(np.zeros((1,) * 9, dtype=np.float32))
    with pytest.raises(PipelineError, match="dtype must be one of"):
        _header(np.zeros(3, dtype=np.complex64))


def test_framework_of_rejects_other_models():
    with pytest.raises(PipelineTypeError, match="torch.nn.Sequential, a keras.Sequential"):
        framework_of({"fc": 1})
    with pytest.raises(PipelineTypeError):
        framework_of([object()])


def table(*rows: tuple[int, int, int, int, int]) -> np.ndarray:
    """Batch table rows: (pipeline, x_rows, y_rows, needs_x, needs_y) per job rank."""
    return np.array(rows, dtype=np.int64)


def test_batch_error_accepts_batches_given_only_to_the_end_stages():
    # 3 stages: x on the first, nothing on the middle one, y on the last
    assert batch_error(table((0, 24, ABSENT, 1, 0), (0, ABSENT, ABSENT, 0, 0),
                             (0, ABSENT, 24, 0, 1)), 4) is None
    # two pipelines (dp=2) with batches of their own size
    assert batch_error(table((0, 12, 12, 1, 0), (0, 12, 12, 0, 1),
                             (2, 8, 8, 1, 0), (2, 8, 8, 0, 1)), 4) is None


def test_batch_error_names_the_rank_and_the_problem():
    middle = (0, ABSENT, ABSENT, 0, 0)
    err = batch_error(table((0, 24, ABSENT, 1, 0), middle, (0, ABSENT, 24, 0, 1)), 5)
    assert isinstance(err, PartitionError)
    assert str(err).startswith("batch x with 24 rows on rank 0: microbatches must divide batch_size=24")
    err = batch_error(table((0, 24, ABSENT, 1, 0), middle, (0, ABSENT, 20, 0, 1)), 4)
    assert isinstance(err, PartitionError)
    assert str(err) == ("the batches of one pipeline must have the same number of rows, "
                        "got 20 rows: y on rank 2; 24 rows: x on rank 0")
    err = batch_error(table((0, ABSENT, ABSENT, 1, 0), middle, (0, ABSENT, 24, 0, 1)), 4)
    assert isinstance(err, PipelineTypeError)
    assert "x (the input batch) is required on the first pipeline rank, got None on rank 0" in str(err)
    err = batch_error(table((0, 24, ABSENT, 1, 0), middle, (0, ABSENT, ABSENT, 0, 1)), 4)
    assert isinstance(err, PipelineTypeError) and "y (the target batch)" in str(err)
    err = batch_error(table((0, 24, 24, 1, 0), (0, 24, SCALAR, 0, 1)), 4)
    assert isinstance(err, PipelineTypeError)
    assert "batch y on rank 1 must have a batch dimension" in str(err)
    err = batch_error(table((0, 0, 0, 1, 1)), 1)
    assert isinstance(err, PartitionError) and "batch x with 0 rows on rank 0" in str(err)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_torch_stage_lets_messages_move_between_layers_without_changing_gradients(checkpoint):
    """A stage given ``progress`` calls it between its layers in forward and in backward
    (recomputation included), and computes what it computes without."""
    import torch
    from plait.adapters.torch_pipeline import TorchStage

    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Dropout(0.3), torch.nn.Linear(6, 3)]
    x, g = torch.randn(5, 6), torch.randn(5, 3)
    results, calls = [], []
    for poke in (None, lambda: calls.append(1)):
        stage = TorchStage(layers, first=False, last=False, loss_fn=None, scale=1.0,
                           checkpoint=checkpoint)
        stage.progress = poke
        for p in stage.module.parameters():
            p.grad = None
        torch.manual_seed(1)
        out = stage.forward(0, x)
        forward_calls = len(calls)
        gin = stage.backward(0, g)
        results.append((out, gin, [p.grad.clone() for p in stage.module.parameters()]))
    assert forward_calls == len(layers) - 1
    # backward: one call from each hook between layers, and the recompute's forward calls
    assert len(calls) == 2 * (len(layers) - 1) + (len(layers) - 1 if checkpoint else 0)
    (out0, gin0, grads0), (out1, gin1, grads1) = results
    torch.testing.assert_close(out1, out0)
    torch.testing.assert_close(gin1, gin0)
    for a, b in zip(grads1, grads0, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_keras_stage_lets_messages_move_between_layers_without_changing_gradients(checkpoint):
    """The Keras stage's traced chunk calls ``progress`` between its layers in forward and in
    backward (recomputation included), and computes what it computes without."""
    keras = pytest.importorskip("keras")
    import tensorflow as tf
    from plait.adapters.keras_pipeline import KerasStage

    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(6, activation="tanh"), keras.layers.Dropout(0.3, seed=3),
              keras.layers.Dense(3)]
    x, g = tf.random.normal((5, 6), seed=1), tf.random.normal((5, 3), seed=2)
    keras.Sequential(layers).build((None, 6))
    results, calls = [], []
    for poke in (None, lambda: calls.append(1)):
        stage = KerasStage(layers, first=False, last=False, loss_fn=None, scale=1.0,
                           checkpoint=checkpoint)
        stage.progress = poke
        rng = stage._rng()
        out = stage.forward(0, x)
        forward_calls = len(calls)
        gin = stage.backward(0, g)
        stage._set_rng(rng)  # the second stage draws the same dropout mask
        results.append((out, gin, list(stage.acc)))
    assert forward_calls == len(layers) - 1
    # backward: one call per gradient between layers, and the recompute's forward calls
    assert len(calls) == 2 * (len(layers) - 1) + (len(layers) - 1 if checkpoint else 0)
    (out0, gin0, grads0), (out1, gin1, grads1) = results
    # float32 round-off only: the traced graphs differ (no op fused across a host call)
    np.testing.assert_allclose(out1, out0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gin1, gin0, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads1, grads0, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_spans_hosts_from_host_names_then_cross_size_and_true_when_unknown():
    assert not spans_hosts(SimpleNamespace(host_names=["a", "a"], cross_size=2))
    assert spans_hosts(SimpleNamespace(host_names=["a", "b"], cross_size=1))
    assert spans_hosts(SimpleNamespace(cross_size=2))
    assert not spans_hosts(SimpleNamespace(cross_size=1))
    assert spans_hosts(SimpleNamespace())


def test_a_pipeline_wait_that_times_out_names_the_message_and_the_silent_ranks():
    never = Pending(lambda: False, lambda: None, lambda: None,
                    what="a recv from rank 1 (tag 7) of 512 bytes")
    wire = SimpleNamespace(timeout=0.05, send_async=None, recv_async=None,
                           comm=SimpleNamespace(on_hosts=lambda ranks: "host h1; "))
    notices = Notices(wire, peers=[1], tag=9)  # type: ignore[arg-type]
    notices.inbox = {1: Pending(lambda: False, lambda: None, lambda: None)}
    with pytest.raises(CollectiveTimeoutError) as err:
        notices.wait(never)
    assert str(err.value).startswith(
        "pipeline: waited 0.05s for a recv from rank 1 (tag 7) of 512 bytes; pipeline rank 1 "
        "did not arrive (host h1; no message and no notice of this step"), str(err.value)
