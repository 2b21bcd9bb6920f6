"""kvmemory: KV-cache memory middleware for long-running agents on local models."""

from kvmemory.cache import CompactCache, CompactionPlan, LayerPlan
from kvmemory.errors import (
    ContextLengthError,
    InvalidPlanError,
    InvalidTokenError,
    KVMemoryError,
    MemoryCapError,
    ModelLoadError,
    PolicyError,
    SessionClosedError,
    ToolCallParseError,
    UnsupportedArchitectureError,
)
from kvmemory.runtime import AsyncSession, Engine, GenerationResult, Session, SessionStats

__all__ = [
    "AsyncSession", "CompactCache", "CompactionPlan", "ContextLengthError", "Engine", "GenerationResult",
    "InvalidPlanError", "InvalidTokenError", "KVMemoryError", "LayerPlan", "MemoryCapError", "ModelLoadError",
    "PolicyError", "Session", "SessionClosedError", "SessionStats", "ToolCallParseError",
    "UnsupportedArchitectureError",
]
