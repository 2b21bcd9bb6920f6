"""The attention function that adds each slot's bias β (registered with transformers on import), and the CPU
kernel it runs a decode step on (``decode_kernel``)."""

from kvmemory.attention import decode_kernel
from kvmemory.attention.biased_sdpa import (
    ATTENTION_NAME,
    ATTENTION_PATHS,
    flex_ragged,
    folded_sdpa,
    kvmemory_attention,
    mask_sdpa,
)

__all__ = [
    "ATTENTION_NAME",
    "ATTENTION_PATHS",
    "decode_kernel",
    "flex_ragged",
    "folded_sdpa",
    "kvmemory_attention",
    "mask_sdpa",
]
