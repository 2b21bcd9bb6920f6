"""AsyncSession: the Session API for asyncio. Every blocking call runs in the session's own worker thread.

One worker thread per session keeps its calls in order and off the event loop, so many sessions
interleave on one engine and a slow consumer only delays itself. Streaming hands each token to the event
loop before computing the next. Cancelling a task (or leaving an ``async for`` early) while a step runs
waits for that step, undoes it (its text never reached the caller) and lets ``CancelledError`` propagate:
the session keeps exactly the text the caller received.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from kvmemory.runtime.sampling import GenerationResult, SamplingParams
from kvmemory.runtime.session import Session
from kvmemory.runtime.session_generation import Generation

STREAM_CLOSE_WAIT = 2.0


async def finish_step(future) -> tuple:
    """Await ``future`` to its end even if the awaiting task is cancelled meanwhile.

    Returns (result, the CancelledError to re-raise or None): the caller undoes what the step did, if
    its result never reached anyone, before letting the cancellation propagate."""
    future = asyncio.ensure_future(future)
    cancelled = None
    while True:
        try:
            return await asyncio.shield(future), cancelled
        except asyncio.CancelledError as err:
            if future.done() and not future.cancelled():
                return future.result(), err
            cancelled = err


class AsyncSession:
    """Create with ``engine.async_session()`` (or ``AsyncSession(session)`` around an existing one)."""

    def __init__(self, session: Session):
        self.sync = session
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvmemory-{session.id}")
        self._idle = asyncio.Event()  # cleared while a stream of this AsyncSession is open
        self._idle.set()

    def __getattr__(self, name):  # read-only facts: id, tokens, segments, messages, cache ...
        return getattr(self.sync, name)

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _run(self, fn, *args, **kwargs):
        """Run a blocking call in the worker; if the caller is cancelled, the call still completes (or fails
        and rolls back) before ``CancelledError`` propagates, so the session is never left mid-call.

        A stream left with ``break`` is closed by asyncio a moment later: a call waits for that (at most
        ``STREAM_CLOSE_WAIT`` seconds) before the session's ``SessionBusyError`` applies."""
        if not self._idle.is_set():
            try:
                await asyncio.wait_for(self._idle.wait(), STREAM_CLOSE_WAIT)
            except TimeoutError:
                pass
        future = asyncio.get_running_loop().run_in_executor(self._worker, lambda: fn(*args, **kwargs))
        result, cancelled = await finish_step(future)
        if cancelled is not None:
            raise cancelled
        return result

    async def run(self, fn, *args, **kwargs):
        """``fn(session, *args, **kwargs)`` on the session's worker: several calls as one step (``edit``,
        ``scratch``), or anything the async twins do not cover."""
        return await self._run(fn, self.sync, *args, **kwargs)

    async def fork(self, session_id: str | None = None, with_memory: bool = False) -> AsyncSession:
        return AsyncSession(await self._run(self.sync.fork, session_id, with_memory))

    async def close(self) -> None:
        await self._run(self.sync.close)
        self._worker.shutdown(wait=False)

    @functools.wraps(Session.generate)
    async def generate(self, *args, **kwargs) -> GenerationResult:
        result = GenerationResult("", [], "length")
        async for _, result in self.steps(*sampling(args, kwargs)):
            pass
        return result

    @functools.wraps(Session.stream)
    async def stream(self, *args, **kwargs) -> AsyncIterator[str]:
        async for piece, _ in self.steps(*sampling(args, kwargs)):
            if piece:
                yield piece

    async def steps(self, params: SamplingParams | None = None, overrides: dict | None = None):
        """(new text, result so far) per generated token (``start_generation``'s arguments)."""
        generation: Generation = await self._run(self.sync.start_generation, params, **(overrides or {}))
        loop = asyncio.get_running_loop()
        self._idle.clear()
        try:
            while True:
                item, cancelled = await finish_step(loop.run_in_executor(self._worker, generation.step))
                if cancelled is not None:
                    await finish_step(loop.run_in_executor(self._worker, generation.undo_last))
                    raise cancelled
                if item is None:
                    return
                yield item
        finally:
            try:
                await finish_step(loop.run_in_executor(self._worker, generation.close))
            finally:
                self._idle.set()


def sampling(args: tuple, kwargs: dict) -> tuple[SamplingParams | None, dict]:
    """``Session.generate``'s arguments as ``start_generation``'s: (params, the other overrides)."""
    bound = inspect.signature(Session.generate).bind(None, *args, **kwargs)
    given = {k: v for k, v in bound.arguments.items() if k != "self"}
    return given.pop("params", None), given


# Every public Session method not written above gets its twin here, with the same signature, run on the
# session's worker: the async API cannot drift from the sync one (tests/test_runtime.py checks them all).
NOT_ASYNC = {
    "edit": "a transaction of several calls: run them together with AsyncSession.run",
    "scratch": "a transaction of several calls: run them together with AsyncSession.run",
    "start_generation": "a step-by-step generation: use steps, stream or generate",
}


def _twin(name: str):
    method = getattr(Session, name)

    @functools.wraps(method)
    async def twin(self, *args, **kwargs):
        return await self._run(getattr(self.sync, name), *args, **kwargs)

    return twin


def public_methods(cls) -> list[str]:
    return [
        name
        for name in dir(cls)
        if not name.startswith("_")
        and callable(getattr(cls, name))
        and not isinstance(inspect.getattr_static(cls, name), property)
    ]


for _name in public_methods(Session):
    if _name not in NOT_ASYNC and _name not in AsyncSession.__dict__:
        setattr(AsyncSession, _name, _twin(_name))
