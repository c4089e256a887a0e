"""A small GPT trained through a pipeline: pp=2 on 2 ranks, or dp x pp x tp on 8 (PyTorch).

The model is nanoGPT's shape at toy size: token and position embeddings, ``--blocks``
pre-norm transformer blocks (causal multi-head self-attention, GELU MLP), a final
LayerNorm and a linear head over the vocabulary, as one ``torch.nn.Sequential``. It
learns to predict the next character of a text (this file's own source).

* pipeline (``--pp``): ``plait.Pipeline(..., comm=mesh)`` splits the layers into
  ``pp`` stages run with a 1F1B schedule of ``--microbatches`` micro-batches;
* per-stage construction (``--tp 1``): the model is described on torch's ``meta``
  device, without weights, and each rank builds only its own stages' layers
  (layer ``i`` initialised under seed ``i``); each rank prints the parameters it holds;
* tensor (``--tp``): attention is split by heads (query, key and value projections
  column-parallel, the output projection row-parallel) and the MLP Megatron-style
  (``fc`` column-parallel, ``proj`` row-parallel), by a ``plait.TensorParallel`` plan
  over ``mesh.tensor``;
* data (``--dp``): each data replica takes its share of every global batch; the
  pipeline averages the stages' gradients over ``mesh.data``.

Every rank also trains the serial model (the same layers built whole with the same
seeds) on the whole global batch, and the script fails when a step's loss, or the
final model's outputs, differ from it by more than 1e-4.

Run::

    mpirun -np 2 python examples/gpt_pipeline.py --pp 2
    mpirun -np 8 --oversubscribe python examples/gpt_pipeline.py --dp 2 --pp 2 --tp 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from plait.adapters.torch_pipeline import materialize
from torch import nn

import plait


class Embed(nn.Module):
    """Token plus position embedding of a batch of token ids ``(batch, time)``."""

    def __init__(self, vocab: int, width: int, context: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class SelfAttention(nn.Module):
    """Causal multi-head self-attention; the number of heads follows the projections' width,
    so a column-parallel ``q``/``k``/``v`` gives each tensor-parallel rank its own heads."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """``proj(gelu(fc(x)))`` with a 4x wider hidden layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(width), SelfAttention(width, heads)
        self.ln2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def gpt(vocab: int, width: int, heads: int, blocks: int, context: int) -> nn.Sequential:
    """The model as a sequence of layers: embedding, blocks, final norm, head."""
    return nn.Sequential(Embed(vocab, width, context), *(Block(width, heads) for _ in range(blocks)),
                         nn.LayerNorm(width), nn.Linear(width, vocab))


def tensor_plan(blocks: int) -> dict[str, plait.Colwise | plait.Rowwise]:
    """Megatron's split of every block (layer 0 is the embedding, so blocks are 1..blocks)."""
    plan: dict[str, plait.Colwise | plait.Rowwise] = {}
    for i in range(1, blocks + 1):
        plan.update({f"{i}.attn.{n}": plait.Colwise() for n in ("q", "k", "v")})
        plan.update({f"{i}.attn.out": plait.Rowwise(), f"{i}.mlp.fc": plait.Colwise(),
                     f"{i}.mlp.proj": plait.Rowwise()})
    return plan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default, text in (("dp", 1, "data-parallel replicas"), ("pp", 2, "pipeline stages"),
                                ("tp", 1, "tensor-parallel ranks"), ("steps", 30, "training steps"),
                                ("batch-size", 16, "global batch (sequences)"),
                                ("microbatches", 4, "micro-batches per step"),
                                ("context", 32, "characters per sequence"),
                                ("width", 64, "model width"), ("heads", 4, "attention heads"),
                                ("blocks", 4, "transformer blocks")):
        parser.add_argument(f"--{name}", type=int, default=default, help=f"{text} (default {default})")
    parser.add_argument("--lr", type=float, default=0.3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    mesh = plait.Mesh(dp=args.dp, pp=args.pp, tp=args.tp, comm=plait.init("mpi"))
    text = Path(__file__).read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    shape = (len(chars), args.width, args.heads, args.blocks, args.context)

    with torch.device("meta"):  # described once, without weights
        model, reference = gpt(*shape), gpt(*shape)
    materialize(reference)      # the serial model: every layer, layer i under seed i
    if args.tp > 1:             # tensor-parallel layers are cut from the dense weights
        materialize(model)
        model = plait.TensorParallel(tensor_plan(args.blocks), comm=mesh.tensor).apply(model)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    pipe = plait.Pipeline(model, microbatches=args.microbatches, schedule="1f1b", comm=mesh,
                          balance="params",
                          loss_fn=loss_fn, optimizer=lambda ps: torch.optim.SGD(ps, lr=args.lr))
    del model  # with --tp 1 this rank built only its own stages; the rest stay on meta
    held = sum(p.numel() for p in pipe.parameters())
    whole = sum(p.numel() for p in reference.parameters())
    print(f"rank {mesh.rank} {mesh.coords}: stages {pipe.stage_ids}, {held} of the model's "
          f"{whole} parameters", flush=True)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=args.lr)

    batches = torch.Generator().manual_seed(0)  # the same global batches on every rank
    dp, worst, first = mesh.coords["dp"], 0.0, None
    for step in range(args.steps):
        start = torch.randint(0, len(data) - args.context - 1, (args.batch_size,), generator=batches)
        xb = torch.stack([data[s:s + args.context] for s in start.tolist()])
        yb = torch.stack([data[s + 1:s + 1 + args.context] for s in start.tolist()])
        loss = pipe.train_step(xb[dp::args.dp], yb[dp::args.dp])   # this data replica's share

        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(xb), yb)
        ref_loss.backward()
        ref_opt.step()
        worst, first = max(worst, abs(loss - ref_loss.item())), first or loss
        if mesh.rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss:.5f}  (serial {ref_loss.item():.5f})", flush=True)
    out = pipe.predict(xb)  # the last batch, evaluated by the trained pipeline
    pipe.close()
    if out is not None:
        with torch.no_grad():
            worst = max(worst, float((out - reference(xb)).abs().max()))
    worst = max(mesh.world.allgather_object(worst))
    if mesh.rank == 0:
        print(f"{mesh}: largest loss/output difference from the serial model {worst:.2e}")
        print(f"loss {first:.4f} -> {loss:.4f} in {args.steps} steps")
    if worst > 1e-4:
        print(f"rank {mesh.rank}: the pipeline differs from the serial model by {worst:.2e}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
