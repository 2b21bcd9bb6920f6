"""The Session's conversation: appends (text, tokens, chat messages), history edits by diffing, the open
reply as the conversation's last message, and the lossless transcript (search, recall, export)."""

from __future__ import annotations

import json

from kvmemory.errors import InvalidArgumentError, InvalidMessageError
from kvmemory.runtime.chat import encode_text
from kvmemory.runtime.conversation import (
    common_prefix,
    fingerprint,
    message_kind,
    planned_segment,
    render_with_spans,
    same_messages,
    tools_key,
    validate_messages,
)
from kvmemory.runtime.search import rank_segments
from kvmemory.runtime.segments import SEGMENT_KINDS, Segment
from kvmemory.runtime.session_forward import ProgressCallback
from kvmemory.runtime.session_state import exclusive


class SessionChat:
    """Part of ``Session`` (``runtime/session.py``): messages, transcript and recall."""

    @property
    def messages(self) -> list[dict]:
        """The conversation so far, the reply being generated (or last generated) included."""
        with self._lock:
            reply = self._reply_message()
            return [dict(m) for m in self._messages] + ([reply] if reply is not None else [])

    def transcript(self) -> list[dict]:
        """The full text of every segment, compacted or not."""
        with self._lock:
            self._refresh_open_segment_text()
            return [seg.to_dict() for seg in self.segments]

    @exclusive
    def append_text(
        self, text: str, kind: str = "text", role: str | None = None, progress: ProgressCallback | None = None, **meta
    ) -> Segment:
        """Tokenize ``text`` and append it as one segment, after everything held. The text is text: no special
        tokens are added, and a string that spells a control token (``<|im_end|>``) is tokenized as its characters;
        ``append_tokens`` appends control tokens where a caller means them."""
        if not isinstance(text, str):
            raise InvalidArgumentError(f"append_text takes a string, got {type(text).__name__}")
        if self.engine.tokenizer is None:
            raise InvalidArgumentError("this engine has no tokenizer: use append_tokens")
        ids = encode_text(self.engine.tokenizer, text)
        return self._append_tokens(ids, kind=kind, role=role, progress=progress, text=text, **meta)

    @exclusive
    def append_tokens(
        self,
        token_ids,
        kind: str = "text",
        role: str | None = None,
        progress: ProgressCallback | None = None,
        text: str | None = None,
        tool_name: str | None = None,
        tags: tuple[str, ...] = (),
        **meta,
    ) -> Segment:
        """Append token ids as a new segment, after everything held; they are prefilled in chunks."""
        return self._append_tokens(token_ids, kind, role, progress, text, tool_name, tags, **meta)

    def _append_tokens(
        self, token_ids, kind="text", role=None, progress=None, text=None, tool_name=None, tags=(), **meta
    ):
        if kind not in SEGMENT_KINDS:
            raise InvalidArgumentError(f"unknown segment kind {kind!r}; kinds are {', '.join(SEGMENT_KINDS)}")
        ids = self._validate_tokens(token_ids)
        text = text if text is not None else self._decode(ids)
        probe = Segment(
            -1, kind, len(self.tokens), len(self.tokens) + len(ids), role, tool_name, tuple(tags), text=text
        )
        self._check_room(len(ids), [probe])
        segment = self._new_segment(kind, role=role, tool_name=tool_name, tags=tuple(tags), meta=meta)
        self._extend_segment(segment.id, ids, progress)
        self._replace_segment(segment.id, text=text)
        self._after_append()
        return self.segment(segment.id)

    @exclusive
    def append_messages(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        progress: ProgressCallback | None = None,
    ) -> list[Segment]:
        """Append chat messages after everything the session holds (earlier messages, generated replies, raw
        text): only the new messages are rendered and prefilled. Returns the segments created.

        Changing ``tools`` changes how the conversation's start renders, so it re-renders the conversation
        like ``set_messages``."""
        held = self._close_reply()
        new = validate_messages(messages, held)
        if held and tools_key(tools) != self._tools_key:
            return self._set_messages(held + new, tools, add_generation_prompt, progress)
        return self._append_rendered(held, new, tools, add_generation_prompt, progress)

    @exclusive
    def set_messages(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        progress: ProgressCallback | None = None,
    ) -> list[Segment]:
        """Make the session hold exactly this conversation, prefilling only what the cache lacks.

        A conversation that extends the held one is appended (as ``append_messages``). Otherwise the
        rendered tokens are diffed against the held ones and the session is cut back to the start of the
        first segment that differs, then re-prefilled from there: this is how history is edited, and what
        followed the cut (messages, replies, raw text) is replaced. Returns the segments created or extended.
        """
        if (
            add_generation_prompt
            and self._reply is not None
            and self._reply[1] == len(self.tokens)
            and self._tools_key == tools_key(tools)
            and same_messages(messages, self._messages)
        ):
            return []  # already holds exactly this conversation and its generation prompt
        held = self._close_reply()
        messages = validate_messages(messages, [])
        same_tools = not held or tools_key(tools) == self._tools_key
        if same_tools and len(messages) >= len(held) and same_messages(messages[: len(held)], held):
            return self._append_rendered(held, messages[len(held) :], tools, add_generation_prompt, progress)
        return self._set_messages(messages, tools, add_generation_prompt, progress)

    def _append_rendered(self, held, new, tools, add_generation_prompt, progress) -> list[Segment]:
        """Render ``new`` in the context of ``held`` and append only their tokens after the session's end."""
        renderer = self.renderer
        base = renderer.render(held, tools) if held else []
        full = renderer.render(held + new, tools, add_generation_prompt)
        if full[: len(base)] != base:  # a template that re-renders earlier turns: fall back to diffing
            outside = [seg for seg in self.segments if seg.message_index is None]
            if outside:  # the diff would cut them away: an append must not lose anything
                raise InvalidMessageError(
                    "this chat template renders the held messages differently once these follow them (Qwen's joins "
                    f"consecutive tool messages in one turn), and rendering them again would drop the {len(outside)} "
                    "segment(s) appended outside messages (append_text, append_tokens, a reply generated without a "
                    "generation prompt); keep such a session to messages, or append this one as text"
                )
            return self._set_messages(held + new, tools, add_generation_prompt, progress)
        if self.memory is None or len(self.tokens) + len(full) - len(base) > self.engine.position_limit:
            self._check_room(len(full) - len(base))  # what cannot fit fails before each message is located
        if progress is not None:
            progress(0, len(full) - len(base))
        ends = renderer.message_ends(held + new, tools, len(held), full, progress)
        starts = [len(base)] + ends[:-1]
        delta = len(full) - len(base)
        base_at = len(self.tokens) - len(base)
        probes = [planned_segment(m, base_at + s, base_at + e) for m, s, e in zip(new, starts, ends)]
        self._check_room(delta, probes)
        touched, first = [], len(held)  # (``held`` is the session's own list: it grows as messages go in)
        step = self.memory.chunk_size() if self.memory is not None else self.prefill_chunk_size
        for run in runs_of_one_chunk([e - s for s, e in zip(starts, ends)], step):
            if len(run) == 1:
                (k,) = run
                segment = self._message_segment(new[k], first + k)
                if ends[k] > starts[k]:
                    self._extend_segment(segment.id, full[starts[k] : ends[k]], progress)
                made = [segment.id]
            else:
                pieces = [(k, full[starts[k] : ends[k]]) for k in run]
                made = self._prefill_messages(pieces, progress, lambda k: self._message_segment(new[k], first + k))
            for k, segment_id in zip(run, made):
                segment = self._replace_segment(segment_id, text=new[k]["content"])
                self._messages.append(new[k])
                self._message_spans.append((fingerprint(new[k]), segment.start, segment.end))
                self._after_append()
                touched.append(self.segment(segment_id))
        if add_generation_prompt:
            touched.append(self._open_prompt(full[ends[-1] if ends else len(base) :], progress))
        self._tools_key = tools_key(tools)
        return touched

    def _message_segment(self, message: dict, index: int) -> Segment:
        """A new segment for the conversation's ``index``-th message."""
        return self._new_segment(
            message_kind(message),
            role=message["role"],
            tool_name=message.get("name"),
            tags=tuple(message.get("tags", ())),
            message_index=index,
        )

    def _open_prompt(self, ids: list[int], progress) -> Segment:
        """Append the template's generation prompt as the start of an assistant segment."""
        seg = self._new_segment("assistant", role="assistant")
        start = len(self.tokens)
        if ids:
            self._extend_segment(seg.id, ids, progress)
        self._replace_segment(seg.id, text=self._decode(ids))
        self._reply = (start, len(self.tokens))
        self._after_append()
        return self.segment(seg.id)

    def _set_messages(self, messages, tools, add_generation_prompt, progress) -> list[Segment]:
        same_tools = self._tools_key == tools_key(tools)
        held = self._message_spans if same_tools else None
        limit = self.engine.position_limit
        target, spans = render_with_spans(
            self.renderer, messages, tools, add_generation_prompt, held, self.tokens, limit, progress
        )
        self._tools_key = tools_key(tools)
        self._flush_pending()
        keep = common_prefix(self.tokens, target)
        cut = self._cut_point(keep)
        if cut == len(self.tokens):
            probes = [planned_segment(m, max(s, cut), e) for m, (s, e) in zip(messages, spans) if e > cut]
            self._check_room(len(target) - cut, probes)
        elif cut < len(self.tokens):
            self._truncate(cut)
        cut = len(self.tokens)  # truncation may have had to go further back
        touched = []
        prompt = [(spans[-1][1] if spans else 0, len(target))] if add_generation_prompt else []
        for index, (start, end) in enumerate(spans + prompt):
            if end <= cut:
                continue
            is_prompt = index == len(messages)
            msg = None if is_prompt else messages[index]
            seg = self._segment_starting_at(start)
            if seg is None:
                seg = self._new_segment(
                    "assistant" if is_prompt else message_kind(msg),
                    role="assistant" if is_prompt else msg["role"],
                    tool_name=None if is_prompt else msg.get("name"),
                    tags=() if is_prompt else tuple(msg.get("tags", ())),
                    message_index=None if is_prompt else index,
                )
            elif not is_prompt:
                seg = self._replace_segment(seg.id, message_index=index)
            seg = self._extend_segment(seg.id, target[max(start, cut) : end], progress)
            self._replace_segment(seg.id, text=self._decode(self.tokens[seg.start : seg.end]))
            self._after_append()
            touched.append(self.segment(seg.id))
        self._messages = messages
        self._message_spans = [(fingerprint(m), s, e) for m, (s, e) in zip(messages, spans)]
        self._reply = (spans[-1][1] if spans else 0, len(target)) if add_generation_prompt else None
        return touched

    def _reply_message(self) -> dict | None:
        """The open reply (text after the generation prompt) as an assistant message, if it has any."""
        if self._reply is None or self._reply[1] >= len(self.tokens):
            return None
        ids = self.tokens[self._reply[1] :]
        if ids and ids[-1] in self.engine.eos_token_ids:
            ids = ids[:-1]
        return {"role": "assistant", "content": self._decode(ids)}

    def _close_reply(self) -> list[dict]:
        """Before new messages: the open reply becomes the conversation's assistant message (with the
        template's end-of-turn tokens), or an unused generation prompt is taken back. Returns the messages."""
        if self._reply is None:
            return self._messages
        prompt_start, content_start = self._reply
        message = self._reply_message()
        self._reply = None
        if message is None:
            if prompt_start < len(self.tokens):
                self._truncate(prompt_start)
            return self._messages
        ended = self.tokens[-1] in self.engine.eos_token_ids
        closing = self.renderer.turn_end()
        if ended and closing[:1] == self.tokens[-1:]:
            closing = closing[1:]
        if closing:
            self._check_room(len(closing))
            self._extend_segment(self._reply_segment().id, closing, None)
        self._refresh_open_segment_text()
        self._messages.append(message)
        self._message_spans.append((fingerprint(message), prompt_start, len(self.tokens)))
        return self._messages

    def _cut_point(self, keep: int) -> int:
        """Where to cut the cache so that whole segments are re-prefilled: the start of the segment holding ``keep``."""
        if keep >= len(self.tokens):
            return len(self.tokens)
        for seg in self.segments:
            if seg.start <= keep < seg.end:
                return seg.start
        return keep

    def _segment_starting_at(self, start: int) -> Segment | None:
        for seg in reversed(self.segments):
            if seg.start == start and seg.end >= start:
                return seg
        return None

    def _refresh_open_segment_text(self) -> None:
        if self.segments:
            seg = self.segments[-1]
            if seg.kind == "assistant" or not seg.text:
                self.segments[-1] = seg.replaced(text=self._decode(self.tokens[seg.start : seg.end]))

    def export_transcript(self, path=None) -> list[dict]:
        """Every segment with its full text (compacted or not); written as JSON when ``path`` is given."""
        data = self.transcript()
        if path is not None:
            from pathlib import Path

            Path(path).write_text(json.dumps({"session": self.id, "segments": data}, indent=1))
        return data

    def search(self, query: str, kinds: list[str] | None = None, limit: int = 3) -> list[Segment]:
        """Segments whose full text best matches ``query`` (BM25 over the transcript), best first.

        ``kinds`` narrows the search (e.g. ``["tool_output"]``); earlier recalls are never returned, so
        recalling a search hit does not make it its own best match."""
        if not isinstance(query, str):
            raise InvalidArgumentError(f"search takes a string query, got {type(query).__name__}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise InvalidArgumentError(f"limit must be an integer ≥ 0, got {limit!r}")
        with self._lock:
            self._refresh_open_segment_text()
            pool = [s for s in self.segments if s.kind != "recall" and (kinds is None or s.kind in kinds)]
            return [seg for _, seg in rank_segments(query, pool)[:limit]]

    @exclusive
    def recall(self, segment_id: int) -> Segment:
        """Re-insert a segment's full text verbatim at the end of the context, saying what it is.

        In a chat session it arrives as a user message (so later ``set_messages`` calls stay in sync);
        otherwise as a text segment of kind ``recall``.
        """
        seg = self.segment(segment_id)
        self._refresh_open_segment_text()
        label = seg.kind + (f" from tool {seg.tool_name}" if seg.tool_name else "")
        header, footer = f"[recalled segment {seg.id}: {label}, verbatim]\n", f"\n[end of recalled segment {seg.id}]"
        if self._messages or self._reply is not None:
            message = {"role": "user", "content": header + seg.text + footer, "recall_of": seg.id}
            held = self._close_reply()
            return self._append_rendered(
                held, [message], None if not self._tools_key else json.loads(self._tools_key), False, None
            )[-1]
        ids = self.tokens[seg.start : seg.end]  # the exact tokens, whatever the cache kept of them
        if self.engine.tokenizer is not None:
            encode = self.engine.tokenizer.encode
            ids = encode(header, add_special_tokens=False) + ids + encode(footer, add_special_tokens=False)
            text = header + seg.text + footer
        else:
            text = seg.text
        return self._append_tokens(ids, kind="recall", role="user", text=text, recall_of=seg.id)


def runs_of_one_chunk(sizes: list[int], chunk: int) -> list[list[int]]:
    """Consecutive messages (by index) grouped to be prefilled together: each run at most ``chunk`` tokens,
    except a message longer than that, which runs alone (and is prefilled in chunks)."""
    runs: list[list[int]] = []
    total = 0
    for k, size in enumerate(sizes):
        if not runs or total + size > chunk:
            runs.append([])
            total = 0
        runs[-1].append(k)
        total += size
    return runs
