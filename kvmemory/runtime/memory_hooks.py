"""What a Session asks of the memory that manages it. ``kvmemory.memory.MemoryManager`` implements it;
the runtime only knows this protocol, so it never imports the memory layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from kvmemory.errors import SessionFileError
from kvmemory.runtime.segments import Segment


class SessionMemory(Protocol):
    """Bound to one session by ``attach``; every hook then acts on that session."""

    def attach(self, session) -> None:
        """Bind to ``session`` (once) and switch on the recorders its compaction methods read."""

    def slot_cap(self) -> int:
        """The cap in slots per head (the mean over every layer's heads): the policy's, at most the model's context."""

    def check_fits(self, n_new: int, new_segments: list[Segment]) -> None:
        """Raise ``MemoryCapError`` before anything changes if ``n_new`` tokens cannot fit, even compacted."""

    def chunk_size(self) -> int:
        """Prefill chunk length to use under the cap."""

    def make_room(self, n_new: int) -> int | None:
        """Compact, if needed, so that ``n_new`` more tokens fit under the cap; return the rows the cache may
        reserve past them (up to the cap), or None to leave its reserve as it is."""

    def after_append(self) -> None:
        """Called after every append or generated token: periodic compaction and telemetry."""

    def state(self) -> Any:
        """What ``restore`` needs to put the manager back (part of the session's snapshot)."""

    def restore(self, state: Any) -> None: ...

    def fork(self, session) -> SessionMemory:
        """A manager with the same policy and history, attached to ``session`` (a fork)."""

    def export(self) -> dict:
        """JSON-ready ``{"kind": ..., ...}`` for a saved session; the loader registered for that kind
        (``register_memory_loader``) builds an unattached manager from it."""


_LOADERS: dict[str, Callable[[dict], SessionMemory]] = {}


def register_memory_loader(kind: str, load: Callable[[dict], SessionMemory]) -> None:
    """Let saved sessions whose memory ``export()`` says ``{"kind": kind, ...}`` be loaded with ``load``."""
    _LOADERS[kind] = load


def memory_loader(kind: str) -> Callable[[dict], SessionMemory]:
    if kind not in _LOADERS:
        known = ", ".join(sorted(_LOADERS)) or "none (import kvmemory.memory)"
        raise SessionFileError(f"the saved session's memory is of kind {kind!r}; kinds that load: {known}")
    return _LOADERS[kind]
