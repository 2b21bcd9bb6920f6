"""A LangGraph StateGraph with a compaction node after the model, with a checkpointer and threads.

python -m examples.stategraph_compaction
"""

from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph

from kvmemory.integrations import ChatKVMemory, CompactionNode, KVMemoryState
from kvmemory.memory import default_policy


def main() -> None:
    chat = ChatKVMemory.from_pretrained(
        "default", max_new_tokens=48, policy=default_policy(max_slots=512, recent_tokens=64)
    )
    graph = StateGraph(KVMemoryState)
    graph.add_node("model", lambda state: {"messages": [chat.invoke(state["messages"])]})
    graph.add_node("compact", CompactionNode(chat, only_over=256))
    graph.add_edge(START, "model")
    graph.add_edge("model", "compact")
    graph.add_edge("compact", END)
    app = graph.compile(checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "example"}}
    for question in [
        "Explain what a KV cache is in two sentences.",
        "Why does it grow during long conversations?",
        "How could one make it smaller?",
    ]:
        state = app.invoke({"messages": [HumanMessage(question)]}, config=config)
        print(f"> {question}\n{state['messages'][-1].content}\n  kvmemory: {state['kvmemory']}\n")


if __name__ == "__main__":
    main()
