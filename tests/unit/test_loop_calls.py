"""``LoopDriver.call``: a callable (the evaluator) runs on the training loop's own thread while it
is parked at a step boundary, sees that thread's settings, and leaves the loop parked. A real loop
thread; no processes."""

from __future__ import annotations

import threading

import pytest
import torch

from monarch_nb.train.trainer_loop import FINISH, LoopDriver, LoopState


def _loop(driver_box: list, seen: list) -> str:
    """A training function as ``ft.batches`` drives one: park at each boundary, run what it is told."""
    driver = driver_box[0]
    torch.set_grad_enabled(False)  # thread-local, as a user's loop setting its device would be
    result = None
    while True:
        order = driver.park(result)
        if order == FINISH:
            return "done"
        seen.append(order)
        result = f"window {order}"


@pytest.fixture
def driver():
    box: list = []
    seen: list = []
    d = LoopDriver(_loop, (box, seen), {}, "test")
    box.append(d)
    d.start(timeout_s=10)
    yield d
    if d.state == LoopState.PARKED:
        assert d.run(FINISH, timeout_s=10) == "done"


def test_a_call_runs_on_the_loop_thread_with_its_settings_and_the_loop_goes_on(driver):
    assert driver.run(1, timeout_s=10) == "window 1"
    here = threading.get_ident()
    where, grad = driver.call(lambda: (threading.get_ident(), torch.is_grad_enabled()), timeout_s=10)
    assert where != here and grad is False  # the loop thread's grad mode, not this thread's
    assert torch.is_grad_enabled()
    assert driver.state == LoopState.PARKED and driver.result == "window 1"
    assert driver.run(2, timeout_s=10) == "window 2"


def test_an_error_in_a_call_is_the_callers_and_the_loop_stays_parked(driver):
    def broken():
        raise ValueError("evaluator broke")

    with pytest.raises(ValueError, match="evaluator broke"):
        driver.call(broken, timeout_s=10)
    assert driver.state == LoopState.PARKED
    assert driver.run(3, timeout_s=10) == "window 3"


def test_a_call_that_overruns_its_timeout_says_so(driver):
    release = threading.Event()
    with pytest.raises(TimeoutError, match="did not finish a call"):
        driver.call(lambda: release.wait(10), timeout_s=0.2)
    release.set()
    with driver._cv:
        assert driver._cv.wait_for(lambda: driver.state == LoopState.PARKED, 10)
    assert driver.run(4, timeout_s=10) == "window 4"


def test_after_the_function_returned_a_call_runs_on_the_callers_thread(driver):
    assert driver.run(FINISH, timeout_s=10) == "done"
    assert driver.call(threading.get_ident, timeout_s=10) == threading.get_ident()
