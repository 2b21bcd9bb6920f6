"""Name → compaction method. ``get_method("attention_matching", selector="omp")`` builds one from params."""

from __future__ import annotations

from pydantic import ValidationError

from kvmemory.compaction.base import CompactionMethod
from kvmemory.errors import InvalidArgumentError

METHODS: dict[str, type[CompactionMethod]] = {}


def register(cls: type[CompactionMethod]) -> type[CompactionMethod]:
    METHODS[cls.name] = cls
    return cls


def get_method(name: str, **params) -> CompactionMethod:
    _load_builtin()
    if name not in METHODS:
        raise InvalidArgumentError(f"unknown compaction method {name!r}; known: {', '.join(sorted(METHODS))}")
    try:
        return METHODS[name](**params)
    except (ValidationError, TypeError) as err:
        raise InvalidArgumentError(f"invalid parameters for compaction method {name!r}: {err}") from None


def available_methods() -> list[str]:
    _load_builtin()
    return sorted(METHODS)


_builtin_loaded = False


def _load_builtin() -> None:
    """Register the built-in methods once (a user's own ``register`` before that never hides them)."""
    global _builtin_loaded
    if _builtin_loaded:
        return
    _builtin_loaded = True
    from kvmemory.compaction import methods

    for name in methods.__all__:
        obj = getattr(methods, name)
        if isinstance(obj, type) and issubclass(obj, CompactionMethod):
            METHODS.setdefault(obj.name, obj)
