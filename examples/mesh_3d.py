"""3D-parallel training on 8 ranks: data x pipeline x tensor (dp=2, pp=2, tp=2), PyTorch.

A 4-layer MLP on scikit-learn's digits. ``plait.Mesh`` lays the 8 ranks out
(Megatron order: tensor peers adjacent, pipeline stages farthest apart):

* tensor (tp=2): each linear layer is split by a ``TensorParallel`` plan,
  column-parallel then row-parallel, over ``mesh.tensor``;
* pipeline (pp=2): ``plait.Pipeline(..., comm=mesh)`` runs the sharded layers as
  two stages with a 1F1B schedule of 4 micro-batches over ``mesh.pipeline``;
* data (dp=2): each data replica takes half of every global batch; the pipeline
  averages each stage's gradients over ``mesh.data`` before the optimizer step
  and returns the loss of the global batch.

Every rank also trains the dense model on the whole global batch (it is tiny)
and the script checks that the losses, and the final model's outputs, agree,
so it fails loudly if the three kinds of parallelism ever stop composing to the
serial computation.

Run: ``mpirun -np 8 --oversubscribe python examples/mesh_3d.py [--steps N]``.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from sklearn.datasets import load_digits

import plait


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    torch.set_num_threads(1)

    mesh = plait.Mesh(dp=2, pp=2, tp=2, comm=plait.init("mpi"))
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)

    torch.manual_seed(0)  # the same dense model on every rank
    dense = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    reference = copy.deepcopy(dense)
    plan = {"0": plait.Colwise(), "2": plait.Rowwise(), "4": plait.Colwise(), "6": plait.Rowwise()}
    model = plait.TensorParallel(plan, comm=mesh.tensor).apply(dense)
    loss_fn = torch.nn.CrossEntropyLoss()
    pipe = plait.Pipeline(model, microbatches=4, schedule="1f1b", balance=[4, 3], comm=mesh,
                          loss_fn=loss_fn, optimizer=lambda params: torch.optim.SGD(params, lr=args.lr))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr)

    dp, worst = mesh.coords["dp"], 0.0
    for step in range(args.steps):
        lo = (step * args.batch_size) % (len(x) - args.batch_size)
        xb, yb = x[lo:lo + args.batch_size], y[lo:lo + args.batch_size]
        loss = pipe.train_step(xb[dp::2], yb[dp::2])   # this data replica's half

        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(xb), yb)
        ref_loss.backward()
        ref_opt.step()
        worst = max(worst, abs(loss - ref_loss.item()))
        if mesh.rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss:.5f}  (dense {ref_loss.item():.5f})", flush=True)
    # Whole-data predictions on the last stage must match the dense model's too.
    out = pipe.predict(x)
    pipe.close()
    if out is not None:
        with torch.no_grad():
            dense_out = reference(x)
        worst = max(worst, float((out - dense_out).abs().max()))
        accuracy = float((out.argmax(1) == y).float().mean())
    else:
        accuracy = None
    accuracy = next(a for a in mesh.world.allgather_object(accuracy) if a is not None)
    if mesh.rank == 0:
        print(f"{mesh}: largest loss/output difference from the dense model {worst:.2e}")
        print(f"final loss {loss:.4f}, training accuracy {accuracy:.4f}")
    if worst > 1e-4:
        print(f"rank {mesh.rank}: 3D loss differs from the dense model by {worst:.2e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
