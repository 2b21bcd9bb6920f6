"""Compaction: pure tensor methods (one per file in ``methods/``), their registry, and the jobs the runtime
runs them in (``runtime/session_compaction.py`` connects them to a live session). Importing this package
registers the built-in methods."""

from kvmemory.compaction.base import CacheSpan, CompactionMethod, LayerResult, LayerSpan, MethodConfig
from kvmemory.compaction.jobs import CompactionRecord, SpanJob  # noqa: E402
from kvmemory.compaction.methods import *  # noqa: E402,F403  (registers the built-ins)
from kvmemory.compaction.methods import __all__ as _methods
from kvmemory.compaction.registry import available_methods, get_method, register

__all__ = [
    "CacheSpan",
    "CompactionMethod",
    "CompactionRecord",
    "SpanJob",
    "LayerResult",
    "LayerSpan",
    "MethodConfig",
    "available_methods",
    "get_method",
    "register",
    *_methods,
]
