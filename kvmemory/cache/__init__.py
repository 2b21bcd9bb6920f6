"""The compactable KV cache and the plans that change it."""

from kvmemory.cache.compact_cache import CompactCache
from kvmemory.cache.compact_layer import CompactLayer
from kvmemory.cache.plan import CompactionPlan, LayerPlan

__all__ = ["CompactCache", "CompactLayer", "CompactionPlan", "LayerPlan"]
