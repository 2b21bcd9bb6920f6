"""kvmemory: KV-cache memory middleware for long-running agents on local models.

from kvmemory import Engine, MemoryManager, default_policy
engine = Engine.from_pretrained("default")
session = engine.session(memory=MemoryManager(default_policy(max_slots=2048)))
session.append_text(long_tool_output, kind="tool_output")
session.compact("snapkv", ratio=4)  # or let the memory manager compact under its cap
"""

from kvmemory.cache import CompactCache, CompactionPlan, LayerPlan
from kvmemory.compaction import (
    H2O,
    REAL,
    TAM,
    TOVA,
    AttentionMatching,
    CompactionMethod,
    CompactionRecord,
    CounterCausal,
    KeyNorm,
    MethodConfig,
    RandomEviction,
    SnapKV,
    StreamingLLM,
    available_methods,
    get_method,
    register,
)
from kvmemory.errors import (
    ContextLengthError,
    InvalidArgumentError,
    InvalidMessageError,
    InvalidPlanError,
    InvalidTokenError,
    KVMemoryError,
    MemoryCapError,
    ModelLoadError,
    ModelMismatchError,
    PolicyError,
    SessionBusyError,
    SessionClosedError,
    SessionFileError,
    ToolCallParseError,
    UnsupportedArchitectureError,
)
from kvmemory.memory import CompactionRule, MemoryBudget, MemoryManager, MemoryPolicy, SegmentMatch, default_policy
from kvmemory.runtime import AsyncSession, Engine, GenerationResult, SamplingParams, Segment, Session, SessionStats

__all__ = [
    "TAM",
    "TOVA",
    "AsyncSession",
    "AttentionMatching",
    "CompactCache",
    "CompactionMethod",
    "CompactionPlan",
    "CompactionRecord",
    "CompactionRule",
    "ContextLengthError",
    "CounterCausal",
    "Engine",
    "GenerationResult",
    "H2O",
    "InvalidArgumentError",
    "InvalidMessageError",
    "InvalidPlanError",
    "InvalidTokenError",
    "KVMemoryError",
    "KeyNorm",
    "LayerPlan",
    "MemoryBudget",
    "MemoryCapError",
    "MemoryManager",
    "MemoryPolicy",
    "MethodConfig",
    "ModelLoadError",
    "ModelMismatchError",
    "PolicyError",
    "REAL",
    "RandomEviction",
    "SamplingParams",
    "Segment",
    "SegmentMatch",
    "Session",
    "SessionBusyError",
    "SessionClosedError",
    "SessionFileError",
    "SessionStats",
    "SnapKV",
    "StreamingLLM",
    "ToolCallParseError",
    "UnsupportedArchitectureError",
    "available_methods",
    "default_policy",
    "get_method",
    "register",
]
