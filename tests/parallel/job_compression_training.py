"""Training with every compressor on every rank: torch x TF, each cell on one backend.

Run by tests/test_jobs_compression_training.py. The backends take turns (:func:`cells`),
so each trains every compressor; the exchange itself is checked on every backend by
job_compression.py.

A small MLP on scikit-learn's digits, fixed seeds, a few epochs, 2 ranks. For
each compressor (with ``Residual`` error feedback where it needs it) the final
test accuracy must be within 2 points of the same training uncompressed, the
replicas must be bit-identical after training, and the bytes counted by
``WireStats`` (through ``compressor.count_into``) must reflect the compression.

torch goes through ``distributed_optimizer``; TensorFlow through
``DistributedGradientTape`` eagerly (lossy compressors need eager tensors; the
cast compressors without memory are also trained inside ``tf.function``).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402
from conftest import backends  # noqa: E402
from plait.adapters.tf_optim import DistributedGradientTape  # noqa: E402
from plait.adapters.torch_optim import distributed_optimizer  # noqa: E402

from plait.compression import (  # noqa: E402
    BF16,
    FP16,
    QSGD,
    Compressor,
    EFSignSGD,
    NoMemory,
    NoneCompressor,
    OneBit,
    PowerSGD,
    RandomK,
    Residual,
    SignSGD,
    TernGrad,
    Threshold,
    TopK,
    WireStats,
)

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)
tf.config.experimental.enable_op_determinism()

HIDDEN = 32
EPOCHS = 6
BATCH = 64  # per rank
TOLERANCE = 2.0  # accuracy points
# Plain SGD: momentum on top of error feedback makes EF-signSGD and 1-bit SGD unstable.
LR, MOMENTUM = 1.0, 0.0
# signSGD's majority vote is +-1 per element: a much smaller step, with momentum (Signum-like).
SIGN_LR, SIGN_MOMENTUM = 0.003, 0.9


class Setting:
    """A compressor, its memory and learning rate, built fresh per run."""

    def __init__(self, make: Callable[[int], Compressor], memory: bool = False, lr: float = LR,
                 momentum: float = MOMENTUM) -> None:
        self.make, self.memory, self.lr, self.momentum = make, memory, lr, momentum

    def build(self, rank: int) -> tuple[Compressor, Any]:
        return self.make(rank), Residual() if self.memory else NoMemory()


SETTINGS = {
    "none": Setting(lambda r: NoneCompressor()),
    "fp16": Setting(lambda r: FP16()),
    "bf16": Setting(lambda r: BF16()),
    "topk": Setting(lambda r: TopK(0.1), memory=True),
    "randomk": Setting(lambda r: RandomK(0.25, seed=3, unbiased=False), memory=True),
    "threshold": Setting(lambda r: Threshold(0.01), memory=True),
    "qsgd": Setting(lambda r: QSGD(16, seed=100 + r)),
    "terngrad": Setting(lambda r: TernGrad(seed=200 + r)),
    "signsgd": Setting(lambda r: SignSGD(), lr=SIGN_LR, momentum=SIGN_MOMENTUM),
    "efsignsgd": Setting(lambda r: EFSignSGD(), memory=True),
    "onebit": Setting(lambda r: OneBit(), memory=True),
    "powersgd": Setting(lambda r: PowerSGD(rank=2), memory=True),
}


# -- data and model, the same numbers for both frameworks ----------------------------------------
def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order].astype(np.int64)
    return x[:1437], y[:1437], x[1437:], y[1437:]


DATA = digits()


def initial_weights() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [
        (rng.standard_normal((64, HIDDEN)) / 8.0).astype(np.float32),
        np.zeros(HIDDEN, np.float32),
        (rng.standard_normal((HIDDEN, 10)) / np.sqrt(HIDDEN)).astype(np.float32),
        np.zeros(10, np.float32),
    ]


def batches(rank: int, size: int) -> list[np.ndarray]:
    """Every step's row indices for this rank: a seeded shuffle per epoch, split by rank."""
    n = len(DATA[0])
    steps = n // (BATCH * size)
    out = []
    for epoch in range(EPOCHS):
        perm = np.random.default_rng(10 + epoch).permutation(n)
        for s in range(steps):
            rows = perm[s * BATCH * size : (s + 1) * BATCH * size]
            out.append(rows[rank::size])
    return out


