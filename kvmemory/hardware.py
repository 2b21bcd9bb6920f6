"""What the CPU offers, where it decides which kernel is fastest."""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether the CPU has bf16 dot products (AVX-512 BF16 or AMX): there bf16 GEMMs beat fp32 ones 2-4×,
    elsewhere they run 6-7× slower (torch's probes are private, so they are probed defensively)."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool((probe and probe()) or (amx and amx()))


@functools.cache
def cpu_has_fbgemm() -> bool:
    """Whether torch has its x86 fbgemm kernels (AVX2 and up), among them the fp16-weight GEMM that keeps
    activations, accumulation and output in fp32."""
    engines = torch.backends.quantized.supported_engines
    return "fbgemm" in engines and hasattr(torch.ops.quantized, "linear_prepack_fp16")
