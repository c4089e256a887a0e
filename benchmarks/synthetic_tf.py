"""The TensorFlow/Keras half of ``synthetic.py``: one job of one backend, every model.

Run: ``python benchmarks/synthetic_tf.py [--quick] [--backend ...]``, the same as
``synthetic.py --framework tensorflow`` (what ``run_all.py`` runs under this name; results
in ``results/synthetic_tf.{md,json}``).

Modelled on Horovod's ``examples/tensorflow2/tensorflow2_synthetic_benchmark.py``: a
Keras model, ``hvd.DistributedGradientTape`` inside a ``tf.function`` step, the
variables broadcast from rank 0 after the first step, momentum SGD. The models are
Keras 3 versions of ``synthetic.py``'s (same layer plan and sizes):

* ``resnet``: basic blocks, widths 64-512, batch norm, 3x32x32 images, 10 classes;
* ``transformer``: 2 pre-norm encoder blocks (d=256, 4 heads, MLP 1024) over 32
  tokens of a 16384-word embedding, mean-pooled into 10 classes.

The step differentiates the Keras variables' own ``tf.Variable`` (``v.value``):
Horovod's tape fails on Keras 3 variables, and every backend gets the same list.

Backends: ``plait-mpi`` / ``plait-horovod`` (``import plait.tensorflow as hvd``,
``hvd.init(backend=...)``), ``horovod`` (``import horovod.tensorflow as hvd``) and
``tf-mwms`` (``tf.distribute.MultiWorkerMirroredStrategy``, ring all-reduce, the
gradients reduced by the replica context; ``TF_CONFIG`` made from ports the ranks
exchange over MPI).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["BACKENDS", "PEERS", "build_model", "worker_results"]

BACKENDS = ("plait-mpi", "plait-horovod", "horovod", "tf-mwms")
PEERS = ("horovod", "tf-mwms")
CLASSES = 10
SEQ = 32
VOCAB = 16384
LR = 0.01
MOMENTUM = 0.9


def build_model(kind: str, width: int = 64) -> Any:
    """The benchmark's Keras model (``resnet`` or ``transformer``), seeded alike on every rank.

    Raises:
        ValueError: for another ``kind``.
    """
    import keras
    from keras import layers

    keras.utils.set_random_seed(0)
    if kind == "resnet":
        x = inp = keras.Input((32, 32, 3))
        x = layers.ReLU()(layers.BatchNormalization()(
            layers.Conv2D(width, 3, 2, "same", use_bias=False)(x)))
        w = width
        for cin, cout, stride in [(w, w, 1), (w, 2 * w, 2), (2 * w, 4 * w, 2), (4 * w, 4 * w, 1),
                                  (4 * w, 8 * w, 2)]:
            y = layers.Conv2D(cout, 3, stride, "same", use_bias=False)(x)
            y = layers.ReLU()(layers.BatchNormalization()(y))
            y = layers.BatchNormalization()(layers.Conv2D(cout, 3, 1, "same", use_bias=False)(y))
            short = x
            if stride != 1 or cin != cout:
                short = layers.BatchNormalization()(
                    layers.Conv2D(cout, 1, stride, use_bias=False)(x))
            x = layers.ReLU()(layers.Add()([y, short]))
        out = layers.Dense(CLASSES)(layers.GlobalAveragePooling2D()(x))
        return keras.Model(inp, out)
    if kind == "transformer":
        d = 4 * width
        tokens = keras.Input((SEQ,), dtype="int32")
        x = layers.Embedding(VOCAB, d)(tokens)
        x = _positions(d)(x)
        for _ in range(2):
            y = layers.LayerNormalization(epsilon=1e-5)(x)
            x = x + layers.MultiHeadAttention(4, d // 4)(y, y)
            y = layers.LayerNormalization(epsilon=1e-5)(x)
            x = x + layers.Dense(d)(layers.Dense(4 * d, activation="relu")(y))
        out = layers.Dense(CLASSES)(layers.GlobalAveragePooling1D()(x))
        return keras.Model(tokens, out)
    raise ValueError(f"invalid model={kind!r}: expected 'resnet' or 'transformer'")


def _positions(d: int) -> Any:
    """A learned position embedding added to the tokens' (``synthetic.py``'s ``pos``)."""
    import keras

    class Positions(keras.layers.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.pos = self.add_weight(shape=(SEQ, d), initializer="zeros")

        def call(self, x: Any) -> Any:
            return x + self.pos
    return Positions()


def synthetic_batch(kind: str, batch: int) -> tuple[Any, Any]:
    """Fixed random inputs and labels for ``kind``."""
    import tensorflow as tf

    g = tf.random.Generator.from_seed(1)
    x = (g.normal([batch, 32, 32, 3]) if kind == "resnet"
         else g.uniform([batch, SEQ], 0, VOCAB, dtype=tf.int32))
    return x, g.uniform([batch], 0, CLASSES, dtype=tf.int32)


def _own_address() -> str:
    """This host's address towards the first host (``SYNTH_MASTER``, across emulated
    hosts), else the loopback's."""
    import socket

    master = os.environ.get("SYNTH_MASTER")
    if not master:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, 9))  # no packet: picks the route's source address
        return str(s.getsockname()[0])


