"""ChatKVMemory: a LangChain chat model over kvmemory sessions, one resident KV cache per LangGraph thread.

Each call re-renders the thread's messages and prefills only the tokens the thread's cache lacks, so an
agent turn costs the new tool output and the new answer, not the whole history. Threads are sessions of
the serving core (``integrations/serving.py``) the HTTP server runs, keyed by thread id. Tools are rendered by
the model's chat template (or, for templates without tools, in the system message); tool calls come back
parsed from ``<tool_call>`` JSON. Usage metadata reports reused prefix tokens as cache reads.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import ContextOverflowError
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import ensure_config
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field, PrivateAttr

from kvmemory import ContextLengthError, Engine, MemoryCapError, Session, SessionStore
from kvmemory.defaults import DEFAULT_MAX_SLOTS
from kvmemory.integrations.serving import AsyncCore, Reply, ServingCore, Turn, tool_name
from kvmemory.memory import MemoryManager, MemoryPolicy, default_policy

DEFAULT_THREAD = "default"


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)


def to_chat_dicts(messages: Sequence[BaseMessage]) -> list[dict]:
    """LangChain messages → the role/content dicts chat templates render."""
    out = []
    for msg in messages:
        if msg.type == "system":
            out.append({"role": "system", "content": _text(msg.content)})
        elif msg.type == "human":
            out.append({"role": "user", "content": _text(msg.content)})
        elif msg.type == "ai":
            item = {"role": "assistant", "content": _text(msg.content)}
            calls = getattr(msg, "tool_calls", None) or []
            if calls:
                item["tool_calls"] = [
                    {
                        "type": "function",
                        "id": c.get("id"),
                        "function": {"name": c["name"], "arguments": c.get("args", {})},
                    }
                    for c in calls
                ]
            out.append(item)
        elif msg.type == "tool":
            out.append(
                {
                    "role": "tool",
                    "content": _text(msg.content),
                    "name": getattr(msg, "name", None),
                    "tool_call_id": getattr(msg, "tool_call_id", None),
                }
            )
        else:
            raise ValueError(f"unsupported message type {msg.type!r}")
    return out


class ChatKVMemory(BaseChatModel):
    """A local chat model whose threads keep (and compact) their KV cache between calls.

    ``ChatKVMemory.from_pretrained("default", policy=default_policy(max_slots=4096))``. Without a policy
    each thread gets ``default_policy(max_slots=DEFAULT_MAX_SLOTS)`` (2048, or the model's context if
    smaller); pass ``MemoryPolicy.never()`` for a cache that is never compacted.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: Any = Field(exclude=True)
    policy: MemoryPolicy | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    frequency_penalty: float = 0.0  # OpenAI's meaning: each token the reply wrote, lowered by its count times this
    seed: int | None = None

    store: Any = Field(None, exclude=True, description="a SessionStore; by default one that keeps threads in memory")
    save_turns: bool = Field(True, description="with a store that has a directory: save each thread after each call")

    _core: Any = PrivateAttr(None)
    _async_core: Any = PrivateAttr(None)

    @classmethod
    def from_pretrained(cls, name_or_path: str = "default", **kwargs) -> ChatKVMemory:
        return cls(engine=Engine.from_pretrained(name_or_path), **kwargs)

    @property
    def _llm_type(self) -> str:
        return "kvmemory"

    @property
    def _identifying_params(self) -> dict:
        return {"model": self.engine.name, "max_new_tokens": self.max_new_tokens, "temperature": self.temperature}

    # ---- threads -------------------------------------------------------------------------------
    def model_post_init(self, context: Any) -> None:
        if self.policy is None:  # a resident cache with no cap would grow until the model's context runs out
            self.policy = default_policy(max_slots=min(DEFAULT_MAX_SLOTS, self.engine.max_context))
        if self.store is None:
            self.store = SessionStore(self.engine)
        saving = self.save_turns and self.store.directory is not None
        self._core = ServingCore(self.store, self.policy, busy_timeout=None, save_after_turn=saving)
        self._async_core = AsyncCore(self._core)

    def _new_memory(self) -> MemoryManager:
        return MemoryManager(self.policy)

    def session_for(self, thread_id: str | None = None) -> Session:
        """The thread's session: resident, or loaded from the store's saved file, or new (a thread the store
        does not know is rebuilt from the messages of its next call)."""
        return self.store.get(thread_id or DEFAULT_THREAD, self._new_memory)

    def set_thread_policy(self, thread_id: str | None, policy: MemoryPolicy) -> None:
        """Serve one thread with its own policy; the other threads keep the model's ``policy``."""
        with self.thread(thread_id) as session:
            session.memory.set_policy(policy)

    @contextlib.contextmanager
    def thread(self, thread_id: str | None = None) -> Iterator[Session]:
        """The thread's session, held for a sequence of calls no other call on that thread interleaves with
        (and never spilled meanwhile); saved afterwards when the store has a directory."""
        thread_id = thread_id or DEFAULT_THREAD
        with self._core.hold(thread_id) as session:
            yield session
            self._core.after_turn(thread_id)

    @staticmethod
    def current_thread_id(kwargs: dict, config: RunnableConfig | None = None) -> str:
        """The LangGraph thread of this call: an explicit ``thread_id``, else the (inherited) run config's."""
        if kwargs.get("thread_id"):
            return str(kwargs["thread_id"])
        config = ensure_config(config)
        thread = config.get("configurable", {}).get("thread_id") or config.get("metadata", {}).get("thread_id")
        return str(thread) if thread else DEFAULT_THREAD

    # The run config does not reach _generate/_stream; pass its thread id along as a keyword.
    def invoke(self, input, config: RunnableConfig | None = None, **kwargs):
        return super().invoke(
            input, config, thread_id=self.current_thread_id(kwargs, config), **_without_thread(kwargs)
        )

    async def ainvoke(self, input, config: RunnableConfig | None = None, **kwargs):
        return await super().ainvoke(
            input, config, thread_id=self.current_thread_id(kwargs, config), **_without_thread(kwargs)
        )

    def stream(self, input, config: RunnableConfig | None = None, **kwargs):
        return super().stream(
            input, config, thread_id=self.current_thread_id(kwargs, config), **_without_thread(kwargs)
        )

    def astream(self, input, config: RunnableConfig | None = None, **kwargs):
        return super().astream(
            input, config, thread_id=self.current_thread_id(kwargs, config), **_without_thread(kwargs)
        )

    def drop_thread(self, thread_id: str) -> None:
        """Forget a thread: its session, and its saved file if the store has one."""
        with self._core.hold(thread_id):  # waits for a call in progress on it
            pass
        self.store.drop(thread_id)

    # ---- tools -------------------------------------------------------------------------------
    def bind_tools(self, tools: Sequence, *, tool_choice: str | dict | bool | None = None, **kwargs) -> Runnable:
        """``tool_choice``: "auto" (None), "required" / "any" / True (the reply calls one of the tools, in the
        model's own format: ``RequiredToolCall``), a tool's name (or ``{"function": {"name": ...}}``), or
        OpenAI's ``{"type": "allowed_tools", "mode": "required", "tools": [...]}``: the reply calls one of those
        tools while the prompt still shows all of ``tools``, so that a tool set narrowed from call to call keeps
        the session's cached prefix. An allowed tool given as a tool (not a name) holds the call's arguments to
        its own schema, which may be narrower than the prompt's (say, an enum of the paths that exist now)."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        names = {t["function"]["name"] for t in formatted}
        if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
            kwargs["allowed_tools"] = allowed_tools(tool_choice, names)
            tool_choice = "required"
        elif isinstance(tool_choice, dict):
            tool_choice = tool_choice.get("function", tool_choice).get("name")
        if tool_choice is True:
            tool_choice = "required"
        if tool_choice not in (None, False, "auto", "none", "required", "any") and tool_choice not in names:
            raise ValueError(f"tool_choice {tool_choice!r} names none of the tools ({', '.join(sorted(names))})")
        if tool_choice not in (None, False, "auto"):
            kwargs["tool_choice"] = tool_choice
        return self.bind(tools=formatted, **kwargs)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence | None = None) -> int:
        tools = [convert_to_openai_tool(t) for t in tools] if tools else None
        return len(self.engine.render_chat(to_chat_dicts(messages), tools))

    # ---- generation ----------------------------------------------------------------------------

    def _turn(self, messages: list[BaseMessage], stop, kwargs) -> Turn:
        return Turn(
            to_chat_dicts(messages),
            kwargs.get("tools"),
            {
                "max_new_tokens": kwargs.get("max_new_tokens", self.max_new_tokens),
                "temperature": kwargs.get("temperature", self.temperature),
                "top_p": kwargs.get("top_p", self.top_p),
                "frequency_penalty": kwargs.get("frequency_penalty", self.frequency_penalty),
                "stop": stop,
                "seed": kwargs.get("seed", self.seed),
            },
            self.current_thread_id(kwargs),
            tool_choice=kwargs.get("tool_choice"),
            allowed_tools=kwargs.get("allowed_tools"),
        )

    def _chunk(self, item: str | Reply, shown: str) -> ChatGenerationChunk:
        """A streamed piece of text as a chunk; the Reply as the last chunk (tool calls, usage, and whatever
        of its text the pieces, ``shown``, did not carry)."""
        if not isinstance(item, Reply):
            return ChatGenerationChunk(message=AIMessageChunk(content=item))
        final = self._final_message(item, chunk=True)
        if not final.tool_call_chunks and not final.invalid_tool_calls:
            if item.content.startswith(shown) and len(item.content) > len(shown):
                final.content = item.content[len(shown) :]
        return ChatGenerationChunk(message=final)

    def _final_message(self, reply: Reply, chunk: bool):
        usage = {
            "input_tokens": reply.prompt_tokens,
            "output_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
            "input_token_details": {"cache_read": reply.cached_tokens},
        }
        meta = {"finish_reason": reply.finish_reason, "model_name": self.engine.name}
        content, calls, invalid = reply.content, reply.tool_calls, []
        if reply.tool_call_error is not None:
            invalid = [
                {
                    "type": "invalid_tool_call",
                    "name": None,
                    "args": reply.invalid_tool_call,
                    "id": None,
                    "error": f"{reply.tool_call_error}. "
                    'Answer again with <tool_call>{"name": ..., "arguments": {...}}</tool_call>',
                }
            ]
        if chunk:
            chunks = [
                {"type": "tool_call_chunk", "name": c["name"], "args": json.dumps(c["args"]), "id": c["id"], "index": i}
                for i, c in enumerate(calls)
            ]
            return AIMessageChunk(
                content="",
                tool_call_chunks=chunks,
                usage_metadata=usage,
                response_metadata=meta,
                invalid_tool_calls=invalid,
                chunk_position="last",
            )
        return AIMessage(
            content=content, tool_calls=calls, invalid_tool_calls=invalid, usage_metadata=usage, response_metadata=meta
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        reply = None
        with context_overflow():
            for item in self._core.turn(self._turn(messages, stop, kwargs)):
                if isinstance(item, Reply):
                    reply = item
                elif run_manager is not None:
                    run_manager.on_llm_new_token(item)
        return ChatResult(generations=[ChatGeneration(message=self._final_message(reply, chunk=False))])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        shown = ""
        with context_overflow():
            for item in self._core.turn(self._turn(messages, stop, kwargs)):
                chunk = self._chunk(item, shown)
                if not isinstance(item, Reply):
                    shown += item
                    if run_manager is not None:
                        run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chunks = [c async for c in self._astream(messages, stop, run_manager, **kwargs)]
        text = "".join(c.message.content for c in chunks if isinstance(c.message.content, str))
        last = chunks[-1].message
        calls = [{"name": c["name"], "args": json.loads(c["args"]), "id": c["id"]} for c in last.tool_call_chunks]
        message = AIMessage(
            content=text,
            tool_calls=calls,
            invalid_tool_calls=last.invalid_tool_calls,
            usage_metadata=last.usage_metadata,
            response_metadata=last.response_metadata,
        )
        return ChatResult(generations=[ChatGeneration(message=message)])

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """The serving core's asyncio bridge (``AsyncCore``): one token per worker-thread step, so other
        coroutines and sessions interleave; a cancelled task keeps exactly the text it received."""
        kwargs.setdefault("thread_id", self.current_thread_id(kwargs))
        shown = ""
        with context_overflow():
            turn = functools.partial(self._core.turn, self._turn(messages, stop, kwargs))
            async for item in self._async_core.iterate(turn):
                chunk = self._chunk(item, shown)
                if not isinstance(item, Reply):
                    shown += item
                    if run_manager is not None:
                        await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk


@contextlib.contextmanager
def context_overflow() -> Iterator[None]:
    """A turn that cannot fit the model's context or the memory cap, as LangChain's ``ContextOverflowError``."""
    try:
        yield
    except (ContextLengthError, MemoryCapError) as err:
        raise ContextOverflowError(str(err)) from err


def _without_thread(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k != "thread_id"}


def allowed_tools(choice: dict, names: set[str]) -> list[dict]:
    """OpenAI's ``allowed_tools`` choice as the tools a required call may name (OpenAI function tools; a name
    alone keeps the prompt's schema). Only ``mode: "required"`` is held: kvmemory constrains a call it requires,
    and cannot leave a reply free to answer in text yet bar some tools."""
    if choice.get("mode", "required") not in ("required", "any"):
        raise ValueError(f"tool_choice allowed_tools: mode {choice.get('mode')!r} is not supported; use 'required'")
    allowed = []
    for tool in choice.get("tools") or []:
        named = isinstance(tool, str) or isinstance(tool, dict) and not {"function", "parameters"} & set(tool)
        name = (tool if isinstance(tool, str) else tool.get("name")) if named else None
        spec = {"type": "function", "function": {"name": name}} if named else convert_to_openai_tool(tool)
        if tool_name(spec) not in names:
            raise ValueError(
                f"tool_choice allowed_tools names {tool_name(spec)!r}, which is none of the tools "
                f"({', '.join(sorted(names))})"
            )
        allowed.append(spec)
    if not allowed:
        raise ValueError("tool_choice allowed_tools names no tool")
    return allowed


__all__ = ["ChatKVMemory", "to_chat_dicts"]
