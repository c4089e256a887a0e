"""Train a digits classifier with Keras 3 ``model.fit``, written like a Horovod Keras script.

The only change from a Horovod script is the import: ``import plait.keras as hvd``
(Horovod 0.28's own Keras optimizer silently stops averaging under Keras 3).

    plait run -np 2 -- python examples/keras_digits.py
    mpirun -np 2 python examples/keras_digits.py
    horovodrun -np 2 python examples/keras_digits.py
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import plait.keras as hvd  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="mpi, horovod or auto")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="single-process rate (scaled by size)")
    args = parser.parse_args()

    hvd.init(backend=args.backend)
    keras.utils.set_random_seed(hvd.rank())  # different on purpose: the callback syncs them
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split((x / 16.0).astype(np.float32), y, test_size=0.2,
                                              random_state=0, stratify=y)
    x_tr, y_tr = x_tr[hvd.rank() :: hvd.size()], y_tr[hvd.rank() :: hvd.size()]

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    optimizer = hvd.DistributedOptimizer(
        keras.optimizers.SGD(learning_rate=args.lr * hvd.size(), momentum=0.9))
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
    model.fit(x_tr, y_tr, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
              verbose=2 if hvd.rank() == 0 else 0)
    mine = slice(hvd.rank(), None, hvd.size())
    correct = float(np.sum(np.argmax(model.predict(x_te[mine], verbose=0), axis=1) == y_te[mine]))
    totals = np.asarray(hvd.allreduce(np.array([correct, len(y_te[mine])]), op=hvd.Sum))
    if hvd.rank() == 0:
        print(f"test accuracy: {totals[0] / totals[1]:.4f} ({int(totals[1])} images, "
              f"{hvd.size()} ranks)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
