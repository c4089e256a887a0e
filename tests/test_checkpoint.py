"""Single-process tests of plait.Checkpoint: the atomic protocol, corruption, codecs, kills mid-write."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from plait.checkpoint import Checkpoint, CheckpointError, atomic_write, list_complete, read_manifest
from plait.checkpoint.atomic import write_checkpoint
from plait.elastic import plan
from plait.errors import ConfigError, PlaitTypeError

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parent.parent


def make(seed: int = 0) -> tuple[object, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


def same(a: object, b: object) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(),
                                                   strict=True))


def test_atomic_write_replaces_and_leaves_no_temporaries(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    atomic_write(str(target), b"one")
    atomic_write(str(target), b"two")
    assert target.read_bytes() == b"two"
    assert os.listdir(tmp_path) == ["f.json"]


def test_round_trip_every_keep_and_rng(tmp_path: Path) -> None:
    from plait.compression import Residual

    model, opt = make()
    memory = Residual()
    memory.residuals["w"] = torch.arange(3.0)
    ckpt = Checkpoint(tmp_path, every=3, keep=2)
    written = [s for s in range(1, 11) if ckpt.step_done(s, model, opt, {"ef": memory}, {"epoch": 1})]
    assert written == [3, 6, 9]
    assert [e.step for e in list_complete(str(tmp_path))] == [6, 9]
    manifest = json.loads((tmp_path / "latest.json").read_text())
    assert manifest["step"] == 9 and read_manifest(str(tmp_path)).step == 9
    model2, opt2 = make(seed=1)
    memory2 = Residual()
    assert not same(model, model2)
    assert ckpt.restore(model2, opt2, {"ef": memory2}) == 9
    assert same(model, model2)
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert torch.equal(memory2.residuals["w"], torch.arange(3.0))
    assert ckpt.extra == {"epoch": 1} and ckpt.saved_size == 1


def test_rng_states_restored(tmp_path: Path) -> None:
    import random

    import numpy as np

    model, opt = make()
    ckpt = Checkpoint(tmp_path)
    ckpt.save(1, model, opt)
    after = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(7), np.random.rand(7), random.random()
    ckpt.restore(model, opt)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(after[0], again[0]) and (after[1] == again[1]).all() and after[2] == again[2]


def test_fresh_directory_restores_step_zero(tmp_path: Path) -> None:
    model, opt = make()
    assert Checkpoint(tmp_path / "none").restore(model, opt) == 0


def test_partly_written_checkpoint_is_never_chosen(tmp_path: Path) -> None:
    model, opt = make()
    ckpt = Checkpoint(tmp_path, keep=3)
    ckpt.save(2, model, opt)
    # what a writer killed mid-way leaves: a temporary directory without meta.json
    partial = tmp_path / ".tmp-step-00000004-deadbeef"
    partial.mkdir()
    (partial / "state.pt").write_bytes(b"\x00" * 10)
    assert ckpt.latest().step == 2
    assert ckpt.restore(*make(1)) == 2
    # a complete directory renamed into place before the manifest moved: manifest still wins
    assert read_manifest(str(tmp_path)).step == 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "meta", "manifest", "missing"])
def test_corrupt_checkpoint_names_file_and_reason(tmp_path: Path, damage: str) -> None:
    model, opt = make()
    entry = Checkpoint(tmp_path).save(5, model, opt)
    state = tmp_path / entry.name / "state.pt"
    if damage == "truncate":
        state.write_bytes(state.read_bytes()[:100])
        pattern = r"state\.pt: \d+ bytes, expected \d+"
    elif damage == "flip":
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0xFF
        state.write_bytes(bytes(data))
        pattern = r"state\.pt: sha256 mismatch"
    elif damage == "meta":
        (tmp_path / entry.name / "meta.json").write_text("{not json")
        pattern = r"meta\.json: unreadable"
    elif damage == "manifest":
        (tmp_path / "latest.json").write_text(json.dumps({"format": 99, "latest": entry.name,
                                                            "step": 5}))
        pattern = r"latest\.json: format 99"
    else:
        state.unlink()
        pattern = r"state\.pt: cannot be read"
    with pytest.raises(CheckpointError, match=pattern):
        Checkpoint(tmp_path).restore(*make(1))


def damage_checkpoint(folder: Path, how: str) -> str:
    """Damage one checkpoint directory; return the pattern its read error matches."""
    state = folder / "state.pt"
    if how == "truncate":
        state.write_bytes(state.read_bytes()[:100])
        return r"state\.pt: \d+ bytes, expected \d+"
    if how == "flip":
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0xFF
        state.write_bytes(bytes(data))
        return r"state\.pt: sha256 mismatch"
    state.unlink()
    return r"state\.pt: cannot be read"


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing"])
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, damage: str) -> None:
    model, opt = make()
    ckpt = Checkpoint(tmp_path, keep=3)
    first = ckpt.save(2, model, opt)
    saved = make(seed=2)[0]
    saved.load_state_dict(model.state_dict())
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    second = ckpt.save(4, model, opt)
    pattern = damage_checkpoint(tmp_path / second.name, damage)
    restored, opt2 = make(seed=1)
    with pytest.warns(RuntimeWarning) as caught:
        assert ckpt.restore(restored, opt2) == 2
    assert same(restored, saved) and not same(restored, model)
    text = str(caught[0].message)
    assert second.name in text and first.name in text, text  # names both
    assert re.search(pattern, text), text
    assert read_manifest(str(tmp_path)).name == second.name  # restoring changes nothing on disk


def test_no_checkpoint_verifies_names_each_one_tried(tmp_path: Path) -> None:
    model, opt = make()
    ckpt = Checkpoint(tmp_path, keep=3)
    entries = [ckpt.save(step, model, opt) for step in (1, 2, 3)]
    patterns = [damage_checkpoint(tmp_path / e.name, how)
                for e, how in zip(entries, ["missing", "flip", "truncate"], strict=True)]
    with pytest.raises(CheckpointError) as raised:
        ckpt.restore(*make(1))
    text = str(raised.value)
    assert "no checkpoint" in text and "verifies" in text, text
    for entry, pattern in zip(entries, patterns, strict=True):
        assert entry.name in text and re.search(pattern, text), (entry.name, text)
    # the newest first: the order they were tried in
    assert text.index(entries[2].name) < text.index(entries[1].name) < text.index(entries[0].name)


def test_fallback_skips_several_corrupt_checkpoints(tmp_path: Path) -> None:
    model, opt = make()
    ckpt = Checkpoint(tmp_path, keep=3)
    entries = [ckpt.save(step, model, opt) for step in (1, 2, 3)]
    damage_checkpoint(tmp_path / entries[2].name, "flip")
    damage_checkpoint(tmp_path / entries[1].name, "missing")
    with pytest.warns(RuntimeWarning, match=entries[0].name):
        assert ckpt.restore(*make(1)) == 1


def test_pickled_object_is_refused(tmp_path: Path) -> None:
    """A checkpoint whose payload needs unpickling of arbitrary classes is not loaded."""
    model, opt = make()
    entry = Checkpoint(tmp_path).save(1, model, opt)
    evil = tmp_path / "evil.pt"
    torch.save({"model": model.state_dict(), "x": Path("/")}, evil)  # a non-tensor object
    files = {"state.pt": evil.read_bytes()}
    write_checkpoint(str(tmp_path), 2, files, {"framework": "torch"}, keep=3)
    assert entry is not None
    with pytest.raises(CheckpointError, match=r"state\.pt: cannot be loaded safely"):
        Checkpoint(tmp_path).restore(*make(1))


def test_incompatible_model_and_framework(tmp_path: Path) -> None:
    model, opt = make()
    Checkpoint(tmp_path).save(1, model, opt)
    other = torch.nn.Linear(3, 3)
    with pytest.raises(CheckpointError, match="does not fit the model"):
        Checkpoint(tmp_path).restore(other, torch.optim.SGD(other.parameters(), lr=0.1))
    write_checkpoint(str(tmp_path), 3, {"arrays.npz": b""}, {"framework": "tensorflow"}, keep=3)
    with pytest.raises(CheckpointError, match="framework 'tensorflow'"):
        Checkpoint(tmp_path).restore(*make(1))


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="every"):
        Checkpoint("x", every=0)
    with pytest.raises(ConfigError, match="keep"):
        Checkpoint("x", keep=-1)
    with pytest.raises(ConfigError, match="read"):
        Checkpoint("x", read="nfs")
    with pytest.raises(ConfigError, match="model"):
        Checkpoint("x").save(1, object())
    with pytest.raises(PlaitTypeError, match="state_dict"):
        Checkpoint("x").save(1, torch.nn.Linear(1, 1), state={"bad": 3})


def test_elastic_plan() -> None:
    keep = plan(64, 0.1, size=2, base_size=4, policy="keep_batch")
    assert (keep.global_batch, keep.local_batch, keep.lr) == (64, 32, 0.1)
    scale = plan(64, 0.1, size=2, base_size=4, policy="scale_lr")
    assert (scale.global_batch, scale.local_batch, scale.lr) == (32, 16, 0.05)
    with pytest.raises(ConfigError, match="multiple of the new world size 3"):
        plan(64, 0.1, size=3, base_size=4, policy="keep_batch")
    with pytest.raises(ConfigError, match="PLAIT_ELASTIC_POLICY"):
        from plait.elastic import policy_from_env

        policy_from_env({"PLAIT_ELASTIC_POLICY": "grow"})


def test_horovod_elastic_keras_callbacks_track_commits_epochs_and_batches() -> None:
    """Horovod's elastic callbacks on a real ``fit`` (a plain object as the state)."""
    keras = pytest.importorskip("keras")
    from types import SimpleNamespace

    from plait.adapters.keras_callbacks import (
        CommitStateCallback,
        UpdateBatchStateCallback,
        UpdateEpochStateCallback,
    )

    commits: list[int] = []
    state = SimpleNamespace(epoch=3, batch=0, commit=lambda: commits.append(state.batch))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    seen: list[int] = []
    record = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: seen.append(e))
    x = np.zeros((6, 2), "float32")
    model.fit(x, x[:, :1], batch_size=2, epochs=2, verbose=0,
              callbacks=[UpdateBatchStateCallback(state), CommitStateCallback(state, 2),
                         UpdateEpochStateCallback(state), record])
    # 3 batches per epoch: commits after every 2nd batch and at each epoch's end
    assert commits == [1, 0, 0, 2, 0]
    assert (state.epoch, state.batch, seen) == (5, 0, [0, 1])
    with pytest.raises(ConfigError, match="batches_per_commit"):
        CommitStateCallback(state, 0)


