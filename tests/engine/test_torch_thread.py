"""TorchThread: a model is built on the thread that later runs its loop."""

from __future__ import annotations

import threading
import time

import pytest

from pd.engine.torch_thread import TorchThread

pytestmark = pytest.mark.timeout(30)


def test_run_returns_what_fn_returns_computed_on_the_thread():
    t = TorchThread("t-run")
    assert t.run(lambda: threading.current_thread().name) == "t-run"
    assert t.run(lambda: 1 + 1) == 2  # the same thread serves again
    t.join(5)
    assert not t.is_alive()


def test_an_exception_in_run_is_raised_to_the_caller_and_the_thread_goes_on():
    t = TorchThread("t-raise")
    with pytest.raises(ValueError, match="bad build"):
        t.run(lambda: (_ for _ in ()).throw(ValueError("bad build")))
    assert t.run(lambda: "still here") == "still here"
    t.join(5)


def test_the_loop_runs_on_the_same_thread_and_join_waits_for_it():
    t = TorchThread("t-loop")
    built_on = t.run(threading.current_thread)
    stop = threading.Event()
    ran_on: list[threading.Thread] = []

    def loop() -> None:
        ran_on.append(threading.current_thread())
        stop.wait(10)

    t.start(loop)
    deadline = time.monotonic() + 5
    while not ran_on and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran_on == [built_on] and t.is_alive()
    with pytest.raises(AssertionError, match="already runs"):
        t.start(loop)
    stop.set()
    t.join(5)
    assert not t.is_alive()


def test_join_ends_a_thread_that_was_never_given_a_loop_at_once():
    t = TorchThread("t-idle")
    t.run(lambda: None)
    start = time.monotonic()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - start < 1
    TorchThread("t-never").join(5)  # nothing started: nothing to wait for
