"""One-time work a user waits for (building the CPU kernels, profiling a model's heads), said as it starts.

A first run that sits silent for two minutes looks hung, so each such piece of work says what it does and
about how long it takes, once, on stderr, and how long it took when it ends; later runs find its result
cached and say nothing. The notices go to the ``kvmemory.notices`` logger, which prints them itself
(``kvmemory: ...``) and does not pass them on. Silence them with ``KVMEMORY_QUIET=1`` or
``logging.getLogger("kvmemory.notices").setLevel(logging.WARNING)``; a fallback taken (no compiler, a cache
that cannot be written) is a warning and shows regardless.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger("kvmemory.notices")
if not log.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("kvmemory: %(message)s"))
    log.addHandler(_handler)
    log.propagate = False
    log.setLevel(logging.WARNING if os.environ.get("KVMEMORY_QUIET", "0") not in ("", "0") else logging.INFO)


def say(message: str, *args) -> None:
    """One line for the user, unless notices are silenced."""
    log.info(message, *args)


def warn(message: str, *args) -> None:
    """A fallback taken and what to install to avoid it: shown even when notices are silenced."""
    log.warning(message, *args)


@contextmanager
def one_time_work(what: str, expected: str) -> Iterator[None]:
    """Say ``what`` starts (``expected``: about how long, once), then how long it took or that it failed."""
    say("%s (once; about %s) ...", what, expected)
    started = time.perf_counter()
    try:
        yield
    except BaseException:
        say("%s: stopped after %.0f s", what, time.perf_counter() - started)
        raise
    say("%s: done in %.0f s", what, time.perf_counter() - started)


def progress(items: Iterable[T], total: int, what: str) -> Iterable[T]:
    """``items`` with a progress bar on stderr while notices are on (work that has steps)."""
    if not log.isEnabledFor(logging.INFO):
        return items
    from tqdm.auto import tqdm

    return tqdm(items, total=total, desc=f"kvmemory: {what}", leave=False, file=sys.stderr)