def test_faces_expose_horovod_elastic_lazily() -> None:
    code = ("import sys, plait.torch as hvd; assert 'horovod' not in sys.modules; "
            "assert hvd.elastic.run and hvd.elastic.TorchState; "
            "import plait.keras as k; assert k.elastic.KerasState is k.elastic.TensorFlowKerasState")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import plait.torch as hvd

    with pytest.raises(AttributeError, match="no attribute 'elastik'"):
        hvd.elastik  # noqa: B018


def test_a_host_change_announced_during_an_elastic_reset_is_acted_on_after_it() -> None:
    """Horovod's elastic state empties the host announcements when a reset ends, so a host
    removed while the workers waited in the reset kept its worker to the end of the job;
    plait's states keep what arrived after the change that the reset answers."""
    pytest.importorskip("horovod")
    from horovod.common.elastic import ObjectState
    from horovod.common.exceptions import HostsUpdatedInterrupt
    from horovod.runner.elastic.worker import HostUpdateResult
    from plait.collectives.horovod_elastic import LateHostUpdates

    def new(kind: type) -> ObjectState:
        return kind(bcast_object=lambda obj: obj, get_rank=lambda: 0, step=0)

    class Ours(LateHostUpdates, ObjectState):  # type: ignore[misc]
        pass

    for kind, kept in ((ObjectState, False), (Ours, True)):
        state = new(kind)
        state.on_hosts_updated(100, HostUpdateResult.added)
        with pytest.raises(HostsUpdatedInterrupt):
            state.commit()  # the change the reset answers
        state.on_hosts_updated(100, HostUpdateResult.removed)  # during the reset, the same second
        state.on_reset()
        if not kept:
            state.commit()  # Horovod's: lost
            continue
        with pytest.raises(HostsUpdatedInterrupt) as interrupt:
            state.commit()
        assert interrupt.value.skip_sync  # a removal: Horovod's flag to skip the sync
        state.on_reset()
        state.commit()  # nothing new
        state.on_hosts_updated(101, HostUpdateResult.added)  # before a worker failed: the new
        state.restore()  # round is formed after the failure, so it has the new host
        state.on_reset()
        state.commit()


