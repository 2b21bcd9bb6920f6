"""kvmemory: KV-cache memory middleware for long-running agents on local models."""

from kvmemory.cache import CompactCache, CompactionPlan, LayerPlan
from kvmemory.errors import (
    ContextLengthError,
    InvalidArgumentError,
    InvalidMessageError,
    InvalidPlanError,
    InvalidTokenError,
    KVMemoryError,
    MemoryCapError,
    ModelLoadError,
    PolicyError,
    SessionBusyError,
    SessionClosedError,
    ToolCallParseError,
    UnsupportedArchitectureError,
)
from kvmemory.runtime import AsyncSession, Engine, GenerationResult, SamplingParams, Session, SessionStats

__all__ = [
    "AsyncSession", "CompactCache", "CompactionPlan", "ContextLengthError", "Engine", "GenerationResult",
    "InvalidArgumentError", "InvalidMessageError", "InvalidPlanError", "InvalidTokenError", "KVMemoryError", "LayerPlan", "MemoryCapError", "ModelLoadError",
    "PolicyError", "SamplingParams", "Session", "SessionBusyError", "SessionClosedError", "SessionStats", "ToolCallParseError",
    "UnsupportedArchitectureError",
]
