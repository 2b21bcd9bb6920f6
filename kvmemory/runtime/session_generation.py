"""A reply generated on a Session, one atomic step at a time.

A ``Generation`` is what ``Session.generate``, ``Session.stream`` and the async and LangChain front ends
all drive. Each ``step`` samples one token and either completes or leaves the session as it was; the
step before can be undone (``undo_last``) when its text never reached the caller, as when an asyncio
task is cancelled while the step runs. Text that might be the start of a stop string, or half of a
multi-byte character, is held back; when the generation ends (finished, closed early, cancelled) the
session keeps exactly the tokens of the text the caller received.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import torch

from kvmemory.errors import InvalidArgumentError
from kvmemory.runtime.sampling import GenerationResult, ReplyProgress, ReplyText, SamplingParams, held_back
from kvmemory.runtime.segments import Segment


class SessionGeneration:
    """Part of ``Session`` (``runtime/session.py``): replies."""

    def generate(
        self,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        stop: list[str] | str | None = None,
        seed: int | None = None,
        params: SamplingParams | None = None,
    ) -> GenerationResult:
        """Generate a continuation of the session (greedy unless ``temperature`` > 0). If it fails, the
        caller received nothing and the session is left as it was before the call."""
        with self._lock, self._atomic(), self.engine.batcher.expecting():
            generation = self.start_generation(
                params,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                stop=stop,
                seed=seed,
            )
            for _ in generation:
                pass
            return generation.result

    def stream(
        self,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        stop: list[str] | str | None = None,
        seed: int | None = None,
        params: SamplingParams | None = None,
    ) -> Iterator[str]:
        """Yield text pieces as tokens are generated. Stopping early keeps exactly the text received."""
        generation = self.start_generation(
            params,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop=stop,
            seed=seed,
        )
        return (piece for piece, _ in generation if piece)

    def start_generation(self, params: SamplingParams | None = None, **overrides) -> Generation:
        """A reply to drive step by step (``Generation.step``) or by iteration; the session is busy until it
        closes. Parameters are checked here, before anything runs."""
        return Generation(self, SamplingParams.of(params, **overrides))

    def _begin_generation(self, generation: Generation) -> tuple[int, int]:
        with self._lock:
            self.check_open()
            self._check_no_stream()
            if not self.tokens:
                raise InvalidArgumentError("the session is empty: append a prompt before generating")
            with self._atomic():
                self._ensure_logits()
            self._stream = (weakref.ref(generation), generation.progress)
            return len(self.tokens), max(0, len(self.tokens) - self._turn_prefilled)

    def _room_for_one_more(self) -> bool:
        return len(self.tokens) < self.engine.position_limit and self._longest_after(1) <= self.engine.max_context

    def _reply_segment(self) -> Segment:
        last = self.segments[-1] if self.segments else None
        if last is not None and last.kind == "assistant" and last.end == len(self.tokens):
            return last
        return self._new_segment("assistant", role="assistant")

    def _sample_next(self, params: SamplingParams, generator, generation: Generation) -> int:
        """Run pending tokens, sample the next one and append it (pending until the next step runs it)."""
        written = generation.generated  # (read, never changed, by the constraint and the penalties)
        allowed = params.allowed(list(written)) if params.allowed is not None else None
        token = self._flush_pending(lambda logits: params.pick(logits, generator, allowed, written))
        if token is None:  # nothing was pending: the prompt's logits are at hand
            token = self.engine.batcher.execute(params.pick, self._last_logits, generator, allowed, written)
        segment = self._reply_segment()
        self.tokens.append(token)
        self._pending.append(token)
        self._replace_segment(segment.id, end=len(self.tokens))
        return token

    def _end_generation(self, progress) -> None:
        """Keep exactly the tokens of the text the caller received; free the session for other calls."""
        try:
            if not self.closed:
                self._settle(progress.generated, progress.emitted)
                self._refresh_open_segment_text()
        finally:
            if self._stream is not None and self._stream[1] is progress:
                self._stream = None
            self._turn_prefilled = 0

    def _settle(self, generated: list[int], text: str) -> None:
        """Make the reply's last ``len(generated)`` tokens decode to ``text`` (a prefix of their text)."""
        if self._decode(generated) == text:
            return
        k = len(generated)
        while k > 0 and not text.startswith(self._decode(generated[:k])):
            k -= 1
        rest = text[len(self._decode(generated[:k])) :]
        self._drop_tail(len(generated) - k)
        ids = self.engine.tokenizer.encode(rest, add_special_tokens=False) if rest else []
        if ids:
            segment = self._reply_segment()
            self.tokens.extend(ids)
            self._pending.extend(ids)
            self._replace_segment(segment.id, end=len(self.tokens))

    def _drop_tail(self, n: int) -> None:
        """Forget the session's last ``n`` tokens (the end of a reply)."""
        if n <= 0:
            return
        keep = len(self.tokens) - n
        if n <= len(self._pending):  # never run through the model: nothing to undo in the cache
            del self._pending[len(self._pending) - n :]
            self._cut_tokens(keep)
            self.segments = [s if s.end <= keep else s.replaced(end=keep) for s in self.segments if s.start < keep]
        else:
            self._truncate(keep)


