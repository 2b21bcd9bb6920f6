"""The compute thread: on CPU every forward pass and compaction runs on one thread, whoever calls."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from kvmemory.runtime import compute
from tests.conftest import random_tokens, wait_until


def test_every_forward_and_compaction_runs_on_the_compute_thread_whoever_calls(tiny_engine):
    seen = set()
    norms = [layer.input_layernorm for layer in tiny_engine.model.model.layers]
    handles = [n.register_forward_pre_hook(lambda *_: seen.add(threading.current_thread().name)) for n in norms]
    try:
        session = tiny_engine.session()
        session.append_tokens(random_tokens(40))
        worker = threading.Thread(target=lambda: session.generate(max_new_tokens=3), name="caller")
        worker.start()
        worker.join()
        session.compact("counter_causal", ratio=2, keep_last=4)  # a method that runs the model's layers itself
    finally:
        for handle in handles:
            handle.remove()
    assert seen == {compute.THREAD_NAME}


def test_a_caller_turns_single_threaded_and_the_compute_thread_keeps_the_cores():
    threads = {}

    def caller():
        threads["compute"] = compute.run(torch.get_num_threads)
        threads["caller"] = torch.get_num_threads()

    worker = threading.Thread(target=caller)
    worker.start()
    worker.join()
    assert threads["caller"] == 1
    assert threads["compute"] >= 1 and compute.run(lambda: threading.current_thread().name) == compute.THREAD_NAME


def test_errors_come_back_to_the_caller_and_nested_work_runs_inline():
    def fail():
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        compute.run(fail)
    assert compute.run(lambda: compute.run(lambda: threading.current_thread().name)) == compute.THREAD_NAME


def interrupt_main_until(handled: threading.Event) -> None:
    """Send SIGINT to the main thread until its handler has run. One is not enough: a signal that arrives
    just before the main thread blocks on a lock is handled only once that lock is released."""
    deadline = time.monotonic() + 30
    while not handled.wait(0.05):
        assert time.monotonic() < deadline, "the main thread never handled SIGINT"
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def test_an_interrupt_takes_effect_only_once_the_work_has_finished():
    """Real SIGINTs reach the waiting caller while the work runs (a handler of our own, so they arrive even
    where the run ignores SIGINT, as a background job's does); the caller raises only after the work ends.
    The work waits for the caller's go-ahead (or a second), so a caller that raised at once would be seen
    finishing first."""
    order, interrupted, go_ahead = [], threading.Event(), threading.Event()

    def on_sigint(signum, frame):
        interrupted.set()
        raise KeyboardInterrupt

    def work():
        interrupt_main_until(interrupted)
        go_ahead.wait(1.0)
        order.append("work finished")

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        with pytest.raises(KeyboardInterrupt):
            compute.run(work)
        order.append("caller raised")
        go_ahead.set()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert order == ["work finished", "caller raised"]


def test_an_interrupt_before_the_work_starts_cancels_it():
    """The compute thread is busy with another thread's job when the caller is interrupted: the caller's job,
    still queued, never runs, and the caller raises at once (the busy job waits for that)."""
    ran, started, interrupted, raised = [], threading.Event(), threading.Event(), threading.Event()

    def on_sigint(signum, frame):
        interrupted.set()
        raise KeyboardInterrupt

    def busy():
        started.set()
        wait_until(lambda: compute._waiting.qsize() >= 1, what="the caller's job to be queued")
        interrupt_main_until(interrupted)
        assert raised.wait(30)

    previous = signal.signal(signal.SIGINT, on_sigint)
    worker = threading.Thread(target=compute.run, args=(busy,))
    try:
        worker.start()
        assert started.wait(30)
        with pytest.raises(KeyboardInterrupt):
            compute.run(lambda: ran.append("cancelled job"))
        raised.set()
    finally:
        signal.signal(signal.SIGINT, previous)
        raised.set()
        worker.join()
    assert interrupted.is_set() and compute.run(lambda: "next") == "next" and ran == []


def test_a_long_job_runs_the_work_queued_meanwhile_when_it_pauses(monkeypatch):
    monkeypatch.setattr(compute, "SLICE_SECONDS", 0.0)
    order, queued = [], threading.Event()

    def other():
        queued.set()
        compute.run(lambda: order.append("other"))

    def long_job():
        order.append("piece 1")
        threading.Thread(target=other).start()
        queued.wait()
        wait_until(lambda: compute._waiting.qsize() == 1)  # the other thread's job is in the queue
        compute.pause()
        order.append("piece 2")
        compute.pause()  # nothing waits: returns at once
        return "long"

    assert compute.run(long_job) == "long"
    assert order == ["piece 1", "other", "piece 2"]
    compute.pause()  # off the compute thread: nothing


def test_jobs_a_pause_runs_do_not_pause_in_turn(monkeypatch):
    """Many sessions compacting at once each queue a long job: were a job run from a pause to pause too, the
    pauses would nest one job per session deep (and overflow the stack at a few dozen sessions). It runs whole."""
    monkeypatch.setattr(compute, "SLICE_SECONDS", 0.0)
    order, threads = [], []

    def long_job(name: str, queue_next: bool):
        order.append(f"{name} starts")
        if queue_next:
            threads.append(threading.Thread(target=compute.run, args=(long_job, "second", False)))
            threads[-1].start()
            wait_until(lambda: compute._waiting.qsize() == 1)
        else:  # run from the first job's pause: queue a third and pause
            threads.append(threading.Thread(target=compute.run, args=(lambda: order.append("third"),)))
            threads[-1].start()
            wait_until(lambda: compute._waiting.qsize() == 1)
        compute.pause()
        order.append(f"{name} ends")

    compute.run(long_job, "first", True)
    for thread in threads:
        thread.join()
    assert order == ["first starts", "second starts", "second ends", "first ends", "third"]


def test_a_pause_within_its_time_slice_runs_nothing(monkeypatch):
    monkeypatch.setattr(compute, "SLICE_SECONDS", 60.0)
    ran, workers = [], []

    def long_job():
        workers.append(threading.Thread(target=lambda: compute.run(lambda: ran.append("other"))))
        workers[0].start()
        wait_until(lambda: compute._waiting.qsize() == 1)
        compute.pause()
        return list(ran)

    assert compute.run(long_job) == []
    workers[0].join()
    assert ran == ["other"]  # after the long job, in its turn
