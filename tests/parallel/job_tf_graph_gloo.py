"""plait.tensorflow on the Horovod backend with no MPI (horovodrun --gloo): collectives
built into TF1 graphs and their gradients, as Horovod's TF tests run them in graph mode
(tests/test_jobs.py runs it)."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import plait.tensorflow as hvd  # noqa: E402

hvd.init()


def _run(fetch):
    with tf.compat.v1.Session() as sess:
        return sess.run(fetch)


def test_allreduce_in_a_tf1_graph():
    # the agreement check runs eagerly beside the graph (its tensors were out of scope)
    assert hvd.backend() == "horovod"
    with tf.Graph().as_default():
        x = tf.ones([17, 3]) * float(hvd.rank() + 1)
        summed = hvd.allreduce(x, op=hvd.Sum)
        gathered = hvd.allgather(tf.ones([hvd.rank() + 1, 2]))
        n = hvd.size()
        got, rows = _run([summed, gathered])
    np.testing.assert_allclose(got, np.full((17, 3), n * (n + 1) / 2))
    assert rows.shape == (n * (n + 1) // 2, 2)


def test_alltoall_gradient_in_a_tf1_graph():
    # the gradient's splits are a graph tensor, handed to Horovod as they are
    n = hvd.size()
    with tf.Graph().as_default():
        x = tf.ones([2 * n, 3]) * float(hvd.rank() + 1)
        out = hvd.alltoall(x)
        grad = tf.gradients(out, x, tf.ones_like(out) * 2.0)[0]
        got, g = _run([out, grad])
    assert got.shape == (2 * n, 3)
    np.testing.assert_allclose(g, np.full((2 * n, 3), 2.0))
