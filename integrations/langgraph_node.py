"""A StateGraph node that compacts the thread's KV cache by its policy and writes the stats into state."""

from __future__ import annotations

from typing import Annotated, Any

from langchain_core.runnables import RunnableConfig
from langgraph.graph import MessagesState


def _replace(_, new):
    return new


class KVMemoryState(MessagesState):
    """MessagesState plus the latest kvmemory stats of the thread."""

    kvmemory: Annotated[dict, _replace]


def memory_stats(session) -> dict:
    stats = session.stats()
    return {
        "logical_tokens": stats.logical_tokens,
        "slots_per_head": stats.slots_per_head,  # as the cap counts them: the mean over every head
        "kv_bytes": stats.kv_bytes,
        "uncompacted_kv_bytes": stats.uncompacted_kv_bytes,
        "compression": round(stats.compression, 3),
        "compactions": stats.compactions,
        "last_compaction": session.compaction_log[-1] if session.compaction_log else None,
    }


class CompactionNode:
    """``graph.add_node("compact", CompactionNode(chat_model))``: compacts the thread's session now.

    With ``only_over`` set, it compacts only when the cache holds more than that many slots.
    """

    def __init__(self, chat_model, only_over: int | None = None):
        self.chat_model = chat_model
        self.only_over = only_over
        self.__name__ = "kvmemory_compaction"

    def _run(self, config: RunnableConfig) -> dict[str, Any]:
        thread = (config or {}).get("configurable", {}).get("thread_id")
        with self.chat_model.thread(thread) as session:
            if self.only_over is None or session.cache.slots_per_head > self.only_over:
                session.memory.compact(trigger="node")
            return {"kvmemory": memory_stats(session)}

    def __call__(self, state: dict, config: RunnableConfig) -> dict[str, Any]:
        return self._run(config)
