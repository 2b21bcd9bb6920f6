"""Name → compaction method. ``get_method("attention_matching", selector="omp")`` builds one from params."""

from __future__ import annotations

from kvmemory.compaction.base import CompactionMethod

METHODS: dict[str, type[CompactionMethod]] = {}


def register(cls: type[CompactionMethod]) -> type[CompactionMethod]:
    METHODS[cls.name] = cls
    return cls


def get_method(name: str, **params) -> CompactionMethod:
    _load_builtin()
    if name not in METHODS:
        raise KeyError(f"unknown compaction method {name!r}; known: {', '.join(sorted(METHODS))}")
    return METHODS[name](**params)


def available_methods() -> list[str]:
    _load_builtin()
    return sorted(METHODS)


def _load_builtin() -> None:
    if METHODS:
        return
    from kvmemory.compaction import methods

    for name in methods.__all__:
        obj = getattr(methods, name)
        if isinstance(obj, type) and issubclass(obj, CompactionMethod):
            register(obj)
