"""The RoPE kernel rotates the query and key heads in place to exactly torch's bits (x·cos + roll(x)·signed_sin)
on any token count, head count and even head dim, leaves every other head as it was, and refuses bad input
with a clear error before it writes anything."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmemory.runtime.forward import rope_tables

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def tables(tokens: int, dim: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_tables`` of random angles, as a rotary embedding gives them: (1, T, D), halves repeated."""
    angles = torch.rand(1, tokens, dim // 2, generator=generator) * 1000
    angles = torch.cat((angles, angles), dim=-1)
    return rope_tables(angles.cos(), angles.sin())


@settings(max_examples=120, deadline=None)
@given(
    st.integers(1, 300),
    st.integers(1, 16),
    st.integers(0, 4),
    st.sampled_from([2, 6, 8, 16, 18, 64, 128]),
    st.integers(0, 2**16),
)
def test_the_kernel_rotates_to_torchs_bits_and_leaves_the_other_heads(
    cpu_kernels, tokens, rotated, unrotated, dim, seed
):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, rotated + unrotated, dim, generator=generator) * 3
    cos, signed_sin = tables(tokens, dim, generator)
    heads = x[:, :, :rotated]
    expected = heads * cos[:, None] + heads.roll(dim // 2, dims=-1) * signed_sin[:, None]
    out = x.clone()
    cpu_kernels.rope_(out[0], cos, signed_sin, rotated)
    assert torch.equal(out[:, :, :rotated], expected)
    assert torch.equal(out[:, :, rotated:], x[:, :, rotated:])


def test_bad_input_is_refused_before_anything_is_written(cpu_kernels):
    x = torch.randn(4, 3, 8)
    cos, signed_sin = tables(4, 8, torch.Generator().manual_seed(0))
    before = x.clone()
    cases = [
        ((x.double(), cos, signed_sin, 2), "float32"),
        ((torch.randn(4, 3, 7), cos, signed_sin, 2), "even head dim"),
        ((x, cos, signed_sin, 4), r"heads must be in \[0, 3\]"),
        ((x, cos[:3], signed_sin, 2), "contiguous \\(tokens, head dim\\) tables"),
        ((x, cos, signed_sin.t().contiguous().t(), 2), "contiguous \\(tokens, head dim\\) tables"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            cpu_kernels.rope_(*args)
    assert torch.equal(x, before)