WRITER = """
import sys, torch
from plait.checkpoint import Checkpoint
torch.manual_seed(0)
model = torch.nn.Linear(1024, 4096)  # 16 MB of weights: a write takes a while
ckpt = Checkpoint(sys.argv[1], keep=2)
step = int(sys.argv[2])
while True:
    step += 1
    with torch.no_grad():
        model.bias.fill_(step)
    ckpt.save(step, model)
"""


def test_kill_during_checkpoint_writing_keeps_previous(tmp_path: Path) -> None:
    """SIGKILL the writer while a checkpoint is half written, several times: the latest loads."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    model = torch.nn.Linear(1024, 4096)
    with torch.no_grad():
        model.bias.fill_(1)
    Checkpoint(tmp_path, keep=2).save(1, model)
    mid_write = 0
    for round_ in range(3):
        before = read_manifest(str(tmp_path)).step
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(before)], env=env)
        try:
            deadline = time.monotonic() + 120
            # wait until a checkpoint newer than the current one is being written (its
            # temporary directory exists and it is not yet renamed), then kill
            while time.monotonic() < deadline and proc.poll() is None:
                names = os.listdir(tmp_path)
                if any(n.startswith(f".tmp-step-{before + 1 + round_ % 2:08d}") for n in names):
                    break
                time.sleep(0.001)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        if any(n.startswith(".tmp-step-") for n in os.listdir(tmp_path)):
            mid_write += 1
        got = Checkpoint(tmp_path).restore(model)
        assert got >= before
        assert torch.equal(model.bias, torch.full((4096,), float(got)))
    assert mid_write >= 1, "no kill landed while a checkpoint was being written"


def test_keras_round_trip_npz_without_pickle(tmp_path: Path) -> None:
    """Keras 3 weights + optimizer variables + a residual memory, in arrays.npz + state.json;
    the RNG states (numpy, Python, TensorFlow's global generator, Keras' global seed
    generator and a Dropout layer's) come back: the draws after a restore are those after
    the save."""
    np = pytest.importorskip("numpy")
    keras = pytest.importorskip("keras")
    tf = pytest.importorskip("tensorflow")
    import random

    from plait.compression import Residual

    def build() -> tuple[object, object]:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dropout(0.5)])
        opt = keras.optimizers.Adam(0.1)
        model.compile(opt, "mse")
        return model, opt

    def draws(model: object) -> list[object]:
        dropout = model.layers[-1](tf.ones((4, 8)), training=True)  # type: ignore[attr-defined]
        return [np.random.rand(3), random.random(), tf.random.get_global_generator().normal([3]).numpy(),
                keras.random.uniform((3,)).numpy(), dropout.numpy()]

    keras.utils.set_random_seed(0)
    model, opt = build()
    model.fit(np.random.rand(8, 4), np.random.rand(8, 3), verbose=0, epochs=2)
    tf.random.get_global_generator().normal([2])
    keras.random.uniform((2,))  # Keras' global seed generator exists (and moved) at the save
    memory = Residual()
    memory.residuals["w"] = tf.ones(3)
    entry = Checkpoint(tmp_path).save(7, model, opt, {"ef": memory}, {"epoch": 2})
    names = sorted(os.listdir(tmp_path / entry.name))
    assert names == ["arrays.npz", "meta.json", "state.json"]
    expected = draws(model)
    keras.utils.set_random_seed(123)  # another process, as it were: every generator elsewhere
    tf.random.get_global_generator().normal([5])
    model2, opt2 = build()
    assert not np.array_equal(draws(model2)[-1], expected[-1])
    memory2 = Residual()
    ckpt = Checkpoint(tmp_path)
    assert ckpt.restore(model2, opt2, {"ef": memory2}) == 7 and ckpt.extra == {"epoch": 2}
    for a, b in zip(model.get_weights(), model2.get_weights(), strict=True):
        assert np.array_equal(a, b)
    for v, w in zip(opt.variables, opt2.variables, strict=True):
        assert np.array_equal(v.numpy(), w.numpy()), v.name
    assert np.array_equal(memory2.residuals["w"].numpy(), np.ones(3))
    got = draws(model2)
    for what, a, b in zip(["numpy", "python", "tf global generator", "keras global seed generator",
                           "dropout seed generator"], expected, got, strict=True):
        assert np.array_equal(a, b), what
    with pytest.raises(CheckpointError, match="framework 'tensorflow'"):
        Checkpoint(tmp_path).restore(*make())


def test_rank_files_pack_merge_and_split() -> None:
    from plait.checkpoint.ranks import merge_ranks, pack, rank_prefix, split_ranks, unpack

    files = {"state.pt": b"\x00\x01abc", "empty": b""}
    header, back = unpack(pack({"step": 4}, files))
    assert header == {"step": 4} and back == files
    merged = merge_ranks(files, {2: {"state.pt": b"two"}, 1: {"state.pt": b"one"}})
    assert sorted(merged) == ["empty", "rank00001.state.pt", "rank00002.state.pt", "state.pt"]
    assert rank_prefix(12) == "rank00012."
    top, ranked = split_ranks(merged)
    assert top == files and ranked == {1: {"state.pt": b"one"}, 2: {"state.pt": b"two"}}
    with pytest.raises(CheckpointError, match="garbled"):
        unpack(np.frombuffer(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope", dtype=np.uint8))
    with pytest.raises(CheckpointError, match=r"has \d+ bytes, its header describes \d+"):
        unpack(np.concatenate([pack({}, {"a": b"xyz"}), np.zeros(1, np.uint8)]))


def test_only_error_feedback_memories_and_async_state_are_per_rank() -> None:
    from plait.checkpoint import AlgorithmState, as_stateful, is_per_rank
    from plait.compression import Residual

    assert is_per_rank(as_stateful(Residual()))
    assert is_per_rank(AlgorithmState(object()))
    assert not is_per_rank(as_stateful(torch.nn.Linear(1, 1)))


def test_parameter_server_snapshot_waits_for_every_worker_still_training() -> None:
    from plait.parallel.asyncdp.ps import _snapshot_due

    assert _snapshot_due(10, {2: 10, 3: 10}, {2, 3})
    assert not _snapshot_due(10, {2: 10, 3: 9}, {2, 3})
    assert _snapshot_due(10, {2: 10, 3: 7}, {2})  # worker 3 finished after 7 steps
    assert not _snapshot_due(10, {2: 7, 3: 7}, set())  # everyone finished before step 10


KERAS_DETERMINISM = """
import os, sys
os.environ["KERAS_BACKEND"] = "tensorflow"
import keras, numpy as np, tensorflow as tf
from plait.checkpoint import Checkpoint
tf.config.experimental.enable_op_determinism()
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dropout(0.5)])
opt = keras.optimizers.SGD(0.1)
model.compile(opt, "mse")
model.fit(np.ones((4, 4)), np.ones((4, 3)), verbose=0)
Checkpoint(sys.argv[1]).save(1, model, opt)
other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dropout(0.5)])
assert Checkpoint(sys.argv[1]).restore(other, keras.optimizers.SGD(0.1)) == 1
assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), other.get_weights()))
print("ok")
"""


def test_keras_checkpoint_with_op_determinism_on(tmp_path: Path) -> None:
    """TensorFlow refuses to make its global generator under op determinism: saving the
    RNG states must not ask it to."""
    pytest.importorskip("keras")
    proc = subprocess.run([sys.executable, "-c", KERAS_DETERMINISM, str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("fw", ["numpy", "torch"])
def test_a_residual_memorys_state_is_a_snapshot_that_later_steps_leave_alone(fw: str) -> None:
    """Error feedback updates its residuals in place from the second step on: a state taken
    in between (a checkpoint, an elastic commit) keeps the values it had."""
    from plait.checkpoint.state import as_stateful
    from plait.compression import Residual, TopK

    torch = pytest.importorskip("torch") if fw == "torch" else None

    def tensor(seed: int) -> object:
        a = np.random.default_rng(seed).normal(size=(8, 8)).astype(np.float32)
        return a if torch is None else torch.from_numpy(a)

    memory, compressor = Residual(), TopK(0.25)
    for step in range(3):
        c = memory.compensate_in_place(tensor(step), "w")
        memory.update(c, "w", compressor, *compressor.compress(c, "w"))
        if step == 1:
            state = as_stateful(memory).state_dict()
            kept = np.array(state["residuals"]["w"])
    assert np.array_equal(np.asarray(state["residuals"]["w"]), kept)
    assert not np.array_equal(np.asarray(memory.residuals["w"]), kept)