def accuracy(logits: np.ndarray) -> float:
    return float(100.0 * np.mean(np.argmax(logits, axis=1) == DATA[3]))


def same_on_all_ranks(comm: Any, weights: np.ndarray) -> None:
    everyone = np.asarray(comm.allgather(weights.reshape(1, -1)))
    for r in range(comm.size):
        assert np.array_equal(everyone[r], weights), f"rank {r} diverged from rank {comm.rank}"


# -- torch ---------------------------------------------------------------------------------------
class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.b1, self.w2, self.b2 = (torch.nn.Parameter(torch.from_numpy(w.copy()))
                                              for w in initial_weights())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w1 + self.b1) @ self.w2 + self.b2


def train_torch(comm: Any, compressor: Compressor | None, memory: Any, lr: float,
                steps: int | None = None, momentum: float = MOMENTUM) -> tuple[float, np.ndarray]:
    x, y, xt, _ = (torch.from_numpy(a) for a in DATA)
    m = MLP()
    opt = distributed_optimizer(torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum), comm,
                                m.named_parameters(), compression=compressor, memory=memory)
    loss_fn = torch.nn.CrossEntropyLoss()
    for rows in batches(comm.rank, comm.size)[:steps]:
        idx = torch.from_numpy(rows)
        loss_fn(m(x[idx]), y[idx]).backward()
        opt.step()
        opt.zero_grad()  # the optimizer's step closed the compressor's wire-stats step
    with torch.no_grad():
        acc = accuracy(m(xt).numpy())
        weights = torch.cat([p.reshape(-1) for p in m.parameters()]).numpy()
    return acc, weights


# -- TensorFlow ----------------------------------------------------------------------------------
def train_tf(comm: Any, compressor: Compressor | None, memory: Any, lr: float,
             steps: int | None = None, momentum: float = MOMENTUM,
             graph: bool = False) -> tuple[float, np.ndarray]:
    x, y, xt, _ = DATA
    variables = [tf.Variable(w) for w in initial_weights()]
    velocity = [tf.Variable(tf.zeros_like(w)) for w in variables]

    def forward(xb: tf.Tensor) -> tf.Tensor:
        w1, b1, w2, b2 = variables
        return tf.tanh(xb @ w1 + b1) @ w2 + b2

    def step(xb: tf.Tensor, yb: tf.Tensor) -> None:
        with DistributedGradientTape(tf.GradientTape(), comm, compression=compressor,
                                     memory=memory) as tape:
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=forward(xb)))
        for var, vel, g in zip(variables, velocity, tape.gradient(loss, variables)):
            vel.assign(momentum * vel + g)
            var.assign_sub(lr * vel)

    run = tf.function(step) if graph else step
    for rows in batches(comm.rank, comm.size)[:steps]:
        run(tf.constant(x[rows]), tf.constant(y[rows]))  # the tape closes the wire-stats step
    acc = accuracy(forward(tf.constant(xt)).numpy())
    weights = np.concatenate([v.numpy().reshape(-1) for v in variables])
    return acc, weights


TRAIN = {"torch": train_torch, "tensorflow": train_tf}
_BASELINE: dict[str, float] = {}


def baseline(comm: Any, framework: str) -> float:
    """Uncompressed accuracy (compression=None: the plain allreduce path), once per framework.

    Both backends average 2 ranks' float32 gradients exactly (a + b, halved), so one backend's
    uncompressed run is the other's too.
    """
    if framework not in _BASELINE:
        _BASELINE[framework], weights = TRAIN[framework](comm, None, None, LR)
        same_on_all_ranks(comm, weights)
    return _BASELINE[framework]


