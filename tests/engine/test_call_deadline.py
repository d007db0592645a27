"""manylora.serving.CallDeadline: the front's deadline on its call to the GPU stage. A call
that answers in time returns its value or raises its own error; one past the deadline raises
TimeoutError and goes on on its thread; while ``limit`` calls are past their deadline and
unanswered, new calls fail at once without starting a thread, until one of them returns."""

from __future__ import annotations

import threading
import time

import pytest

from manylora.serving import CallDeadline


def test_answers_and_errors_in_time_pass_through():
    deadline = CallDeadline(5.0)
    assert deadline.call(lambda: 42) == 42

    def fails():
        raise ValueError("the GPU stage failed")

    with pytest.raises(ValueError, match="the GPU stage failed"):
        deadline.call(fails)
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
    deadline_free = time.monotonic() + 5
    while deadline.stranded and time.monotonic() < deadline_free:
        time.sleep(0.01)
    assert deadline.stranded == 0
    assert deadline.call(lambda: "fresh") == "fresh"


def test_at_the_limit_new_calls_fail_at_once_without_a_thread():
    deadline = CallDeadline(0.1, limit=2)
    release = threading.Event()
    for _ in range(2):
        with pytest.raises(TimeoutError):
            deadline.call(lambda: release.wait(30))
    threads = threading.active_count()
    ran = []
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="2 calls past their 0.1 s deadline are still unanswered"):
        deadline.call(lambda: ran.append(1))
    assert time.monotonic() - started < 0.1 and not ran and threading.active_count() == threads
    release.set()
    free = time.monotonic() + 5
    while deadline.stranded and time.monotonic() < free:
        time.sleep(0.01)
    assert deadline.call(lambda: "again") == "again"
