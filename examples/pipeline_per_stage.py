"""Pipeline training of a model no rank ever holds whole: each rank builds only its own stages.

Run from the repository root, e.g.::

    mpirun -np 2 python examples/pipeline_per_stage.py --framework torch
    mpirun -np 4 --oversubscribe python examples/pipeline_per_stage.py --framework keras --width 1024

The model (an MLP on scikit-learn's bundled digits, ``--blocks`` hidden layers of
``--width`` units) is described once without weights: torch builds it under
``torch.device("meta")``, Keras leaves out ``keras.Input`` so no layer is built.
``plait.Pipeline`` splits it into one stage per rank (balanced by parameter count
for torch) and every rank materialises only its stage's layers and their Adam
state. Each rank prints its parameters and peak RSS; rank 0 prints the test
accuracy of the trained pipeline.

``--budget-mb B`` makes the memory claim a check: each rank may grow its peak RSS
by at most B MiB over what it held after the imports (and the framework's first
op), while the whole model's training state (parameters, gradients and the two Adam
moments: 16 bytes per parameter) must exceed B, so that no single rank could train
it; the script fails when either does not hold. For example (torch, 80M parameters,
1.2 GiB of state, at most 1000 MiB per rank; ``--steps`` shortens the epochs)::

    mpirun -np 2 python examples/pipeline_per_stage.py --width 2048 --blocks 20 \
        --budget-mb 1000 --epochs 1 --steps 2
"""

from __future__ import annotations

import argparse
import os
import resource
import sys

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


def describe(framework: str, width: int, blocks: int, lr: float) -> tuple[object, object, object]:
    """The model without weights, its loss and its optimizer (factory)."""
    if framework == "torch":
        import torch

        with torch.device("meta"):
            layers: list[torch.nn.Module] = [torch.nn.Linear(64, width), torch.nn.Tanh()]
            for _ in range(blocks - 1):
                layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
            model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
        return model, torch.nn.CrossEntropyLoss(), lambda p: torch.optim.Adam(p, lr=lr)
    import keras

    keras.utils.set_random_seed(0)
    hidden = [keras.layers.Dense(width, activation="tanh") for _ in range(blocks)]
    model = keras.Sequential([*hidden, keras.layers.Dense(10)])  # no keras.Input: not built
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, loss, keras.optimizers.Adam(learning_rate=lr)


def state_mib(width: int, blocks: int) -> float:
    """The whole model's training state in MiB: parameters, gradients and Adam's two moments."""
    params = (64 * width + width) + (blocks - 1) * (width * width + width) + (width * 10 + 10)
    return 16 * params / 2**20


def warm_up(framework: str) -> None:
    """Run the framework's first op, so that the baseline RSS holds its runtime."""
    if framework == "torch":
        import torch

        torch.set_num_threads(1)
        torch.zeros(1).add_(1)
    else:
        import keras

        keras.ops.add(keras.ops.zeros(1), 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=["torch", "keras"], default="torch")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4, help="hidden layers")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--steps", type=int, default=0, help="steps per epoch (default: the whole data)")
    ap.add_argument("--budget-mb", type=float, default=0.0,
                    help="fail unless every rank's peak RSS grows by at most this many MiB while "
                         "the whole model's state exceeds it")
    args = ap.parse_args()

    world = plait.init("mpi")
    xtr, ytr, xte, yte = load()
    warm_up(args.framework)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model, loss_fn, optimizer = describe(args.framework, args.width, args.blocks, args.lr)
    pipe = plait.Pipeline(model, microbatches=args.microbatches, comm=world, loss_fn=loss_fn,
                          optimizer=optimizer, input_shape=(64,),
                          balance="params" if args.framework == "torch" else None)
    del model  # the description: on this rank only its own stage has weights
    own = sum(int(np.prod(tuple(p.shape))) for p in pipe.parameters())

    def tensor(a: np.ndarray) -> object:
        if args.framework == "torch":
            import torch

            return torch.from_numpy(a)
        return a

    steps = args.steps or len(xtr) // args.batch
    loss = float("nan")
    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(xtr))
        for i in range(steps):
            idx = order[i * args.batch:(i + 1) * args.batch]
            loss = pipe.train_step(tensor(xtr[idx]), tensor(ytr[idx]))
        if world.rank == 0:
            print(f"epoch {epoch}: loss {loss:.4f}", flush=True)
    out = pipe.predict(tensor(xte))
    correct = None
    if pipe.is_last:
        logits = out.detach().numpy() if args.framework == "torch" else np.asarray(out)
        correct = float(np.mean(np.argmax(logits, axis=1) == yte))
    accuracy = next(c for c in world.allgather_object(correct) if c is not None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    grown = world.allgather_object(peak - base)
    for line in world.allgather_object(
            f"rank {world.rank}: stage {pipe.stage_ids}, {own} parameters, peak RSS {peak:.0f} MiB "
            f"({peak - base:.0f} MiB over the imports)"):
        if world.rank == 0:
            print(line)
    whole = state_mib(args.width, args.blocks)
    if world.rank == 0:
        print(f"test accuracy {accuracy:.3f}")
        print(f"whole model state {whole:.0f} MiB; largest growth of a rank {max(grown):.0f} MiB")
    pipe.close()
    if args.budget_mb:
        if whole <= args.budget_mb:
            print(f"--budget-mb {args.budget_mb:g} is not below the whole model's state "
                  f"({whole:.0f} MiB): one rank could hold it; choose a larger model", file=sys.stderr)
            return 2
        over = [r for r, g in enumerate(grown) if g > args.budget_mb]
        if over:
            print(f"ranks {over} grew by more than --budget-mb {args.budget_mb:g} MiB: "
                  f"{[round(grown[r]) for r in over]}", file=sys.stderr)
            return 1
        if world.rank == 0:
            print(f"every rank within {args.budget_mb:g} MiB, below the whole model's {whole:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
