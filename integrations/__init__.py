"""kvmemory for LangChain and LangGraph: a chat model, a compaction node, agent middleware (the ``langchain``
extra); and the server (``server.py``, the ``serve`` extra), its command line and Ray Serve deployment."""

from __future__ import annotations

from kvmemory.lazy import lazy_exports

# what each public name is imported from, on first use (``kvmemory.lazy``)
_EXPORTS = {
    "ChatKVMemory": ("kvmemory.integrations.chat_model", "ChatKVMemory"),
    "to_chat_dicts": ("kvmemory.integrations.chat_model", "to_chat_dicts"),
    "CompactionNode": ("kvmemory.integrations.langgraph_node", "CompactionNode"),
    "KVMemoryState": ("kvmemory.integrations.langgraph_node", "KVMemoryState"),
    "KVMemoryMiddleware": ("kvmemory.integrations.middleware", "KVMemoryMiddleware"),
    "kv_policy": ("kvmemory.integrations.middleware", "kv_policy"),
}

__all__ = ["ChatKVMemory", "CompactionNode", "KVMemoryMiddleware", "KVMemoryState", "kv_policy", "to_chat_dicts"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, extra="langchain")
