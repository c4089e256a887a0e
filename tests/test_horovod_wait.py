"""The Horovod backend waits on handles, bounded: in a blocking call on another thread
(an MPI job), or polling (``spin``, horovodrun --gloo)."""

from __future__ import annotations

import threading
import time

import pytest
from plait.collectives.horovod_wait import BlockingWaits, spin


class _Handles:
    """Stands in for Horovod's handle table: ``synchronize(h)`` blocks until ``finish(h)``."""

    def __init__(self) -> None:
        self.events: dict[int, threading.Event] = {}
        self.results: dict[int, object] = {}

    def start(self, h: int, result: object) -> int:
        self.events[h] = threading.Event()
        self.results[h] = result
        return h

    def finish(self, h: int) -> None:
        self.events[h].set()

    def synchronize(self, h: int) -> object:
        self.events[h].wait()
        result = self.results.pop(h)
        if isinstance(result, BaseException):
            raise result
        return result


def test_a_wait_returns_the_result_and_reuses_its_thread() -> None:
    handles = _Handles()
    waits = BlockingWaits(handles.synchronize)
    for h in range(3):
        handles.start(h, f"out{h}")
        threading.Timer(0.01, handles.finish, (h,)).start()
        assert waits.wait(h, 5.0) == f"out{h}"
    assert waits.threads == 1


def test_an_error_reaches_the_caller() -> None:
    handles = _Handles()
    waits = BlockingWaits(handles.synchronize)
    handles.finish(handles.start(7, RuntimeError("Horovod has been shut down")))
    with pytest.raises(RuntimeError, match="shut down"):
        waits.wait(7, 5.0)
    handles.finish(handles.start(8, 8))
    assert waits.wait(8, 5.0) == 8  # the thread is fine after passing an error on


def test_a_wait_that_never_ends_times_out_and_the_next_wait_gets_another_thread() -> None:
    handles = _Handles()
    waits = BlockingWaits(handles.synchronize)
    handles.start(1, "never")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="0.2s"):
        waits.wait(1, 0.2)
    assert time.monotonic() - t0 < 2.0
    handles.finish(handles.start(2, "next"))
    assert waits.wait(2, 5.0) == "next"
    assert waits.threads == 2  # the first one is still blocked on handle 1
    handles.finish(1)  # it completes late: nobody is hurt


def test_concurrent_waits_each_get_their_own_result() -> None:
    handles = _Handles()
    waits = BlockingWaits(handles.synchronize)
    got: dict[int, object] = {}
    for h in range(4):
        handles.start(h, h * 10)
    callers = [threading.Thread(target=lambda h=h: got.update({h: waits.wait(h, 5.0)}))
               for h in range(4)]
    for c in callers:
        c.start()
    for h in reversed(range(4)):  # finished in the other order
        handles.finish(h)
    for c in callers:
        c.join(5.0)
    assert got == {h: h * 10 for h in range(4)}


def test_a_ticking_wait_ticks_while_it_waits_and_still_times_out() -> None:
    handles = _Handles()
    waits = BlockingWaits(handles.synchronize)
    ticks: list[float] = []
    handles.start(0, "late")
    threading.Timer(0.3, handles.finish, (0,)).start()
    assert waits.wait(0, 5.0, lambda: ticks.append(time.monotonic()), every=0.05) == "late"
    assert ticks, "no tick while it waited"  # about every 50 ms for 0.3 s
    ticks.clear()
    handles.start(1, "never")
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        waits.wait(1, 0.3, lambda: ticks.append(time.monotonic()), every=0.05)
    assert 0.25 < time.monotonic() - start < 10.0
    assert ticks, "no tick while it waited"
    handles.finish(1)


def test_a_wait_with_its_own_block_waits_for_two_handles_in_one_hand_off() -> None:
    handles = _Handles()
    waits = BlockingWaits(handles.synchronize)
    handles.start(0, "check")
    handles.start(1, "data")

    def both(h: int) -> object:
        return handles.synchronize(0), handles.synchronize(h)

    threading.Timer(0.05, handles.finish, (1,)).start()
    threading.Timer(0.1, handles.finish, (0,)).start()
    assert waits.wait(1, 5.0, block=both) == ("check", "data")
    handles.finish(handles.start(2, "plain"))
    assert waits.wait(2, 5.0) == "plain"  # the next wait blocks with the default again
    assert waits.threads == 1


def test_spin_returns_once_done_and_times_out_at_the_deadline() -> None:
    done = threading.Event()
    threading.Timer(0.05, done.set).start()
    start = time.monotonic()
    spin(done.is_set, start + 5)
    assert done.is_set() and time.monotonic() - start < 2
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        spin(lambda: False, start + 0.2)
    assert 0.2 <= time.monotonic() - start < 2
