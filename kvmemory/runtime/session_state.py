"""A Session's whole state at one moment (what every rollback restores and what a saved session holds), and
the scope every public call runs in."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvmemory.runtime.segments import Segment


@dataclass
class SessionState:
    """Everything a Session's calls can change, captured cheaply (the cache part is copy-on-write)."""

    cache: object
    transcript: list[int]  # the session's token list itself, shared, not copied (see ``tokens``)
    token_count: int
    pending: list[int]
    last_logits: torch.Tensor | None
    segments: list[Segment]
    next_segment_id: int
    messages: list[dict]
    message_spans: list[tuple[str, int, int]]
    tools_key: str | None
    reply: tuple[int, int] | None
    compaction_log: int  # the log's length (snapshots share the list); see ``records``
    prefilled_tokens: int
    turn_prefilled: int
    queries: object
    hidden: dict | None
    memory: tuple | None
    surprisal: torch.Tensor | None = None
    records: list[dict] | None = None  # the log itself, when the state comes from a file rather than a snapshot

    @property
    def tokens(self) -> list[int]:
        """The transcript as it was. A snapshot is taken before every decoded token, so it holds the session's
        own list and its length, not a copy: the session only appends past that length, and copies the
        list before it cuts below a length a snapshot holds (``SessionForward._cut_tokens``)."""
        return self.transcript[: self.token_count]


def exclusive(method):
    """A public Session call: serialised with other threads' calls, refused while a stream is open, and
    undone whole if it raises."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            self.check_open()
            self._check_no_stream()
            with self._atomic():
                return method(self, *args, **kwargs)

    return call
