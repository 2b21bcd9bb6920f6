"""The local-model runtime: engine, sessions, chat rendering."""

from kvmemory.runtime.async_session import AsyncSession
from kvmemory.runtime.compute import run as run_on_compute
from kvmemory.runtime.engine import Engine
from kvmemory.runtime.sampling import GenerationResult, SamplingParams
from kvmemory.runtime.segments import Segment
from kvmemory.runtime.session import Session, SessionStats
from kvmemory.runtime.session_generation import Generation
from kvmemory.runtime.store import SessionStore

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
