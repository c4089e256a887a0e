"""Resumable 2-rank digits training, killed at chosen points (tests/test_fault_tolerance.py).

torch by default; ``FT_FRAMEWORK=keras`` trains the same model in Keras 3.

Run by ``plait run --restarts R`` on every rank (a script, not a pytest file).
Environment:
    FT_DATA     .npz with the digits (x, y); FT_DIR checkpoint directory; FT_OUT final weights (.npz).
    FT_STEPS    steps to train; FT_EVERY checkpoint interval.
    FT_KILL     "attempt:rank:step[:w];..." -- SIGKILL that rank of that attempt just before
                step (``w``: during the checkpoint written after that step).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time

import numpy as np


def kill_points() -> dict[tuple[int, int], tuple[int, bool]]:
    points = {}
    for item in filter(None, os.environ.get("FT_KILL", "").split(";")):
        a, r, s, *w = item.split(":")
        points[(int(a), int(r))] = (int(s), bool(w))
    return points


class TorchTrainer:
    """The digits MLP with dropout in torch; gradients averaged with ``comm``."""

    def __init__(self, comm: object, lr: float) -> None:
        import torch

        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        torch.manual_seed(0)
        self.torch, self.comm = torch, comm
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                         torch.nn.Linear(32, 10))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        torch = self.torch
        self.opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        params = list(self.model.parameters())
        grads = self.comm.grouped_allreduce([q.grad for q in params], "average", "grads")
        for q, g in zip(params, grads, strict=True):
            q.grad = g
        self.opt.step()
        return float(loss.item())

    def weights(self) -> list[np.ndarray]:
        return [v.detach().numpy().copy() for v in self.model.state_dict().values()]


class KerasTrainer:
    """The same model in Keras 3 (op determinism on; dropout from Keras' seed generators)."""

    def __init__(self, comm: object, lr: float) -> None:
        os.environ.setdefault("KERAS_BACKEND", "tensorflow")
        import keras
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()
        tf.config.threading.set_intra_op_parallelism_threads(1)
        keras.utils.set_random_seed(0)
        self.tf, self.comm = tf, comm
        self.model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                       keras.layers.Dropout(0.1, seed=7), keras.layers.Dense(10)])
        self.opt = keras.optimizers.SGD(learning_rate=lr, momentum=0.9)
        self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        variables = self.model.trainable_variables
        with self.tf.GradientTape() as tape:
            loss = self.loss(y, self.model(x, training=True))
        grads = self.comm.grouped_allreduce(tape.gradient(loss, variables), "average", "grads")
        self.opt.apply_gradients(zip(grads, variables, strict=True))
        return float(loss)

    def weights(self) -> list[np.ndarray]:
        return [np.asarray(w) for w in self.model.get_weights()]


def main() -> None:
    import plait
    from plait.checkpoint import Checkpoint
    from plait.elastic import plan, restart_count

    comm = plait.init()  # on the MPI backend an uncaught error aborts the whole job
    attempt = restart_count()
    rank, size = comm.rank, comm.size
    steps, every = int(os.environ["FT_STEPS"]), int(os.environ.get("FT_EVERY", "2"))
    kill = kill_points().get((attempt, rank))

    random.seed(0)
    np.random.seed(0)
    with np.load(os.environ["FT_DATA"]) as data:  # sklearn's load_digits, saved by the test
        x_all = (data["x"] / 16.0).astype(np.float32)
        y_all = data["y"].astype(np.int64)
    p = plan(global_batch=64, lr=0.05, size=size, base_size=size)
    keras = os.environ.get("FT_FRAMEWORK", "torch") == "keras"
    trainer = KerasTrainer(comm, p.lr) if keras else TorchTrainer(comm, p.lr)
    model, opt = trainer.model, trainer.opt
    ckpt = Checkpoint(os.environ["FT_DIR"], every=every, keep=2, comm=comm)
    start = ckpt.restore(model, opt)
    print(f"FT rank={rank} attempt={attempt} resumed={start} size={size} "
          f"host={socket.gethostname()}", flush=True)
    per_epoch = len(y_all) // p.global_batch
    last_loss = float("nan")  # no step left when the killed attempt had saved the last one
    for step in range(start, steps):
        if kill is not None and kill[0] == step and not kill[1]:
            os.kill(os.getpid(), signal.SIGKILL)
        perm = np.random.RandomState(1000 + step // per_epoch).permutation(len(y_all))
        batch = perm[(step % per_epoch) * p.global_batch:][: p.global_batch]
        mine = batch[rank * p.local_batch:(rank + 1) * p.local_batch]
        last_loss = trainer.step(x_all[mine], y_all[mine])
        if kill is not None and kill[0] == step and kill[1]:
            delay = random.Random(step).uniform(0, 0.004)
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        ckpt.step_done(step + 1, model, opt)
        if kill is not None and kill[1] and kill[0] == step:
            time.sleep(1)  # the timer fires; never go on
    weights = trainer.weights()
    flat = np.concatenate([w.reshape(-1) for w in weights])
    every_rank = np.asarray(comm.allgather(flat.reshape(1, -1)))
    if not all(np.array_equal(every_rank[0], row) for row in every_rank):
        raise RuntimeError("replicas diverged")
    if rank == 0:
        np.savez(os.environ["FT_OUT"], *weights)
        print(f"FT done size={size} loss={last_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
