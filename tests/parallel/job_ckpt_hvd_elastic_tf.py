"""Horovod elastic Keras 3 custom training loop through ``plait.tensorflow``
(tests/test_fault_tolerance.py, tests/stress_elastic.py).

Horovod's ``tensorflow2_mnist_elastic.py`` pattern with ``import plait.tensorflow as hvd``:
a ``tf.function`` step with ``hvd.DistributedGradientTape`` (traced once, before the first
membership change, and kept across resets), one local step that builds the optimizer,
``hvd.elastic.TensorFlowKerasState`` carrying a plait state object, ``hvd.elastic.run`` and
a reset callback (the one that kills). The step also returns ``hvd.size_op()`` and a
worker-local source's gradient, which must follow the size after each change. The
membership changes are those of ``job_ckpt_hvd_elastic.py`` (same environment: HVD_HOSTS,
HVD_ADD, HVD_REMOVE, HVD_GROWN, HVD_KILL, HVD_KILL_RESET, HVD_STEPS, HVD_SLEEP); it prints
the same ``HVD done`` line.
"""

from __future__ import annotations

import os
from typing import Any

from job_ckpt_hvd_elastic import Plan, die


def main() -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import plait.tensorflow as hvd
    from plait.compression import Residual

    plan = Plan()
    hvd.init()
    assert hvd.backend() == "horovod"
    with np.load(os.environ["FT_DATA"]) as data:
        x_all = (data["x"] / 16.0).astype(np.float32)
        y_all = data["y"].astype(np.int64)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)

    own = tf.Variable(1.0)  # a worker-local source: its gradient is 1, scaled by the size

    @tf.function
    def training_step(x: Any, y: Any, allreduce: bool = True) -> Any:
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
            local = own * 1.0
        if allreduce:
            tape = hvd.DistributedGradientTape(tape)
            tape.register_local_source(own)
        grads = tape.gradient([value, local], [*model.trainable_variables, own])
        opt.apply_gradients(zip(grads[:-1], model.trainable_variables))
        # read when the graph runs, as Horovod's (its size_op under HOROVOD_ELASTIC)
        return value, hvd.size_op(), grads[-1]

    training_step(x_all[:8], y_all[:8], allreduce=False)  # builds the optimizer's variables
    memory = Residual()
    memory.residuals["seen"] = tf.zeros(1)
    state = hvd.elastic.TensorFlowKerasState(model, opt, state={"ef": memory}, step=0, sizes=[])
    if plan.kill_in_reset:
        state.register_reset_callbacks([die])

    @hvd.elastic.run
    def train(state: Any) -> None:
        while state.step < plan.steps:
            plan.kill(state.step, "start")
            rank, size = hvd.rank(), hvd.size()
            if int(memory.residuals["seen"].numpy()[0]) != state.step:
                raise RuntimeError(f"rank {rank}: plait state not in sync: seen "
                                   f"{memory.residuals['seen'].numpy()} at step {state.step}")
            if not state.sizes or state.sizes[-1] != size:
                state.sizes = [*state.sizes, size]
            # 32 rows a rank whatever the size, as Horovod's example: the step is not traced
            # again after a reset (a worker that traced it alone keeps its graph)
            perm = np.random.RandomState(state.step).permutation(len(y_all))[:32 * size]
            mine = perm[rank::size]
            _, seen_size, own_grad = training_step(x_all[mine], y_all[mine])
            if int(seen_size) != size or abs(float(own_grad) - 1.0 / size) > 1e-6:
                raise RuntimeError(f"rank {rank}: the traced step saw size {int(seen_size)} and "
                                   f"scaled a local gradient to {float(own_grad)} at size {size}")
            memory.residuals["seen"] = memory.residuals["seen"] + 1
            state.step += 1
            plan.end_step(state, rank, size, float(memory.residuals["seen"].numpy()[0]))

    train(state)
    flat = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
    gathered = hvd.allgather(tf.reshape(flat, [1, -1])).numpy()
    same = all(np.array_equal(gathered[0], row) for row in gathered)
    seen = hvd.allgather(tf.reshape(memory.residuals["seen"], [1, -1])).numpy()
    if hvd.rank() == 0:
        print(f"HVD done sizes={state.sizes} replicas_equal={same} "
              f"residual_steps={seen.reshape(-1).tolist()}", flush=True)


if __name__ == "__main__":
    main()
