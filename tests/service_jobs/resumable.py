"""Service test job: a tiny torch model with plait's checkpoints; the first attempt fails after one.

Trains 10 steps and saves a :class:`plait.Checkpoint` every 5 in ``PLAIT_OUTPUT_DIR/ckpt`` (the
service keeps the output directory across attempts; ``PLAIT_RESTART`` counts them). Attempt 0
fails right after its checkpoint at step 5; a relaunch restores it, checks that the weights are
the saved ones (their digest is saved along), and trains on to step 10.
"""

import hashlib
import os
import sys

import torch

from plait import Checkpoint
from plait.progress import report


def digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


torch.set_num_threads(1)
torch.manual_seed(0)
attempt = int(os.environ["PLAIT_RESTART"])
model = torch.nn.Linear(4, 1)
x, y = torch.randn(32, 4), torch.randn(32, 1)
ckpt = Checkpoint(os.path.join(os.environ["PLAIT_OUTPUT_DIR"], "ckpt"), every=5)
start = ckpt.restore(model)  # 0 without a checkpoint; it also restores torch's RNG
if start and ckpt.extra.get("digest") != digest(model):
    sys.exit(f"attempt {attempt}: the restored weights are not those saved at step {start}")
for step in range(start, 10):
    loss = torch.nn.functional.mse_loss(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    with torch.no_grad():  # plain SGD: a torch.optim optimizer imports torch._dynamo (1.4 s)
        for p, g in zip(model.parameters(), grads):
            p.sub_(0.1 * g)
    ckpt.step_done(step + 1, model, extra={"digest": digest(model)})
    report(step=step + 1, loss=loss.item())
    if attempt == 0 and step + 1 == 5:
        sys.exit("attempt 0 fails after its checkpoint at step 5")
print(f"attempt {attempt} resumed at step {start}", flush=True)
