"""Horovod elastic torch training through ``plait.torch`` (tests/test_fault_tolerance.py).

A Horovod elastic script with ``import plait.torch as hvd``: plait's optimizer on the
Horovod backend, ``hvd.elastic.TorchState`` carrying a plait state object, and
``hvd.elastic.run``. Run by ``horovodrun --host-discovery-script`` (not a pytest file). Rank 0
rewrites the discovery file (HVD_HOSTS, lines ``host:slots``) to HVD_GROWN (default
``localhost:3``: one more slot or host) at step HVD_ADD and back to its first content
at step HVD_REMOVE; training continues across both changes and finishes. With HVD_KILL
(``STEP:HOST``) the worker on HOST SIGKILLs itself when it starts step STEP, while the others
are in that step's collectives (``STEP:HOST:commit``: when it ends step STEP, while the others
commit it; ``STEP:HOST:checkpoint``: in the middle of writing step STEP's checkpoint, after
its first file, where HOST is rank 0's, the writer's; ``STEP:HOST:gather``: as it starts
saving that checkpoint, while rank 0 gathers); with HVD_KILL_RESET (``HOST``) the
worker on HOST SIGKILLs itself in its first reset callback, after the new rendezvous and
before the state's sync. The worker on HVD_LEAVE (a host) takes its host out of discovery
(the file becomes HVD_LEFT) as it starts, and waits 2.5 s (Horovod's driver sees the
removal while the others wait for this worker in their reset) before it joins. With HVD_CKPT
(a directory) every worker saves a ``plait.Checkpoint`` after each commit (the plait state
object makes it collective: rank 0 gathers and writes); at the end every worker restores the
latest one into a fresh model and reports its step and whether its weights equal the trained
ones. On the host named HVD_ODD_HOST plait reports another version (that worker must leave the job).
A worker's host is Horovod's name for it (``HOROVOD_HOSTNAME``), else its host name.
HVD_MOMENTUM: the SGD momentum (default 0: an optimizer without state).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from typing import Any


class Plan:
    """The membership changes that the environment asks for (shared with the TensorFlow job)."""

    def __init__(self) -> None:
        self.host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
        self.hosts_file = os.environ["HVD_HOSTS"]
        add_at, remove_at = int(os.environ["HVD_ADD"]), int(os.environ["HVD_REMOVE"])
        with open(self.hosts_file) as f:
            self.hosts = {add_at: os.environ.get("HVD_GROWN", "localhost:3\n"), remove_at: f.read()}
        at, self.kill_host, self.kill_where = (os.environ.get("HVD_KILL", "0:") + ":start").split(":")[:3]
        self.kill_at = int(at)
        self.steps = int(os.environ.get("HVD_STEPS", "14"))
        self.sleep = float(os.environ.get("HVD_SLEEP", "0.5"))
        self.kill_in_reset = self.host == os.environ.get("HVD_KILL_RESET")

    def leave(self) -> None:
        """On the worker on HVD_LEAVE: take this host out of discovery, and wait until the
        driver saw it (it polls discovery every second)."""
        if self.host == os.environ.get("HVD_LEAVE"):
            with open(self.hosts_file + ".tmp", "w") as f:
                f.write(os.environ["HVD_LEFT"])
            os.replace(self.hosts_file + ".tmp", self.hosts_file)
            time.sleep(2.5)

    def kill(self, step: int, where: str) -> None:
        """SIGKILL this worker if it is the one to die at ``step`` (``where``: start, commit,
        checkpoint, gather)."""
        if step == self.kill_at and self.host == self.kill_host and self.kill_where == where:
            os.kill(os.getpid(), signal.SIGKILL)

    def rewrite_hosts(self, step: int) -> None:
        """On rank 0: the discovery file's content for after ``step``, if it changes then."""
        if step in self.hosts:
            with open(self.hosts_file + ".tmp", "w") as f:
                f.write(self.hosts[step])
            os.replace(self.hosts_file + ".tmp", self.hosts_file)

    def end_step(self, state: Any, rank: int, size: int, seen: float) -> None:
        """After a step (``state.step`` counts it): rank 0 reports it and rewrites discovery,
        the third worker reports once that it joined (``seen``: its plait state's count),
        the worker to die at commit dies, and the others commit and pause."""
        if rank == 0:
            print(f"HVD step={state.step} size={size}", flush=True)
            self.rewrite_hosts(state.step)
        if size == 3 and rank == 2 and not os.environ.get("HVD_JOINED_REPORTED"):
            os.environ["HVD_JOINED_REPORTED"] = "1"
            print(f"HVD joined rank=2 step={state.step} seen={seen} host={self.host}", flush=True)
        self.kill(state.step, "commit")
        state.commit()
        time.sleep(self.sleep)


