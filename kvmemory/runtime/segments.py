"""Segments: what each part of a session's context is. Every cache slot records the segment it came from."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SEGMENT_KINDS = (
    "system",
    "user",
    "assistant",
    "reasoning",
    "tool_call",
    "tool_output",
    "tool_schema",
    "recall",
    "text",
)


@dataclass
class Segment:
    """One appended unit: a message, a tool output, a block of text. Positions are logical: [start, end)."""

    id: int
    kind: str
    start: int
    end: int
    role: str | None = None
    tool_name: str | None = None
    tags: tuple[str, ...] = ()
    message_index: int | None = None
    text: str = ""
    compactions: int = 0
    cap_forced: int = 0  # compactions that went below the segment's rule budget because the cap required it
    meta: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict:
        return asdict(self)
