"""OutsideWatchdog: a call that blocks holding the GIL still ends by its deadline.

Each case runs a short Python program in a subprocess; a call that holds the GIL is
libc's ``sleep`` through ``ctypes.PyDLL`` (which keeps the GIL during the call, as
Horovod's torch ops do).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from plait.collectives.outside_watchdog import OutsideWatchdog

pytestmark = pytest.mark.timeout(60)

PRELUDE = """\
import ctypes, os, sys, threading, time
from plait.collectives.outside_watchdog import OutsideWatchdog
libc = ctypes.PyDLL(None)  # calls keep the GIL
dog = OutsideWatchdog()
"""


def run(body: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
                          capture_output=True, text=True, timeout=timeout)


def test_a_call_holding_the_gil_is_killed_with_the_message() -> None:
    start = time.monotonic()
    done = run("""
        # a Python-level timeout cannot fire while the GIL is held
        threading.Timer(0.5, lambda: print("python thread ran", flush=True)).start()
        dog.arm(1.0, "CollectiveTimeoutError: waited 1s for the test call")
        libc.sleep(20)
        print("returned", flush=True)
    """)
    elapsed = time.monotonic() - start
    assert done.returncode == -signal.SIGKILL, done
    assert "CollectiveTimeoutError: waited 1s for the test call\n" in done.stderr
    assert "python thread ran" not in done.stdout and "returned" not in done.stdout
    assert elapsed < 15, elapsed


def test_then_runs_after_the_kill() -> None:
    done = run("""
        dog = OutsideWatchdog(then=["sh", "-c", "echo then ran after $0 >&2", "the kill"])
        dog.arm(0.5, "timed out")
        libc.sleep(20)
    """)
    assert done.returncode == -signal.SIGKILL, done
    assert "timed out\nthen ran after the kill\n" in done.stderr, done.stderr


def test_a_disarmed_call_is_left_alone() -> None:
    done = run("""
        for _ in range(1000):  # re-armed many times, each call well within its deadline
            dog.disarm(dog.arm(0.5, "must not appear"))
        libc.sleep(2)  # past every deadline, disarmed
        outer = dog.arm(0.5, "nested: must not appear")
        inner = dog.arm(0.5, "nested: must not appear")
        dog.disarm(inner)
        dog.disarm(outer)
        dog.disarm(outer)  # twice: ignored
        stale = dog.arm(0.5, "a failed graph op: armed again below")
        dog.arm(60, "must not appear", key=stale)  # armed again: the fresh deadline counts
        dog.arm(0.5, "cleared: must not appear")
        dog.clear()  # the library shut down
        time.sleep(1.0)
        print("alive", flush=True)
    """)
    assert done.returncode == 0, done
    assert "alive" in done.stdout and "must not appear" not in done.stderr
    assert "armed again below" not in done.stderr


def test_the_earliest_of_several_armed_calls_ends_the_process() -> None:
    done = run("""
        late = dog.arm(60, "the late call")
        early = dog.arm(1.0, "the early call")
        dog.arm(30, "the other call")
        libc.sleep(20)
    """)
    assert done.returncode == -signal.SIGKILL, done
    assert done.stderr.endswith("the early call\n"), done.stderr


def test_a_call_without_a_bound_starts_no_child() -> None:
    done = run("""
        dog.disarm(dog.arm(float("inf"), "no bound"))
        dog.disarm(dog.arm(0, "no bound"))
        print(dog._child is None, flush=True)
    """)
    assert done.returncode == 0 and done.stdout.strip() == "True", done


def test_the_child_ends_with_its_process() -> None:
    done = run("""
        dog.disarm(dog.arm(60, "never"))
        print(dog._child.pid, flush=True)
        os._exit(0)
    """)
    child = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{child}"):
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}") or _zombie(child), "the watchdog child outlived its process"


def test_the_child_holds_none_of_the_process_output() -> None:
    """A launcher counts a killed rank gone once its output pipes close (horovodrun's
    elastic driver does): the child, which outlives the rank a little, must not hold them."""
    dog = OutsideWatchdog()
    dog.disarm(dog.arm(60, "never"))
    child = dog._child
    assert child is not None
    try:
        for fd in (0, 1, 2):
            assert os.readlink(f"/proc/{child.pid}/fd/{fd}") == "/dev/null"
    finally:
        dog.close()


def test_close_stops_the_child() -> None:
    dog = OutsideWatchdog()
    dog.disarm(dog.arm(60, "never"))
    child = dog._child
    assert child is not None and child.poll() is None
    dog.close()
    assert child.poll() is not None


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_bracketed_graph_ops_are_disarmed_before_the_graph_returns() -> None:
    """A Horovod graph op is armed before it starts and disarmed after its outputs, on
    every run of a ``tf.function`` (also each iteration of a loop in it, and with constant
    inputs, which Grappler must not fold), before the call returns, though the outputs do
    not wait for the disarm; two independent ops are both armed before either ends; in a
    TensorFlow 1 graph, fetching the outputs runs it."""
    import tensorflow as tf
    from plait.adapters.tensorflow import bracketed, graph_anchor

    events: list[str] = []
    anchor = graph_anchor()

    def op(x: object) -> object:
        def build(first: object) -> object:
            # stateless, like a Horovod op: runs when its input (after the arm) is there
            out = tf.numpy_function(lambda a: (events.append("op"), a)[1], [first],
                                    Tout=tf.float32, stateful=False)
            return tf.ensure_shape(out, []) + 1.0
        return bracketed(build, x, lambda: events.append("arm"), lambda: events.append("disarm"),
                         anchor)

    once = tf.function(op)
    constant = tf.function(lambda: op(tf.constant(1.0)))  # not folded away by Grappler
    for f, args in ((once, (tf.constant(1.0),)), (constant, ())):
        for _ in range(2):
            events.clear()
            assert float(f(*args)) == 2.0
            assert events == ["arm", "op", "disarm"]

    @tf.function
    def unused(x: object) -> object:  # an output nobody uses: TensorFlow prunes a stateless
        op(x)  # op (Horovod's are) and the arm before it; nothing is left armed
        return x

    events.clear()
    assert float(unused(tf.constant(1.0))) == 1.0
    assert events == ["disarm"]

    def waiting(a: object) -> object:  # an op that ends only once both ops were armed
        deadline = time.monotonic() + 10
        while events.count("arm") < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        events.append("op")
        return a

    def slow_op(x: object) -> object:
        def build(first: object) -> object:
            out = tf.numpy_function(waiting, [first], Tout=tf.float32, stateful=False)
            return tf.ensure_shape(out, []) + 1.0
        return bracketed(build, x, lambda: events.append("arm"), lambda: events.append("disarm"),
                         anchor)

    @tf.function
    def independent(x: object) -> object:  # the second op's arm does not wait for the first
        return slow_op(x) + slow_op(x * 2.0)  # op to end (and be disarmed)

    events.clear()
    assert float(independent(tf.constant(1.0))) == 5.0
    assert events[:2] == ["arm", "arm"] and sorted(events[2:]) == ["disarm"] * 2 + ["op"] * 2

    @tf.function
    def loop(x: object) -> object:
        for _ in tf.range(3):
            x = op(x)
        return x

    events.clear()
    assert float(loop(tf.constant(0.0))) == 3.0
    assert events == ["arm", "op", "disarm"] * 3

    with tf.Graph().as_default():
        fetched = op(tf.constant(1.0))
        with tf.compat.v1.Session() as session:
            events.clear()
            assert float(session.run(fetched)) == 2.0
    assert events == ["arm", "op", "disarm"]
