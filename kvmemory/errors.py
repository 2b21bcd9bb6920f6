"""Exceptions raised by kvmemory. Every one names the problem; none leaves a session half-changed."""


class KVMemoryError(Exception):
    """Base class of every kvmemory error."""


class ModelLoadError(KVMemoryError):
    """The model could not be found or loaded."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture is not one kvmemory can run (it names the architecture)."""


class ContextLengthError(KVMemoryError, ValueError):
    """An input would push the session past the model's maximum position."""


class InvalidTokenError(KVMemoryError, ValueError):
    """Token ids outside the model's vocabulary."""


class InvalidPlanError(KVMemoryError, ValueError):
    """A compaction plan whose shapes or indices do not fit the cache."""


class SessionClosedError(KVMemoryError):
    """The session was closed; its cache is gone."""


class MemoryCapError(KVMemoryError):
    """An append cannot fit under the memory cap even after compacting everything compactable."""


class PolicyError(KVMemoryError, ValueError):
    """An invalid memory policy (it names the field and the reason)."""


class ToolCallParseError(KVMemoryError, ValueError):
    """The model wrote a tool call that is not valid JSON or lacks a name; ``call_text`` is what it wrote."""

    def __init__(self, message: str, call_text: str = ""):
        super().__init__(message)
        self.call_text = call_text


class InvalidArgumentError(KVMemoryError, ValueError):
    """An argument outside its valid range (sampling parameters, limits); it names the argument."""


class InvalidMessageError(KVMemoryError, ValueError):
    """A chat message the session cannot render: unknown role, non-text content, a tool message with no tool name."""


class SessionBusyError(KVMemoryError, RuntimeError):
    """A call arrived while a stream is open on the session: finish or close the stream first."""


class SessionFileError(KVMemoryError, ValueError):
    """A saved session that cannot be loaded: missing, truncated, damaged, or of another format version."""


class ModelMismatchError(SessionFileError):
    """A saved session whose cache belongs to another model (architecture, shapes, dtype or weights)."""


class StoreFullError(KVMemoryError, TimeoutError):
    """A session store at its memory budget could not admit a session in time (every resident session is in use)."""


class KVMemoryDeprecationWarning(DeprecationWarning):
    """A name kvmemory renamed: it still works, and says what to use instead. The project's own tests fail on
    one (``filterwarnings`` in ``pyproject.toml``), so kvmemory never calls its own deprecated names."""
