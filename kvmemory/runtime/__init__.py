"""The local-model runtime: engine, sessions, chat rendering."""

from kvmemory.runtime.async_session import AsyncSession
from kvmemory.runtime.engine import Engine
from kvmemory.runtime.session import GenerationResult, Session, SessionStats

__all__ = ["AsyncSession", "Engine", "GenerationResult", "Session", "SessionStats"]
