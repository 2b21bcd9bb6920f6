"""A client's context management, answered in latent space.

Agents ask the hosted APIs to manage a long context for them: clear old tool results (Anthropic's
``clear_tool_uses_20250919``) or compact the conversation (Anthropic's ``compact_20260112``, the Responses API's
``compaction`` and ``POST /v1/responses/compact``). The hosted servers edit the prompt's text, or summarise it;
local servers ignore the request or re-prefill text. kvmemory applies each edit to the session's resident KV
cache instead, so the conversation stays what the client sent and nothing is prefilled again:

* clearing a tool result compacts its segment to its rule's floor with its rule's method
  (``MemoryManager.clear``); its text stays in the transcript, and ``recall`` brings it back;
* compacting the conversation runs the session's policy now, down to its target (a cap-forced compaction's)
  and below half the trigger, and stands a *mark* for the conversation held at that point: a compaction block or item
  the client sends back in place of the messages before it, which the server expands to those messages, so
  the session's cache still matches them and only what follows is prefilled.

Each dialect parses its own shapes into these edits and reports the ``AppliedEdit``s in its own fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmemory.memory import MemoryManager

MARK_PREFIX = "kvmemory-mark:"  # a mark's opaque content, as a client round-trips it: the prefix, then its id
# Anthropic's documented defaults, which the Responses API's compaction shares
CLEAR_TRIGGER_TOKENS, CLEAR_KEEP, COMPACT_TRIGGER_TOKENS = 100_000, 3, 150_000


@dataclass(frozen=True)
class ClearToolResults:
    """Compact the results of all but the newest ``keep`` tool uses once the prompt reaches ``trigger_tokens``
    (or the conversation ``trigger_tool_uses`` tool uses), unless that frees fewer than ``clear_at_least``
    tokens. ``exclude_tools`` are never cleared; ``clear_inputs`` clears the calls too (the assistant turns
    whose every result is cleared)."""

    trigger_tokens: int | None = CLEAR_TRIGGER_TOKENS
    trigger_tool_uses: int | None = None
    keep: int = CLEAR_KEEP
    exclude_tools: tuple[str, ...] = ()
    clear_at_least: int = 0
    clear_inputs: bool = False


@dataclass(frozen=True)
class CompactContext:
    """Compact the session once the prompt reaches ``trigger_tokens`` (0: now); ``pause``: answer with the mark
    alone, no reply (the client continues with another request)."""

    trigger_tokens: int = COMPACT_TRIGGER_TOKENS
    pause: bool = False


ContextEdit = ClearToolResults | CompactContext


@dataclass
class AppliedEdit:
    """What one edit did. ``cleared_tokens``: the slots per KV head it freed (tokens no longer held whole).
    A compaction carries the conversation the session held when it ran (``conversation``), which the front
    end stores under a mark id (``mark``)."""

    kind: str  # "clear_tool_uses" or "compaction"
    cleared_tool_uses: int = 0
    cleared_tokens: int = 0
    conversation: list[dict] = field(default_factory=list)
    mark: str | None = None


@dataclass
class EditsApplied:
    """A turn's stream item before its reply's text: the edits applied to the session (a dialect shows a
    compaction before the reply)."""

    edits: list[AppliedEdit]


def apply_edits(session, edits: list[ContextEdit], prompt_tokens: int) -> list[AppliedEdit]:
    """Apply the edits whose trigger the prompt reached, in order, to ``session`` (its conversation prefilled)."""
    memory = session.memory
    if not isinstance(memory, MemoryManager):
        return []
    applied = []
    for edit in edits:
        if isinstance(edit, ClearToolResults):
            done = clear_tool_results(session, memory, edit, prompt_tokens)
        else:
            done = compact_context(session, memory, edit) if prompt_tokens >= edit.trigger_tokens else None
        if done is not None:
            applied.append(done)
    return applied


def paused(edits: list[ContextEdit], applied: list[AppliedEdit]) -> bool:
    """Whether the turn ends at its compaction (``CompactContext.pause``), with no reply."""
    compacted = any(a.kind == "compaction" for a in applied)
    return compacted and any(isinstance(e, CompactContext) and e.pause for e in edits)


def tool_uses(session) -> list[list]:
    """The session's tool uses, oldest first: each the assistant turn that made the calls (None where the
    results follow no call the session holds), then its results' segments (one per call)."""
    uses, call = [], None
    for segment in session.segments:
        if segment.kind == "tool_call":
            call = segment
            uses.append([segment])
        elif segment.kind == "tool_output":
            if call is None:  # a result whose call the session does not hold: a use of its own
                uses.append([None])
            uses[-1].append(segment)
        else:
            call = None
    return uses


def clear_tool_results(session, memory: MemoryManager, edit: ClearToolResults, prompt_tokens: int):
    uses = tool_uses(session)
    results = [s for use in uses for s in use[1:]]
    triggered = (edit.trigger_tokens is not None and prompt_tokens >= edit.trigger_tokens) or (
        edit.trigger_tool_uses is not None and len(results) >= edit.trigger_tool_uses
    )
    if not triggered:
        return None
    clearable = [s for s in results if s.tool_name not in edit.exclude_tools]
    cleared = clearable[: max(0, len(clearable) - edit.keep)]
    ids = [s.id for s in cleared]
    if edit.clear_inputs:
        gone = set(ids)
        ids += [call.id for call, *outputs in uses if call is not None and all(o.id in gone for o in outputs)]
    freed = memory.clear(ids, at_least=edit.clear_at_least)
    if not freed:
        return None
    return AppliedEdit("clear_tool_uses", sum(s.id in freed for s in cleared), round(sum(freed.values())))


def compact_context(session, memory: MemoryManager, edit: CompactContext) -> AppliedEdit:
    """Compact to the policy's target (a cap-forced compaction's), and below half the trigger, if it has one."""
    held = session.cache.slots_per_head
    goal = int(memory.slot_cap() * memory.policy.budget.target_fraction)
    if edit.trigger_tokens > 0:
        goal = min(goal, edit.trigger_tokens // 2)
    if held > goal:
        memory.compact(trigger="client", goal_slots=max(goal, 1))
    return AppliedEdit("compaction", cleared_tokens=held - session.cache.slots_per_head, conversation=session.messages)


def mark_content(mark: str) -> str:
    return MARK_PREFIX + mark


def mark_of(content: str | None) -> str | None:
    """The mark id a round-tripped compaction's opaque content names, or None (another server's compaction)."""
    if isinstance(content, str) and content.startswith(MARK_PREFIX):
        return content[len(MARK_PREFIX) :]
    return None
