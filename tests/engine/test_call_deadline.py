"""manylora.serving.CallDeadline: the front's deadline on its call to the GPU stage. A call
that answers in time returns its value or raises its own error; one past the deadline raises
TimeoutError and stays on its thread; while ``limit`` calls are stranded, new calls fail at once
without a thread, but for one probe per deadline (up to twice the limit); a call answered in
time starts the count again, so repeated deaths of the GPU stage never lock a front out."""

from __future__ import annotations

import threading
import time

import pytest

from manylora.serving import CallDeadline


def _wait_for(predicate, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while not predicate() and time.monotonic() < end:
        time.sleep(0.01)
    return predicate()


def test_answers_and_errors_in_time_pass_through():
    deadline = CallDeadline(5.0)
    assert deadline.call(lambda: 42) == 42

    def fails():
        raise ValueError("the GPU stage failed")

    with pytest.raises(ValueError, match="the GPU stage failed"):
        deadline.call(fails)

    def exits():
        raise SystemExit(3)

    with pytest.raises(RuntimeError, match="SystemExit: 3"):  # an Exception: the caller answers its batch
        deadline.call(exits)
    assert deadline.stranded == 0


def test_a_call_past_its_deadline_times_out_and_its_late_answer_frees_its_place():
    deadline = CallDeadline(0.2, limit=2)
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer within 0.2 s"):
        deadline.call(lambda: release.wait(30) and "late")
    assert 0.15 < time.monotonic() - started < 5.0
    assert deadline.stranded == 1
    release.set()  # the call answers after all: its answer is dropped, its place freed
    assert _wait_for(lambda: deadline.stranded == 0)
    assert deadline.call(lambda: "fresh") == "fresh"


def test_at_the_limit_only_one_probe_per_deadline_goes_through():
    deadline = CallDeadline(0.2, limit=2)
    release = threading.Event()
    for _ in range(2):
        with pytest.raises(TimeoutError, match="no answer"):
            deadline.call(lambda: release.wait(30))
    with pytest.raises(TimeoutError, match="no answer"):  # the probe runs, and hangs too
        deadline.call(lambda: release.wait(30))
    assert deadline.stranded == 3
    threads = threading.active_count()
    ran = []
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="3 calls past their 0.2 s deadline are still unanswered"):
        deadline.call(lambda: ran.append(1))
    assert time.monotonic() - started < 0.1 and not ran and threading.active_count() == threads
    time.sleep(0.25)  # the next probe's turn: it answers, so calls no longer hang
    assert deadline.call(lambda: "probe") == "probe"
    assert deadline.stranded == 0
    release.set()  # the calls stranded before answer late: the fresh count stays at 0
    assert _wait_for(lambda: threading.active_count() <= threads - 3)
    assert deadline.stranded == 0
    again = threading.Event()
    for _ in range(2):  # at the limit once more: the first call there is a probe again
        with pytest.raises(TimeoutError, match="no answer"):
            deadline.call(lambda: again.wait(30))
    assert deadline.call(lambda: "second probe") == "second probe"
    again.set()


def test_twice_the_limit_stops_the_probes():
    deadline = CallDeadline(0.1, limit=1)
    release = threading.Event()
    with pytest.raises(TimeoutError, match="no answer"):
        deadline.call(lambda: release.wait(30))
    with pytest.raises(TimeoutError, match="no answer"):  # the one probe
        deadline.call(lambda: release.wait(30))
    time.sleep(0.15)
    ran = []
    with pytest.raises(TimeoutError, match="2 calls past"):
        deadline.call(lambda: ran.append(1))
    assert not ran, "no probe past twice the limit"
    release.set()


def test_repeated_deaths_of_the_stage_never_lock_the_front_out():
    """Each death strands a call for good; the dead stub's next call fails at once (Triton:
    'Stub process is not healthy'), which shows calls no longer hang; after the reload the
    stage answers. Ten deaths with a limit of 2 never refuse a call."""
    deadline = CallDeadline(0.05, limit=2)
    never = threading.Event()

    def dead():
        raise RuntimeError("Stub process is not healthy.")

    for _ in range(10):
        with pytest.raises(TimeoutError, match="no answer"):
            deadline.call(lambda: never.wait(30))
        with pytest.raises(RuntimeError, match="not healthy"):
            deadline.call(dead)
        assert deadline.call(lambda: "reloaded") == "reloaded"
    never.set()
