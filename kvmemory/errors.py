"""Exceptions raised by kvmemory. Every one names the problem; none leaves a session half-changed."""


class KVMemoryError(Exception):
    """Base class of every kvmemory error."""


class ModelLoadError(KVMemoryError):
    """The model could not be found or loaded."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture is not one kvmemory can run (it names the architecture)."""


class ContextLengthError(KVMemoryError):
    """An input would push the session past the model's maximum position."""


class InvalidTokenError(KVMemoryError):
    """Token ids outside the model's vocabulary."""


class InvalidPlanError(KVMemoryError):
    """A compaction plan whose shapes or indices do not fit the cache."""


class SessionClosedError(KVMemoryError):
    """The session was closed; its cache is gone."""


class MemoryCapError(KVMemoryError):
    """An append cannot fit under the memory cap even after compacting everything compactable."""


class PolicyError(KVMemoryError, ValueError):
    """An invalid memory policy (it names the field and the reason)."""


class ToolCallParseError(KVMemoryError, ValueError):
    """The model wrote a tool call that is not valid JSON or lacks a name."""
