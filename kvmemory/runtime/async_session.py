"""AsyncSession: the Session API for asyncio. Model work runs in a worker thread, one step at a time.

Streaming hands each token to the event loop before computing the next, so many sessions interleave
on one engine, a slow consumer only delays itself, and cancelling a stream between tokens leaves the
session consistent (the tokens so far stay in the cache and the transcript).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvmemory.runtime.session import GenerationResult, Session

_DONE = object()


class AsyncSession:
    def __init__(self, session: Session):
        self.sync = session
        self._lock = asyncio.Lock()  # one call at a time per session

    def __getattr__(self, name):  # read-only facts: id, tokens, segments, messages, cache ...
        return getattr(self.sync, name)

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc) -> None:
        self.sync.close()

    async def _run(self, fn, *args, **kwargs):
        async with self._lock:
            return await asyncio.to_thread(fn, *args, **kwargs)

    async def append_text(self, text: str, **kwargs):
        return await self._run(self.sync.append_text, text, **kwargs)

    async def append_tokens(self, token_ids, **kwargs):
        return await self._run(self.sync.append_tokens, token_ids, **kwargs)

    async def append_messages(self, messages, **kwargs):
        return await self._run(self.sync.append_messages, messages, **kwargs)

    async def set_messages(self, messages, **kwargs):
        return await self._run(self.sync.set_messages, messages, **kwargs)

    async def logprobs(self, token_ids):
        return await self._run(self.sync.logprobs, token_ids)

    async def compact(self, plan):
        return await self._run(self.sync.compact, plan)

    async def recall(self, segment_id: int):
        return await self._run(self.sync.recall, segment_id)

    def search(self, query: str, **kwargs):
        return self.sync.search(query, **kwargs)

    def stats(self):
        return self.sync.stats()

    def close(self) -> None:
        self.sync.close()

    async def generate(self, **kwargs) -> GenerationResult:
        result = GenerationResult("", [], "length")
        async for _, result in self._steps(**kwargs):
            pass
        return result

    async def stream(self, **kwargs) -> AsyncIterator[str]:
        async for piece, _ in self._steps(**kwargs):
            if piece:
                yield piece

    async def _steps(self, **kwargs):
        async with self._lock:
            steps = self.sync._generate(
                kwargs.pop("max_new_tokens", 256), kwargs.pop("temperature", 0.0), kwargs.pop("top_p", 1.0),
                kwargs.pop("top_k", 0), kwargs.pop("stop", None), kwargs.pop("seed", None),
            )
            try:
                while True:
                    item = await asyncio.to_thread(next, steps, _DONE)
                    if item is _DONE:
                        return
                    yield item
            finally:
                await asyncio.to_thread(steps.close)
