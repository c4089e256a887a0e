"""Train a digits classifier with pipeline parallelism (optionally x data parallelism).

Run from the repository root, e.g.::

    mpirun -np 2 python examples/pipeline_digits.py --framework torch --schedule 1f1b
    mpirun -np 4 --oversubscribe python examples/pipeline_digits.py --framework keras --dp 2

With ``--dp D`` the ``N`` ranks form a ``plait.Mesh(dp=D, pp=N/D)``: each
data-parallel replica is a pipeline of ``N/D`` stages fed its share of every
batch, and each stage's gradients are averaged over its replicas. Every rank
loads the (bundled, no download) scikit-learn digits; the rank running the
last stage of each pipeline evaluates, and rank 0 prints the test accuracy.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import plait

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def load(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order].astype(np.int64)
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def build(framework: str, lr: float) -> tuple[object, object, object]:
    """The same MLP in either framework: model, loss_fn, optimizer."""
    if framework == "torch":
        import torch

        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32), torch.nn.Tanh(),
            torch.nn.Linear(32, 10))
        return model, torch.nn.CrossEntropyLoss(), lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9)
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)), keras.layers.Dense(64), keras.layers.Activation("tanh"),
        keras.layers.Dense(32), keras.layers.Activation("tanh"), keras.layers.Dense(10)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, loss, keras.optimizers.SGD(learning_rate=lr, momentum=0.9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=["torch", "keras"], default="torch")
    ap.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas (pp = ranks / dp)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64, help="global batch size")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--backend", default="mpi", help="mpi or horovod (p2p needs mpirun)")
    args = ap.parse_args()

    world = plait.init(args.backend)
    mesh = plait.Mesh(dp=args.dp, pp=world.size // args.dp, comm=world)
    xtr, ytr, xte, yte = load()
    model, loss_fn, optimizer = build(args.framework, args.lr)
    pipe = plait.Pipeline(model, microbatches=args.microbatches, schedule=args.schedule, comm=mesh,
                          loss_fn=loss_fn, optimizer=optimizer)
    if world.rank == 0:
        print(f"{pipe!r} on {mesh!r}")

    def tensor(a: np.ndarray) -> object:
        if args.framework == "torch":
            import torch

            return torch.from_numpy(a)
        return a

    replica, replicas = mesh.coords["dp"], args.dp
    local = args.batch // replicas
    steps = len(xtr) // args.batch
    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(xtr))
        total = 0.0
        for step in range(steps):
            rows = order[step * args.batch:(step + 1) * args.batch][replica * local:(replica + 1) * local]
            total += pipe.train_step(tensor(xtr[rows]), tensor(ytr[rows]))
        if world.rank == 0:
            print(f"epoch {epoch + 1}: mean loss {total / steps:.4f}", flush=True)

    out = pipe.predict(tensor(xte))
    accuracy = None
    if out is not None:
        logits = out.detach().numpy() if args.framework == "torch" else np.asarray(out)
        accuracy = float(np.mean(np.argmax(logits, axis=1) == yte))
    everyone = world.allgather_object(accuracy)
    if world.rank == 0:
        acc = next(a for a in everyone if a is not None)
        print(f"final test accuracy: {acc:.4f}")
    pipe.close()


if __name__ == "__main__":
    main()
