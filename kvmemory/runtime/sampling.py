"""What a reply is made of: sampling parameters as one validated value, the reply's text as its tokens grow
(stop strings and half characters held back), and its result. ``runtime/session_generation.py`` drives
them on a session."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real

import torch

from kvmemory.errors import InvalidArgumentError
from kvmemory.runtime.logits import argmax_rows


@dataclass(frozen=True)
class SamplingParams:
    """How to sample a reply. Greedy when ``temperature`` is 0; ``stop`` strings end the reply and are not
    part of it; ``ignore_eos`` keeps sampling past end-of-turn tokens (fixed-length runs for benchmarks, as
    in vLLM and llama.cpp). Every field is checked when the value is made, so a bad one fails before
    anything runs. ``allowed``, given the reply's tokens so far, names the tokens the next one may be (None: any):
    a constraint such as a required tool call (``runtime/chat.py``, ``RequiredToolCall``).
    ``frequency_penalty`` and ``presence_penalty`` lower the logit of each token the reply has written, by the
    first times its count and by the second once, as OpenAI's parameters do: under greedy decoding a small
    model otherwise loops on a phrase until its token limit."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = field(default=())
    seed: int | None = None
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    allowed: Callable[[list[int]], Sequence[int] | torch.Tensor | None] | None = None

    def __post_init__(self):
        def whole(name, value, low):
            if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
                raise InvalidArgumentError(f"{name} must be an integer ≥ {low}, got {value!r}")

        def real(name, value):
            if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
                raise InvalidArgumentError(f"{name} must be a finite number, got {value!r}")

        whole("max_new_tokens", self.max_new_tokens, 0)
        whole("top_k", self.top_k, 0)
        real("temperature", self.temperature)
        real("top_p", self.top_p)
        for name in ("frequency_penalty", "presence_penalty"):
            real(name, getattr(self, name))
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidArgumentError(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        if self.temperature < 0:
            raise InvalidArgumentError(f"temperature must be ≥ 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            whole("seed", self.seed, 0)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgumentError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.allowed is not None and not callable(self.allowed):
            raise InvalidArgumentError(f"allowed must be a function of the reply's tokens, got {self.allowed!r}")
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise InvalidArgumentError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in stop):
            raise InvalidArgumentError("stop strings must not be empty (an empty string would match at once)")
        object.__setattr__(self, "stop", tuple(stop))

    @classmethod
    def of(cls, params: SamplingParams | None = None, **overrides) -> SamplingParams:
        """``params`` with ``overrides`` (keyword arguments left as None keep their value)."""
        from dataclasses import replace

        base = params or cls()
        given = {k: v for k, v in overrides.items() if v is not None or k == "seed" and "seed" in overrides}
        unknown = set(given) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidArgumentError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        return replace(base, **given)

    def pick(
        self,
        logits: torch.Tensor,
        generator: torch.Generator | None,
        allowed: Sequence[int] | torch.Tensor | None = None,
        written: Sequence[int] = (),
    ) -> int:
        """The next token from ``logits`` (one row), among ``allowed`` where that is given; ``written``: the
        reply's tokens so far (what the penalties count)."""
        if written and (self.frequency_penalty or self.presence_penalty):
            ids, counts = torch.as_tensor(list(written), dtype=torch.long).unique(return_counts=True)
            penalty = self.frequency_penalty * counts.float() + self.presence_penalty
            logits = logits.float().view(-1).clone().index_add_(0, ids.to(logits.device), -penalty.to(logits.device))
        if allowed is not None:
            index = allowed if isinstance(allowed, torch.Tensor) else torch.as_tensor(list(allowed), dtype=torch.long)
            index = index.to(logits.device)
            logits = torch.full_like(logits.view(-1), float("-inf")).index_copy_(0, index, logits.view(-1)[index])
        if self.temperature == 0:
            return int(argmax_rows(logits.view(1, -1))[0])
        logits = logits.float() / self.temperature
        if self.top_k > 0:
            kth = torch.topk(logits, min(self.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            drop = sorted_probs.cumsum(0) - sorted_probs > self.top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (stop token or string), "length" (max tokens or context end), "cancelled"
    prompt_tokens: int = 0  # tokens the reply was conditioned on
    cached_tokens: int = 0  # of those, tokens that were already in the cache before this turn's appends


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` must wait: a possible start of a stop string, or a
    replacement character from a multi-byte character cut between tokens."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    if text.endswith("\ufffd"):
        hold = max(hold, len(text) - len(text.rstrip("\ufffd")))
    return hold


class ReplyText:
    """The text of a reply's tokens, as ``decode(tokens)`` gives it, decoded a few tokens at a time: the
    text is asked for after every token, and decoding the whole reply each time costs O(reply) per token
    (0.35 ms at 2,000 tokens on the default tokenizer). The text of a settled prefix is kept; each call
    decodes the tokens after it together with ``CONTEXT`` before it (so spaces and merges at the seam come
    out as in the whole), and the prefix moves on every ``SETTLE_EVERY`` tokens where the text ends on a
    whole character. A seam that decodes otherwise, or a list cut below the settled prefix (an undone
    step), falls back to decoding the whole. The list only grows or is cut (a ``Generation``'s own)."""

    CONTEXT = 4
    SETTLE_EVERY = 16

    def __init__(self, decode):
        self.decode = decode
        self._settle(0, "", [])

    def __call__(self, tokens: list[int]) -> str:
        settled = self.settled
        if len(tokens) < settled or (settled and tokens[settled - 1] != self._last_settled):
            self._settle(0, "", tokens)
            settled = 0
        window = self.decode(tokens[self._seam :])
        if not window.startswith(self._head):  # the seam decodes otherwise here: start over from the whole
            self._settle(0, "", tokens)
            return self.decode(tokens)
        text = self.text + window[len(self._head) :]
        if len(tokens) - settled >= self.SETTLE_EVERY and not text.endswith("\ufffd"):
            self._settle(len(tokens), text, tokens)
        return text

    def _settle(self, count: int, text: str, tokens: list[int]) -> None:
        """From now on ``tokens[:count]`` decode to ``text``: keep it, and the seam's context before it."""
        self.settled, self.text = count, text
        self._last_settled = tokens[count - 1] if count else None
        self._seam = max(0, count - self.CONTEXT)
        self._head = self.decode(tokens[self._seam : count]) if count else ""


@dataclass
class ReplyProgress:
    generated: list[int] = field(default_factory=list)
    emitted: str = ""
