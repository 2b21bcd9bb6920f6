"""Agent memory: segments, per-segment policies, the compaction scheduler and its telemetry."""

from kvmemory.memory.manager import MemoryManager
from kvmemory.memory.policy import CompactionRule, MemoryBudget, MemoryPolicy, SegmentMatch, default_policy
from kvmemory.memory.telemetry import plot_memory_map
from kvmemory.runtime.segments import Segment

__all__ = [
    "CompactionRule",
    "MemoryBudget",
    "MemoryManager",
    "MemoryPolicy",
    "Segment",
    "SegmentMatch",
    "default_policy",
    "plot_memory_map",
]