class _Backend:
    """The backend's library (or strategy), rank and size."""

    def __init__(self, backend: str, compression: str = "none") -> None:
        self.backend, self.compression = backend, compression
        self.strategy: Any = None
        self.hvd: Any = None
        if backend == "tf-mwms":
            from _common import free_port
            from mpi4py import MPI

            from plait.launch.context import tf_config

            world = MPI.COMM_WORLD
            hosts = world.allgather(f"{_own_address()}:{free_port()}")
            os.environ["TF_CONFIG"] = tf_config(hosts, world.rank)
            self.rank, self.size = world.rank, world.size
        import tensorflow as tf

        # one thread per op, as torch gets; TensorFlow's default inter-op threads (here 2):
        # with one, a rank whose only executor thread waits in a plait-mpi host op computes
        # nothing meanwhile, and the ranks could fall into taking turns (README)
        tf.config.threading.set_intra_op_parallelism_threads(1)
        if backend == "tf-mwms":
            impl = tf.distribute.experimental.CommunicationImplementation.RING
            self.strategy = tf.distribute.MultiWorkerMirroredStrategy(
                communication_options=tf.distribute.experimental.CommunicationOptions(
                    implementation=impl))
        elif backend.startswith("plait-"):
            import plait.tensorflow as hvd

            hvd.init(backend=backend.split("-", 1)[1])
            self.hvd = hvd
        elif backend == "horovod":
            import horovod.tensorflow as hvd

            hvd.init()
            self.hvd = hvd
        else:
            raise ValueError(f"invalid backend={backend!r}: expected one of {list(BACKENDS)}")
        if self.hvd is not None:
            self.rank, self.size = self.hvd.rank(), self.hvd.size()

    def stepper(self, model: Any, x: Any, y: Any, lr: float) -> Callable[[], None]:
        """One training step of ``model`` on the batch ``(x, y)`` (a traced function)."""
        import tensorflow as tf

        variables = [v.value for v in model.trainable_variables]
        moments = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]

        def loss_of() -> Any:
            logits = model(x, training=True)
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

        def update(grads: list[Any]) -> None:
            for v, m, g in zip(variables, moments, grads):
                m.assign(MOMENTUM * m + g)
                v.assign_sub(lr * m)

        hvd = self.hvd
        if hvd is not None:
            kwargs = {} if self.compression == "none" else {
                "compression": getattr(hvd.Compression, self.compression)}

            @tf.function
            def step() -> None:
                with tf.GradientTape() as tape:
                    loss = loss_of()
                update(hvd.DistributedGradientTape(tape, **kwargs).gradient(loss, variables))

            step()  # as Horovod's script: broadcast after the first step made every variable
            hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
            hvd.broadcast_variables(moments, root_rank=0)
            return step  # type: ignore[no-any-return]

        def replica_step() -> None:
            with tf.GradientTape() as tape:
                loss = loss_of()
            ctx = tf.distribute.get_replica_context()
            update(ctx.all_reduce(tf.distribute.ReduceOp.MEAN, tape.gradient(loss, variables)))

        @tf.function
        def mwms_step() -> None:
            self.strategy.run(replica_step)
        return mwms_step  # type: ignore[no-any-return]


def worker_results(backend: str, models: list[str], args: Any) -> tuple[dict[str, Any], int, int]:
    """Every model of one job of ``backend``: ``({model: {params, img_secs, cpu_ms}}, rank, size)``."""
    from _common import timed_iterations

    setup = _Backend(backend, args.compression)
    results = {}
    for kind in models:
        if setup.strategy is not None:
            with setup.strategy.scope():
                model = build_model(kind)
        else:
            model = build_model(kind)
        x, y = synthetic_batch(kind, args.batch_size)
        step = setup.stepper(model, x, y, LR * setup.size)
        timed = timed_iterations(step, args, setup.rank == 0 and not args.out)
        results[kind] = {"params": int(sum(int(v.numpy().size) for v in model.trainable_variables)),
                         **timed}
    return results, setup.rank, setup.size


if __name__ == "__main__":
    import sys

    from synthetic import main

    raise SystemExit(main(["--framework", "tensorflow", *sys.argv[1:]]))
