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

On an accelerator the kernels run on the device and the calling thread serves as well (``run_on``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import torch

T = TypeVar("T")
THREAD_NAME = "kvmemory-compute"

_executor: ThreadPoolExecutor | None = None
_thread: threading.Thread | None = None
_lock = threading.Lock()


def run(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on the compute thread (inline when already there); its result or its exception.
    An interrupt of the waiting caller takes effect once ``fn`` has finished, so nothing is left half done."""
    if threading.current_thread() is _thread:
        return fn(*args, **kwargs)
    executor = _compute_executor()
    leave_the_cores()
    future = executor.submit(fn, *args, **kwargs)
    try:
        return future.result()
    except BaseException:
        if not future.done():
            _finish(future)
        raise


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
