"""The local-model runtime: engine, sessions, chat rendering."""

from __future__ import annotations

from kvmemory.lazy import lazy_exports

# what each public name is imported from, on first use (``kvmemory.lazy``)
_EXPORTS = {
    "AsyncSession": ("kvmemory.runtime.async_session", "AsyncSession"),
    "run_on_compute": ("kvmemory.runtime.compute", "run"),
    "Engine": ("kvmemory.runtime.engine", "Engine"),
    "GenerationResult": ("kvmemory.runtime.sampling", "GenerationResult"),
    "SamplingParams": ("kvmemory.runtime.sampling", "SamplingParams"),
    "Segment": ("kvmemory.runtime.segments", "Segment"),
    "Session": ("kvmemory.runtime.session", "Session"),
    "SessionStats": ("kvmemory.runtime.session", "SessionStats"),
    "Generation": ("kvmemory.runtime.session_generation", "Generation"),
    "SessionStore": ("kvmemory.runtime.store", "SessionStore"),
}

__all__ = [
    "AsyncSession",
    "Engine",
    "Generation",
    "GenerationResult",
    "SamplingParams",
    "Segment",
    "Session",
    "SessionStats",
    "SessionStore",
    "run_on_compute",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
