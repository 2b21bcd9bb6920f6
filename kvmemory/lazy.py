"""Package names imported on first use (PEP 562), so that ``import kvmemory`` and the command line's ``--help``
load no model code, torch included, until a name is used."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, tuple[str, str]], extra: str | None = None):
    """A package's ``__getattr__`` and ``__dir__`` for ``exports`` (name -> (module, attribute)); with
    ``extra``, a name used without that extra installed is refused naming it (``kvmemory.extras``)."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if extra is not None:
            from kvmemory.extras import require

            require(extra, f"{package}.{name}")
        module, attribute = exports[name]
        value = getattr(importlib.import_module(module), attribute)
        namespace[name] = value  # once found, an ordinary attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
