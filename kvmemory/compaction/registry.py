"""Name → compaction method. Each method module registers its class with ``@register``;
``get_method("attention_matching", selector="omp")`` builds one from params.

Importing ``kvmemory.compaction`` imports every built-in method module, so the built-ins are always
registered before any lookup; a user's ``@register`` adds to them and never hides them.
"""

from __future__ import annotations

from pydantic import ValidationError

from kvmemory.compaction.base import CompactionMethod
from kvmemory.errors import InvalidArgumentError

METHODS: dict[str, type[CompactionMethod]] = {}


def register(cls: type[CompactionMethod]) -> type[CompactionMethod]:
    """Class decorator: make ``cls`` available by its ``name`` to ``get_method`` and memory policies."""
    if not (isinstance(cls, type) and issubclass(cls, CompactionMethod)):
        raise InvalidArgumentError(f"register takes a CompactionMethod subclass, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"{cls.__name__} needs a class attribute `name` to be registered")
    if name in METHODS and METHODS[name].__module__.startswith("kvmemory.") and METHODS[name] is not cls:
        raise InvalidArgumentError(f"{name!r} is a built-in compaction method; register yours under another name")
    METHODS[name] = cls
    return cls


def get_method(name: str, **params) -> CompactionMethod:
    """A new instance of the method registered as ``name``, configured by ``params``."""
    if name not in METHODS:
        raise InvalidArgumentError(f"unknown compaction method {name!r}; known: {', '.join(sorted(METHODS))}")
    try:
        return METHODS[name](**params)
    except (ValidationError, TypeError) as err:
        raise InvalidArgumentError(f"invalid parameters for compaction method {name!r}: {err}") from None


def available_methods() -> list[str]:
    return sorted(METHODS)
