"""Shared fixtures: tiny random-initialised models of every supported architecture, and the default model.

Also what makes a run reproducible and honest about what it could not run:

* hypothesis runs derandomised under CI (``CI`` set), so a failure there reproduces with the same command;
  elsewhere it draws afresh and prints the blob that reproduces a failure. Neither has a deadline: a loaded
  machine is slow, not wrong.
* tests that need the small model (SmolLM2-135M: the ``small_engine`` fixture or ``@pytest.mark.small_model``),
  the default coder model (``@pytest.mark.coder_model``: end-to-end smoke tests) or the command sandbox
  (``@pytest.mark.sandbox``) are skipped, with the reason, where that is not installed; under CI they fail
  instead, since the README's test command installs all three.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import os
import shutil
import time

import pytest
import torch
from hypothesis import HealthCheck, settings
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
from kvmemory.errors import ModelLoadError
from kvmemory.kernels import cpu_ops
from kvmemory.runtime.named_models import DEFAULT_NAMED_MODEL, SMALL_MODEL, model_file

IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")
settings.register_profile(
    "ci", derandomize=True, print_blob=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", print_blob=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if IN_CI else "dev")


def pytest_report_header(config):
    return f"hypothesis profile: {settings.get_current_profile_name()} ({'derandomised' if IN_CI else 'random draws'})"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "small_engine" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.small_model)


MODELS = {"small_model": SMALL_MODEL, "coder_model": DEFAULT_NAMED_MODEL}


@functools.cache
def missing(requirement: str) -> str | None:
    """Why ``requirement`` ("small_model", "coder_model" or "sandbox") cannot be met here, or None."""
    if requirement in MODELS:
        try:
            model_file(MODELS[requirement], pull_if_missing=False)
        except ModelLoadError as error:
            return str(error)
        return None
    if shutil.which("bwrap") is None:
        return "the command sandbox needs bubblewrap: apt-get install bubblewrap"
    return None


def pytest_runtest_setup(item):
    for requirement in ("small_model", "coder_model", "sandbox"):
        if item.get_closest_marker(requirement) and (reason := missing(requirement)):
            if IN_CI:
                pytest.fail(f"{reason} (the README's test command installs it)", pytrace=False)
            pytest.skip(reason)


TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
QWEN_CODER = {"num_key_value_heads": 2, "tie_word_embeddings": True}
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 4096}),
    # Qwen2.5-Coder's layout: q/k/v biases, a tied output head, 7 (0.5B) or 6 (1.5B) query heads per KV head
    "qwen2-7to1": (Qwen2Config, Qwen2ForCausalLM, {"hidden_size": 224, "num_attention_heads": 14, **QWEN_CODER}),
    "qwen2-6to1": (Qwen2Config, Qwen2ForCausalLM, {"hidden_size": 192, "num_attention_heads": 12, **QWEN_CODER}),
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
def load_small_engine() -> Engine:
    """The small model (SmolLM2-135M), loaded once per test run (fixtures and state machines share it), with fp32
    weights: the reference the exactness tests hold to (16-bit weights round each layer's output, so a
    cached forward and a fresh one may differ in the last place; tests/test_weights.py covers them)."""
    return Engine.from_pretrained(SMALL_MODEL, weights="fp32")


@pytest.fixture(scope="session")
def small_engine():
    return load_small_engine()


def wait_until(condition, timeout: float = 60.0, what: str = "the condition") -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds (a bug fails the test, never hangs it).
    For states another thread reaches with no event to wait on; the timeout bounds a hang, not a race."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not hold within {timeout:.0f} s")
        time.sleep(0.005)


async def until(condition, timeout: float = 60.0, what: str = "the condition") -> None:
    """``wait_until`` for a coroutine: yields to the event loop between polls."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not hold within {timeout:.0f} s")
        await asyncio.sleep(0.005)


def random_tokens(n: int, seed: int = 1, vocab: int = TINY["vocab_size"]) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()
