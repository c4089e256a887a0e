"""A training script for ``plait serve``: a Keras 3 model trained under MultiWorkerMirroredStrategy.

The service gives every worker ``TF_CONFIG`` (``framework tensorflow``) when
``PARALLEL_INSTANCES`` > 1; the strategy forms the group from it. The hyper-parameters
come as JSON in ``PLAIT_PARAMETERS``; every epoch is reported with
:func:`plait.progress.report`, and the chief (worker 0) saves the model to
``PLAIT_OUTPUT_DIR``::

    plait jobs submit --name keras --framework tensorflow --instances 2 service_keras_digits.py
    python examples/service_keras_digits.py          # the same, one process

The loop is written out (``strategy.run`` + ``GradientTape``; the Keras 3 optimizer sums the
gradients over the replicas): with Keras 3.15 / TensorFlow 2.21, ``model.fit`` under a
MultiWorkerMirroredStrategy of two workers fails (``Attempt to convert a value (PerReplica...)
to a Tensor``), while one worker runs.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

from plait.progress import report  # noqa: E402

BATCH = 32  # per worker


def main() -> int:
    params = json.loads(os.environ.get("PLAIT_PARAMETERS", "{}"))
    epochs, lr = int(params.get("epochs", 15)), float(params.get("lr", 0.05))
    config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    workers = len(config.get("cluster", {}).get("worker", [])) or 1
    index = int(config.get("task", {}).get("index", 0))
    strategy = tf.distribute.MultiWorkerMirroredStrategy() if workers > 1 else tf.distribute.get_strategy()
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split((x / 16.0).astype("float32"), y, test_size=0.2, random_state=0,
                                              stratify=y)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                                  keras.layers.Dense(10)])
        optimizer = keras.optimizers.SGD(lr * workers, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    global_batch = BATCH * workers
    # the strategy shards the global batches over the workers
    data = tf.data.Dataset.from_tensor_slices((x_tr, y_tr)).shuffle(len(x_tr), seed=0).batch(global_batch)
    dist_data = strategy.experimental_distribute_dataset(data)

    @tf.function
    def train_step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        def replica(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(loss_fn(yb, model(xb, training=True))) / global_batch
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica, args=(xb, yb)), axis=None)

    step = 0
    for epoch in range(epochs):
        total, batches = 0.0, 0
        for xb, yb in dist_data:
            total += float(train_step(xb, yb))
            batches += 1
            step += 1
        report(step=step, epoch=epoch, loss=total / batches)  # a no-op outside the service, and on rank > 0
    accuracy = float(np.mean(np.argmax(model.predict(x_te, verbose=0), axis=1) == y_te))
    if index == 0:
        print(f"test accuracy: {accuracy:.4f} ({workers} workers)", flush=True)
        out = os.environ.get("PLAIT_OUTPUT_DIR")
        if out:
            path = os.path.join(out, "model.keras")
            model.save(path)
            report(artifact=path, accuracy=accuracy)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
