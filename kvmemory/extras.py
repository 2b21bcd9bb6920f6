"""The optional parts of kvmemory and the extra that installs each. The core (``pip install kvmemory``) is the
engine and the memory; a part used without its extra is refused with one line naming the ``pip install``."""

from __future__ import annotations

import importlib.util

from kvmemory.errors import KVMemoryError

# extra -> the top-level modules it installs (pyproject.toml's [project.optional-dependencies])
EXTRAS = {
    "langchain": ("langchain_core", "langchain", "langgraph"),
    "agent": ("langchain_core", "langchain", "langgraph", "pytest"),
    "serve": ("fastapi", "uvicorn"),
    "ray": ("fastapi", "uvicorn", "ray"),
    "plot": ("matplotlib",),
}


class MissingExtraError(KVMemoryError, ImportError):
    """A part of kvmemory was used without the extra that installs its dependencies."""


def missing_modules(extra: str) -> list[str]:
    return [module for module in EXTRAS[extra] if importlib.util.find_spec(module) is None]


def require(extra: str, what: str) -> None:
    """Raise ``MissingExtraError`` naming ``pip install 'kvmemory[extra]'`` if ``what`` cannot run here."""
    missing = missing_modules(extra)
    if missing:
        raise MissingExtraError(f"{what} needs {', '.join(missing)}: pip install 'kvmemory[{extra}]'")
