"""Shared fixtures: tiny random-initialised models of every supported architecture, and the default model."""

from __future__ import annotations

import copy
import functools
import shutil

import pytest
import torch
from hypothesis import strategies as st
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvmemory import Engine
from kvmemory.kernels import cpu_ops

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 4096}),
}


def tiny_model(arch: str, seed: int = 0, **overrides):
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **extra, **overrides})
    return model_cls(config).eval()


def reference_copy(model):
    """An independent copy of ``model`` that runs stock transformers sdpa."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    return ref.eval()


CAN_BUILD_KERNELS = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and shutil.which("c++") is not None


@pytest.fixture(scope="module")
def cpu_kernels():
    """kvmemory's CPU kernels, for the tests of them (``pytestmark = pytest.mark.usefixtures("cpu_kernels")``):
    skipped where they cannot be built, required to build where they can."""
    if not CAN_BUILD_KERNELS:
        pytest.skip("the kernels need an x86-64 CPU with AVX2 and a C++ compiler")
    ops = cpu_ops()
    assert ops is not None, "the kernels should build here"
    return ops


@st.composite
def kernel_rows(draw, max_rows: int, widths: list[int], scales: list[float]) -> torch.Tensor:
    """(1, rows, width) fp32 input for a row-wise kernel: contiguous, or every other row of a larger tensor."""
    rows, width, scale = draw(st.integers(1, max_rows)), draw(st.sampled_from(widths)), draw(st.sampled_from(scales))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if draw(st.booleans()):
        return torch.randn(1, 2 * rows, width, generator=generator)[:, ::2] * scale
    return torch.randn(1, rows, width, generator=generator) * scale


@pytest.fixture(params=list(ARCHITECTURES))
def arch(request):
    return request.param


@pytest.fixture
def tiny_pair(arch):
    """(Engine over a tiny model, a stock-transformers copy of the same weights)."""
    model = tiny_model(arch)
    ref = reference_copy(model)
    return Engine(model), ref


@pytest.fixture
def tiny_engine():
    return Engine(tiny_model("llama"))


@functools.cache
def load_default_engine() -> Engine:
    """The default model, loaded once per test run (fixtures and state machines share it), with fp32
    weights: the reference the exactness tests hold to (16-bit weights round each layer's output, so a
    cached forward and a fresh one may differ in the last place; tests/test_weights.py covers them)."""
    return Engine.from_pretrained("default", weights="fp32")


@pytest.fixture(scope="session")
def default_engine():
    return load_default_engine()


def random_tokens(n: int, seed: int = 1, vocab: int = TINY["vocab_size"]) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()
