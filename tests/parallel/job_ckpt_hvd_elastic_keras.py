"""Horovod elastic Keras 3 ``model.fit`` through ``plait.keras`` (tests/test_fault_tolerance.py).

A Horovod elastic Keras script with ``import plait.keras as hvd``: plait's optimizer on
the Horovod backend compiled into the model, ``hvd.elastic.KerasState`` (model,
optimizer slots, attributes and a plait state object) and Horovod's elastic callbacks.
Run by ``horovodrun --host-discovery-script`` (not a pytest file). Rank 0 rewrites the
discovery file (HVD_HOSTS, lines ``host:slots``) to HVD_GROWN (one more slot or host)
after HVD_ADD batches and back after HVD_REMOVE; training goes on. With HVD_KILL
(``BATCHES:HOST``) the worker on HOST (Horovod's name for it) SIGKILLs itself when it starts
the batch after BATCHES batches, while the others are in that batch's collectives.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

STEPS_PER_EPOCH = 4
GLOBAL_BATCH = 96  # 48 per rank on 2 workers, 32 on 3


def main() -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import plait.keras as hvd
    from plait.compression import Residual

    hvd.init()  # plait's world on the Horovod backend (started by horovodrun)
    assert hvd.backend() == "horovod"
    epochs = int(os.environ.get("HVD_EPOCHS", "5"))
    add_at, remove_at = int(os.environ["HVD_ADD"]), int(os.environ["HVD_REMOVE"])
    hosts_file = os.environ["HVD_HOSTS"]
    with open(hosts_file) as f:
        hosts = {add_at: os.environ["HVD_GROWN"], remove_at: f.read()}
    with np.load(os.environ["FT_DATA"]) as data:
        x_all = (data["x"] / 16.0).astype("float32")
        y_all = data["y"].astype("int64")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])  # built in the first trace: a joiner traces twice
    memory = Residual()
    memory.residuals["seen"] = tf.zeros([1])
    state = hvd.elastic.KerasState(model, state={"ef": memory}, epoch=0, batches=0, sizes=[])

    kill_at, _, kill_host = os.environ.get("HVD_KILL", "-1:").partition(":")

    class Count(keras.callbacks.Callback):
        """Counts batches in the state and the plait object; rank 0 changes the hosts."""

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if state.batches == int(kill_at) and os.environ.get("HOROVOD_HOSTNAME") == kill_host:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            memory.residuals["seen"] = memory.residuals["seen"] + 1
            state.batches += 1
            if hvd.rank() == 0 and state.batches in hosts:
                with open(hosts_file + ".tmp", "w") as f:
                    f.write(hosts[state.batches])
                os.replace(hosts_file + ".tmp", hosts_file)
            time.sleep(float(os.environ.get("HVD_SLEEP", "0.5")))

    @hvd.elastic.run
    def train(state: Any) -> None:
        while state.epoch < epochs:
            rank, size = hvd.rank(), hvd.size()
            if int(memory.residuals["seen"].numpy()[0]) != state.batches:  # a new worker too
                raise RuntimeError(f"rank {rank}: plait state not in sync: seen "
                                   f"{memory.residuals['seen'].numpy()} after {state.batches} batches")
            if not state.sizes or state.sizes[-1] != size:
                state.sizes = [*state.sizes, size]
                if rank == size - 1 and size > 2:
                    print(f"HVD joined rank={rank} batches={state.batches}", flush=True)
            perm = np.random.RandomState(state.epoch).permutation(len(y_all))
            rows = perm[:GLOBAL_BATCH * STEPS_PER_EPOCH].reshape(STEPS_PER_EPOCH, GLOBAL_BATCH)
            mine = np.array_split(rows, size, axis=1)[rank].reshape(-1)
            model.fit(x_all[mine], y_all[mine], batch_size=len(mine) // STEPS_PER_EPOCH,
                      epochs=1, shuffle=False, verbose=0,
                      callbacks=[Count(), hvd.elastic.CommitStateCallback(state),
                                 hvd.elastic.UpdateEpochStateCallback(state)])

    train(state)
    flat = tf.concat([tf.reshape(v, [-1]) for v in model.variables], axis=0)
    gathered = hvd.allgather(tf.reshape(flat, [1, -1])).numpy()
    same = all(np.array_equal(gathered[0], row) for row in gathered)
    accuracy = float(np.mean(np.argmax(model.predict(x_all, verbose=0), axis=1) == y_all))
    seen = hvd.allgather(tf.reshape(memory.residuals["seen"], [1, -1])).numpy()
    if hvd.rank() == 0:
        print(f"HVD done sizes={state.sizes} replicas_equal={same} accuracy={accuracy:.4f} "
              f"batches={state.batches} residual_batches={seen.reshape(-1).tolist()}", flush=True)


if __name__ == "__main__":
    main()
