"""Horovod's elastic Keras 3 loop on the MPI backend, run by ``plait run --elastic``
(tests/test_elastic_mpi.py).

A one-unit Dense model trained with ``train_on_batch`` and plait's distributed
optimizer on fixed batches of 48 rows, split evenly over the ranks (so the averaged
gradient is the whole batch's at any world size); commits after every step. At the
end rank 0 trains the same steps in one process and prints the largest difference.
Environment: EL_STEPS, EL_SLEEP (seconds per step), EL_PIDS (directory for
``pid-RANK-RESTART`` files).
"""

from __future__ import annotations

import os
import time

import keras
import numpy as np

import plait
import plait.keras as hvd

BATCH = 48


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((240, 16), dtype=np.float32), rng.standard_normal((240, 1), dtype=np.float32)


def model(distributed: bool) -> keras.Model:
    keras.utils.set_random_seed(1)
    m = keras.Sequential([keras.Input((16,)), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    m.compile(optimizer=hvd.DistributedOptimizer(opt) if distributed else opt, loss="mse")
    return m


def rows(k: int, rank: int, size: int) -> np.ndarray:
    start = (k * BATCH) % 240
    return np.arange(start, start + BATCH)[rank::size]


def main() -> None:
    hvd.init()
    restart = os.environ.get("PLAIT_RESTART", "0")
    with open(os.path.join(os.environ["EL_PIDS"], f"pid-{hvd.rank()}-{restart}"), "w") as f:
        f.write(str(os.getpid()))
    steps, pause = int(os.environ["EL_STEPS"]), float(os.environ.get("EL_SLEEP", "0"))
    x, y = data()
    m = model(True)
    m.train_on_batch(x[:1] * 0, y[:1] * 0)  # builds the optimizer's variables; zero gradient
    state = hvd.elastic.KerasState(m, batch=0)

    @hvd.elastic.run
    def train(state: hvd.elastic.KerasState) -> None:
        print(f"EL start rank={hvd.rank()} size={hvd.size()} batch={state.batch}", flush=True)
        while state.batch < steps:
            r = rows(state.batch, hvd.rank(), hvd.size())
            state.model.train_on_batch(x[r], y[r])
            state.batch += 1
            time.sleep(pause)
            state.commit()

    train(state)
    mine = np.concatenate([w.reshape(-1) for w in m.get_weights()])
    every = plait.world().allgather_object(mine)  # horovod.keras has no allgather_object
    same = all(np.array_equal(every[0], w) for w in every)
    line = f"EL done rank={hvd.rank()} size={hvd.size()} batch={state.batch} replicas_equal={same}"
    if hvd.rank() == 0:
        ref = model(False)
        ref.train_on_batch(x[:1] * 0, y[:1] * 0)
        for k in range(steps):
            ref.train_on_batch(x[rows(k, 0, 1)], y[rows(k, 0, 1)])
        want = np.concatenate([w.reshape(-1) for w in ref.get_weights()])
        line += f" serial_diff={float(np.abs(mine - want).max()):.3g}"
    print(line, flush=True)


if __name__ == "__main__":
    main()