def die() -> None:
    """A reset callback that SIGKILLs this worker."""
    os.kill(os.getpid(), signal.SIGKILL)


def die_while_writing(plan: Plan, state: Any) -> None:
    """Make this worker SIGKILL itself after the first file of the checkpoint it is to die in."""
    from plait.checkpoint import atomic

    write = atomic._write_synced

    def write_then_maybe_die(path: str, data: bytes) -> None:
        write(path, data)
        plan.kill(state.step, "checkpoint")

    atomic._write_synced = write_then_maybe_die


def check_checkpoint(ckpt: Any, model: Any) -> str:
    """Restore the latest checkpoint into a fresh copy of ``model`` (collective); its step and
    whether its weights equal ``model``'s."""
    import copy

    import torch

    fresh = copy.deepcopy(model)
    for p in fresh.parameters():
        torch.nn.init.zeros_(p)
    step = ckpt.restore(fresh)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    return f" checkpoint_step={step} checkpoint_equal={same}"


def main() -> None:
    import numpy as np
    import torch

    import plait
    import plait.torch as hvd
    from plait.compression import Residual

    torch.set_num_threads(1)
    plan = Plan()
    if plan.host == os.environ.get("HVD_ODD_HOST"):
        plait.__version__ = "0.0.0+other"  # as if this host had another plait installed
    plan.leave()
    hvd.init()  # plait's world on the Horovod backend (started by horovodrun)
    assert hvd.backend() == "horovod"
    with np.load(os.environ["FT_DATA"]) as data:
        x_all = torch.tensor(data["x"] / 16.0, dtype=torch.float32)
        y_all = torch.tensor(data["y"], dtype=torch.int64)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    momentum = float(os.environ.get("HVD_MOMENTUM", "0"))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum),
                                   named_parameters=model.named_parameters())
    memory = Residual()
    memory.residuals["seen"] = torch.zeros(1)
    state = hvd.elastic.TorchState(model, opt, state={"ef": memory}, step=0, sizes=[])
    if plan.kill_in_reset:
        state.register_reset_callbacks([die])
    ckpt = plait.Checkpoint(os.environ["HVD_CKPT"]) if os.environ.get("HVD_CKPT") else None
    if plan.kill_where == "checkpoint":
        die_while_writing(plan, state)

    @hvd.elastic.run
    def train(state: Any) -> None:
        while state.step < plan.steps:
            plan.kill(state.step, "start")
            rank, size = hvd.rank(), hvd.size()
            if int(memory.residuals["seen"].item()) != state.step:  # also on a worker that just joined
                raise RuntimeError(f"rank {rank}: plait state not in sync: seen "
                                   f"{memory.residuals['seen'].item()} at step {state.step}")
            if not state.sizes or state.sizes[-1] != size:
                state.sizes = [*state.sizes, size]
            perm = np.random.RandomState(state.step).permutation(len(y_all))[:96]
            mine = torch.from_numpy(np.array_split(perm, size)[rank])
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x_all[mine]), y_all[mine]).backward()
            opt.step()
            memory.residuals["seen"] = memory.residuals["seen"] + 1
            state.step += 1
            plan.end_step(state, rank, size, float(memory.residuals["seen"].item()))
            if ckpt is not None:
                plan.kill(state.step, "gather")
                ckpt.save(state.step, model, opt, state={"ef": memory})

    train(state)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.reshape(1, -1))
    same = all(torch.equal(gathered[0], row) for row in gathered)
    seen = hvd.allgather(memory.residuals["seen"].reshape(1, -1))
    restored = "" if ckpt is None else check_checkpoint(ckpt, model)
    if hvd.rank() == 0:
        print(f"HVD done sizes={state.sizes} replicas_equal={same} "
              f"residual_steps={seen.reshape(-1).tolist()}{restored}", flush=True)


if __name__ == "__main__":
    main()
