"""The attention function that adds each slot's bias β (registered with transformers on import)."""

from kvmemory.attention.biased_sdpa import (
    ATTENTION_NAME,
    ATTENTION_PATHS,
    flex_ragged,
    folded_sdpa,
    kvmemory_attention,
    mask_sdpa,
)

__all__ = ["ATTENTION_NAME", "ATTENTION_PATHS", "flex_ragged", "folded_sdpa", "kvmemory_attention", "mask_sdpa"]