def cells(kinds: list[str], frameworks: list[str]) -> list[tuple[str, str, str]]:
    """(kind, framework, backend): each cell trained on one backend, the backends taking turns.

    Every backend trains every compressor (in one framework or the other): what depends on
    the backend is the exchange, which job_compression.py checks for every compressor x
    framework x backend; what is trained here is the compressor's and memory's arithmetic.
    """
    names = backends()
    return [(kind, fw, names[(i + j) % len(names)])
            for i, kind in enumerate(kinds) for j, fw in enumerate(frameworks)]


@pytest.mark.parametrize(("kind", "framework", "comm"), cells(list(SETTINGS), sorted(TRAIN)),
                         indirect=["comm"])
def test_compressed_training_matches_uncompressed(comm, framework, kind):
    setting = SETTINGS[kind]
    compressor, memory = setting.build(comm.rank)
    stats = WireStats()
    compressor.count_into(stats)
    acc, weights = TRAIN[framework](comm, compressor, memory, setting.lr, momentum=setting.momentum)
    same_on_all_ranks(comm, weights)
    reference = baseline(comm, framework)
    print(f"ACC {comm.rank} {type(comm).__name__} {framework} {kind} {acc:.2f} vs {reference:.2f}")
    assert acc >= reference - TOLERANCE, f"{kind}: {acc:.1f}% vs {reference:.1f}% uncompressed"
    assert len(stats.steps) == len(batches(comm.rank, comm.size)) and stats.total.raw > 0
    if kind == "none":
        assert stats.total.sent == stats.total.raw
    elif kind in ("fp16", "bf16"):
        assert stats.total.sent * 2 == stats.total.raw
    else:
        assert stats.total.sent < stats.total.raw, f"{kind} sent {stats.total.sent} of {stats.total.raw}"


@pytest.mark.parametrize(("kind", "comm"), [(k, b) for k, _, b in cells(["none", "fp16", "bf16"], ["tf"])],
                         indirect=["comm"])
def test_cast_compressors_train_inside_tf_function(comm, kind):
    acc, weights = train_tf(comm, SETTINGS[kind].build(comm.rank)[0], None, LR, graph=True)
    assert acc > 80
    same_on_all_ranks(comm, weights)
    reference = baseline(comm, "tensorflow")
    assert acc >= reference - TOLERANCE, f"{kind} in tf.function: {acc:.1f}% vs {reference:.1f}%"


@pytest.mark.parametrize("framework", sorted(TRAIN))
def test_wire_bytes_per_step_reflect_the_compression(comm, framework):
    """TopK(1%) and the sign family send a small fraction of what none sends, per step."""
    per_step = {}
    for kind, compressor in {"none": NoneCompressor(), "fp16": FP16(), "topk1%": TopK(0.01),
                             "onebit": OneBit(), "powersgd": PowerSGD(rank=1)}.items():
        stats = WireStats()
        compressor.count_into(stats)
        memory = NoMemory() if kind in ("none", "fp16") else Residual()
        TRAIN[framework](comm, compressor, memory, SIGN_LR, steps=3)
        per_step[kind] = stats.steps[-1].sent
        assert all(s.sent == per_step[kind] for s in stats.steps), kind  # fixed-size payloads
    params = 64 * HIDDEN + HIDDEN + HIDDEN * 10 + 10
    assert per_step["none"] == 4 * params
    assert per_step["fp16"] == 2 * params
    assert per_step["topk1%"] <= per_step["none"] / 40  # 1% of values + int32 positions
    assert per_step["onebit"] <= per_step["none"] / 25  # a bit per element + two means
    assert per_step["powersgd"] < per_step["none"] / 5
