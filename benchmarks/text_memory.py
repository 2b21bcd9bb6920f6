"""What agents do today to fit a long session into a context window, as text: each class is what one
condition shows the model at every step (``benchmarks/agent_memory.py`` and the benchmarks built on it).

* ``FullHistory``: every message (kvmemory and the uncompacted reference: the cache does the remembering);
* ``DropOldest``: the system prompt and task, then the newest messages that fit a token budget, a tool call
  with its results;
* ``ClearToolUses``: LangChain's ``ClearToolUsesEdit(keep=3)``, then drop-oldest where still over;
* ``Summarization``: LangChain's ``SummarizationMiddleware`` with the same local model as the summariser.
"""

from __future__ import annotations

from langchain.agents.middleware import ClearToolUsesEdit, SummarizationMiddleware
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from kvmemory import MemoryPolicy
from kvmemory.integrations.chat_model import ChatKVMemory, to_chat_dicts


def to_langchain(messages: list[dict]) -> list:
    """Chat dicts (as the traces store them) → LangChain messages, for the text baselines."""
    out = []
    for m in messages:
        if m["role"] == "system":
            out.append(SystemMessage(m["content"]))
        elif m["role"] == "user":
            out.append(HumanMessage(m["content"]))
        elif m["role"] == "tool":
            out.append(ToolMessage(m["content"], tool_call_id=m["tool_call_id"], name=m["name"]))
        else:
            calls = [
                {"name": c["function"]["name"], "args": c["function"]["arguments"], "id": c["id"]}
                for c in m.get("tool_calls", [])
            ]
            out.append(AIMessage(m["content"], tool_calls=calls))
    return out


class FullHistory:
    """kvmemory and the uncompacted run: the model is sent every message; the cache does the remembering."""

    def show(self, history: list[dict]) -> list[dict]:
        return history

    def probe(self, history: list[dict], extra: list[dict]) -> list[dict]:
        return history + extra


class DropOldest:
    """Keep the system prompt and task, then the newest messages that fit the token budget."""

    def __init__(self, count_tokens, budget: int):
        self.count, self.budget = count_tokens, budget

    def fit(self, messages: list) -> list:
        head, rest = messages[:2], messages[2:]
        starts = self.starts(rest)
        low, high = 0, len(starts) - 1  # the first start whose messages fit (fewer messages, fewer tokens)
        while low < high:
            middle = (low + high) // 2
            if self.count(head + rest[starts[middle] :]) <= self.budget:
                high = middle
            else:
                low = middle + 1
        return head + rest[starts[low] :]

    @staticmethod
    def starts(rest: list) -> list[int]:
        """Where the kept messages may begin, oldest dropped first: a tool call goes with its results, and no
        tool result is left without its call; the last start keeps nothing."""
        out, at = [0], 0
        while at < len(rest):
            cut = 1
            if isinstance(rest[at], AIMessage) and rest[at].tool_calls:
                while at + cut < len(rest) and isinstance(rest[at + cut], ToolMessage):
                    cut += 1
            at += cut
            while at < len(rest) and isinstance(rest[at], ToolMessage):  # never leave an orphaned tool result
                at += 1
            out.append(at)
        return out

    def edit(self, messages: list) -> list:
        return messages

    def show(self, history: list[dict]) -> list[dict]:
        return to_chat_dicts(self.fit(self.edit(to_langchain(history))))

    def probe(self, history: list[dict], extra: list[dict]) -> list[dict]:
        return self.show(history + extra)


class ClearToolUses(DropOldest):
    """LangChain's ContextEditingMiddleware with ``ClearToolUsesEdit(keep=3)`` at the budget (applied to every
    model call, as the middleware does), then drop-oldest where clearing alone does not fit the budget."""

    def edit(self, messages: list) -> list:
        messages = [m.model_copy(deep=True) for m in messages]
        ClearToolUsesEdit(trigger=self.budget, keep=3).apply(messages, count_tokens=self.count)
        return messages


class Summarization:
    """LangChain's SummarizationMiddleware (the local model summarises) over the running conversation. As in
    ``create_agent``, the system prompt stays outside the agent state and the middleware's state update
    replaces the messages; probes see that state without summarising again."""

    def __init__(self, count_tokens, budget: int, engine):
        summariser = ChatKVMemory(engine=engine, policy=MemoryPolicy.never(), max_new_tokens=128)
        self.system, self.state, self.seen, self.summaries = [], [], 1, 0
        self.middleware = SummarizationMiddleware(  # counts the system prompt too: the budget is what is sent
            summariser,
            trigger=("tokens", budget),
            keep=("tokens", budget // 2),
            token_counter=lambda messages: count_tokens(self.system + list(messages)),
        )

    def show(self, history: list[dict]) -> list[dict]:
        self.system = to_langchain(history[:1])
        self.state += to_langchain(history[self.seen :])
        self.seen = len(history)
        update = self.middleware.before_model({"messages": self.state}, None)
        if update is not None:
            self.state = [m for m in update["messages"] if m.type != "remove"]
            self.summaries += 1
        return to_chat_dicts(self.system + self.state)

    def probe(self, history: list[dict], extra: list[dict]) -> list[dict]:
        return to_chat_dicts(self.system + self.state + to_langchain(history[self.seen :] + extra))
