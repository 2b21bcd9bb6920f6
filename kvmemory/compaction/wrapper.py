"""Methods around an inner method (``REAL``, ``Lines``, ``Fitted``): the inner given by instance or by name.

A wrapper changes one thing about its inner method (the head budgets, the unit of selection, the values) and
passes everything else through: which reference queries and recordings the inner method needs, whether its
scores are one scale across segments, and its ranking of positions.
"""

from __future__ import annotations

from kvmemory.compaction.base import CacheSpan, CompactionMethod, MethodConfig
from kvmemory.compaction.registry import get_method


class Wrapper(CompactionMethod):
    """``Wrapper(inner)`` with an instance, or ``Wrapper(inner="snapkv", inner_params={...})`` by name; its
    config names the inner method and its params either way (``inner``, ``inner_params``)."""

    def __init__(self, inner: CompactionMethod | str | None = None, config: MethodConfig | None = None, **params):
        if isinstance(inner, CompactionMethod):  # composed by instance: the config names it and its params
            params.setdefault("inner_params", inner.config.model_dump())
            super().__init__(config, inner=inner.name, **params)
            self.inner = inner
        else:
            super().__init__(config, **({} if inner is None else {"inner": inner}), **params)
            self.inner = get_method(self.config.inner, **self.config.inner_params)

    @property
    def uses_queries(self) -> bool:
        return self.inner.uses_queries

    @property
    def global_scores(self) -> bool:
        return self.inner.global_scores

    @property
    def needs_last_layer_inputs(self) -> bool:
        return self.inner.needs_last_layer_inputs

    @property
    def needs_surprisal(self) -> bool:
        return self.inner.needs_surprisal

    def position_scores(self, span: CacheSpan):
        return self.inner.position_scores(span)
