"""kvmemory for LangChain and LangGraph: a chat model, a compaction node, agent middleware."""

from __future__ import annotations

from kvmemory.lazy import lazy_exports

# what each public name is imported from, on first use (``kvmemory.lazy``)
_EXPORTS = {
    "ChatKVMemory": ("integrations.chat_model", "ChatKVMemory"),
    "to_chat_dicts": ("integrations.chat_model", "to_chat_dicts"),
    "CompactionNode": ("integrations.langgraph_node", "CompactionNode"),
    "KVMemoryState": ("integrations.langgraph_node", "KVMemoryState"),
    "KVMemoryMiddleware": ("integrations.middleware", "KVMemoryMiddleware"),
    "kv_policy": ("integrations.middleware", "kv_policy"),
}

__all__ = ["ChatKVMemory", "CompactionNode", "KVMemoryMiddleware", "KVMemoryState", "kv_policy", "to_chat_dicts"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
