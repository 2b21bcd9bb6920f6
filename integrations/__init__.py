"""kvmemory for LangChain and LangGraph: a chat model, a compaction node, agent middleware."""

from integrations.chat_model import ChatKVMemory, to_chat_dicts
from integrations.langgraph_node import CompactionNode, KVMemoryState
from integrations.middleware import KVMemoryMiddleware, kv_policy

__all__ = ["ChatKVMemory", "CompactionNode", "KVMemoryMiddleware", "KVMemoryState", "kv_policy", "to_chat_dicts"]