class Generation:
    """One reply in progress on a session. Iterate it for ``(piece, result so far)`` pairs, or call ``step``.

    While it is open the session refuses other calls (``SessionBusyError``); it closes when the reply is
    finished, when the iteration stops early, on ``close()``, or (if dropped unclosed) at the session's
    next call.
    """

    def __init__(self, session, params: SamplingParams):
        self.session, self.params = session, params
        self.progress = ReplyProgress()  # the session keeps this, so an abandoned generation can be settled
        self.finish: str | None = None
        self.stop_string: str | None = None  # the stop string that ended the reply, if one did
        self.closed = False
        self._undo = None
        self._reply_text = ReplyText(session._decode)
        self._generator = torch.Generator(device="cpu").manual_seed(params.seed) if params.seed is not None else None
        self.prompt_tokens, self.cached_tokens = session._begin_generation(self)

    @property
    def generated(self) -> list[int]:
        """Sampled tokens, the end-of-turn token excluded."""
        return self.progress.generated

    @property
    def emitted(self) -> str:
        """Text handed to the caller."""
        return self.progress.emitted

    @emitted.setter
    def emitted(self, value: str) -> None:
        self.progress.emitted = value

    @property
    def result(self) -> GenerationResult:
        return GenerationResult(
            self.emitted, list(self.generated), self.finish or "length", self.prompt_tokens, self.cached_tokens
        )

    def __iter__(self):
        try:
            while (item := self.step()) is not None:
                yield item
        finally:
            self.close()

    def step(self) -> tuple[str, GenerationResult] | None:
        """Sample one token; returns the newly releasable text and the result so far, or None when done."""
        session, params = self.session, self.params
        with session._lock:
            if self.finish is not None or self.closed:
                return None
            session.check_open()
            if len(self.generated) >= params.max_new_tokens or not session._room_for_one_more():
                self.finish = "length"
                return self._release(self._text())
            state = session.snapshot(), (len(self.generated), self.emitted, self.finish)
            try:
                with session.engine.batcher.expecting():
                    token = session._sample_next(params, self._generator, self)
            except BaseException:
                session.restore(state[0])
                self.close()
                raise
            self._undo = state
            if token in session.engine.eos_token_ids and not params.ignore_eos:
                self.finish = "stop"
                return self._release(self._text())
            self.generated.append(token)
            text = self._text()
            hits = [(i, s) for s in params.stop if (i := text.find(s, max(0, len(self.emitted) - len(s)))) >= 0]
            if hits:
                at, self.stop_string = min(hits)
                self.finish = "stop"
                return self._release(text[:at])
            if len(self.generated) >= params.max_new_tokens:
                self.finish = "length"
                return self._release(text)
            return self._release(text[: len(text) - held_back(text, params.stop)])

    def undo_last(self) -> None:
        """Undo the last step (its text never reached the caller), then close."""
        with self.session._lock:
            if self._undo is not None and not self.session.closed:
                self.session.restore(self._undo[0])
                count, self.emitted, self.finish = self._undo[1]
                del self.generated[count:]
                self._undo = None
            if self.finish is None:
                self.finish = "cancelled"
        self.close()

    def close(self) -> None:
        """End the reply: the session keeps the tokens of exactly the text handed out."""
        with self.session._lock:
            if self.closed:
                return
            self.closed = True
            if self.finish is None:
                self.finish = "cancelled"
            self.session._end_generation(self.progress)

    def _text(self) -> str:
        return self._reply_text(self.generated)

    def _release(self, text: str) -> tuple[str, GenerationResult]:
        piece = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted += piece
        return piece, self.result
