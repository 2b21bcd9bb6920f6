"""One thread runs the model on CPU, whichever thread calls a Session.

torch splits a CPU kernel over an OpenMP team of threads, and GNU OpenMP keeps one team per thread that
starts parallel work. Once the threads held in such teams outnumber the CPUs, it stops spinning between
parallel regions and parks its threads on futexes, so every region pays a wake-up: on a 2-core machine a
200k-element add took 6.5 µs from the only thread using OpenMP and 50 µs once a second thread had used
it, and a decode step (~250 parallel regions) ran 1.75× slower from a server or async worker thread.

So on CPU every forward pass (``ForwardBatcher``), compaction method, token sampling and model load runs
on one long-lived thread, ``kvmemory-compute``, whose team keeps all the cores; the calling thread hands
it the work and waits. A thread that uses a CPU session runs its own torch work single-threaded from then
on (``torch.set_num_threads(1)`` is per thread; ``leave_the_cores``), so it never holds a team of its own:
what is left to it is bookkeeping. A team a thread built before its first call stays (GNU OpenMP frees it
with the thread), so heavy torch work of one's own belongs on the compute thread too:
``kvmemory.run_on_compute(fn, *args)``.

One thread means one job at a time, and a compaction takes up to a second: a job that long calls ``pause()``
between its pieces (a compaction method after each layer, ``CacheSpan.each_layer``). Once it has run for a
time slice (about one decode pass), that runs the work other threads queued meanwhile, so the other
sessions' passes wait for a slice and a piece, not the whole job, and the job keeps about half the machine.

On an accelerator the kernels run on the device and the calling thread serves as well (``run_on``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import torch

T = TypeVar("T")
THREAD_NAME = "kvmemory-compute"

_executor: ThreadPoolExecutor | None = None  # its one worker is the compute thread
_thread: threading.Thread | None = None
_lock = threading.Lock()
# the jobs not yet started, in order: the executor's worker takes one per submission, ``pause`` all it finds
_waiting: queue.SimpleQueue = queue.SimpleQueue()
SLICE_SECONDS = 0.025  # the least a long job runs between two pauses that run others' work
_slice_started = 0.0  # when the running job started or last paused
_pausing = False  # a pause is running others' jobs: theirs do not pause in turn (no nesting, however many wait)


def run(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on the compute thread (inline when already there); its result or its exception.
    An interrupt of the waiting caller takes effect once ``fn`` has finished, so nothing is left half done;
    one that arrives before ``fn`` has started cancels it (it never runs)."""
    if threading.current_thread() is _thread:
        return fn(*args, **kwargs)
    executor = _compute_executor()
    leave_the_cores()
    future = Future()
    try:  # the queueing too: an interrupt can arrive while the job is queued but not yet handed over
        _waiting.put((future, fn, args, kwargs))
        executor.submit(_run_next)
        return future.result()
    except BaseException:
        if not future.cancel():  # started (or done): wait for it to end
            _finish(future)
        raise


def pause() -> None:
    """On the compute thread, once the running job has had its time slice, run the jobs other threads
    queued before this call, then return; elsewhere nothing. A long job calls it between its pieces (see
    the module docstring): the thread it runs for is waiting on it, so only other threads' work runs here,
    each job whole, as it would have run after (a long one among them does not pause in turn: with many
    sessions compacting at once, pauses within pauses would nest one compaction per session deep)."""
    global _slice_started, _pausing
    if _pausing or threading.current_thread() is not _thread or time.perf_counter() - _slice_started < SLICE_SECONDS:
        return
    _pausing = True
    try:
        for _ in range(_waiting.qsize()):  # not what they queue meanwhile: a stream of passes never starves the job
            _run_next()
    finally:
        _pausing = False
    _slice_started = time.perf_counter()


def _run_next() -> None:
    """Run the oldest waiting job that is neither cancelled nor already run by ``pause``, if any, into its
    future. Cancelled jobs are skipped: their callers were interrupted before the job started."""
    global _slice_started
    while True:
        try:
            future, fn, args, kwargs = _waiting.get_nowait()
        except queue.Empty:
            return
        if future.set_running_or_notify_cancel():
            break
    _slice_started = time.perf_counter()
    try:
        result = fn(*args, **kwargs)
    except BaseException as error:  # an interrupt too: it belongs to the caller waiting on the future
        future.set_exception(error)
    else:
        future.set_result(result)


def run_on(device: torch.device, fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` where kernels for ``device`` run best: the compute thread for the CPU, else this thread."""
    return run(fn, *args) if device.type == "cpu" else fn(*args)


def leave_the_cores(device: torch.device | None = None) -> None:
    """Run this thread's own torch work single-threaded from now on (see the module docstring): called as
    a thread starts using a CPU session, before any of its work could grow an OpenMP team."""
    cpu = device is None or device.type == "cpu"
    if cpu and threading.current_thread() is not _thread and torch.get_num_threads() > 1:
        torch.set_num_threads(1)


def _finish(future: Future) -> None:
    """Wait for ``future`` through further interrupts (the caller's state depends on it finishing)."""
    while True:
        try:
            wait([future])
            return
        except BaseException:
            continue


def _compute_executor() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            threads = torch.get_num_threads()  # the first caller's, before it turns single-threaded
            _executor = ThreadPoolExecutor(1, THREAD_NAME, initializer=_start, initargs=(threads,))
        return _executor


def _start(threads: int) -> None:
    global _thread
    _thread = threading.current_thread()
    _thread.name = THREAD_NAME
    torch.set_num_threads(threads)
