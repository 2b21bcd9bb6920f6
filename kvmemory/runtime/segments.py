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


@dataclass(frozen=True)
class Segment:
    """One appended unit: a message, a tool output, a block of text. Positions are logical: [start, end).

    Never changed in place (``replaced`` makes the changed copy), so a snapshot of a session holds its
    segments as they are: taking one, before every decoded token, copies a list, not every segment."""

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

    def replaced(self, **changes) -> Segment:
        """A copy with ``changes`` (the instance dict copied: several times faster than ``dataclasses.replace``,
        and a segment changes on every decoded token)."""
        twin = object.__new__(Segment)
        twin.__dict__.update(self.__dict__, **changes)
        return twin

    def to_dict(self) -> dict:
        return asdict(self)
