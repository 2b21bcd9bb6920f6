"""The logits kernel's argmax is torch's (ties, NaN and -inf included) and its log-sum-exp is torch's within
float rounding, on any row count and width; each row's values are the same whatever else the call holds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmemory.kernels import cpu_ops
from kvmemory.runtime.logits import argmax_rows, logsumexp_rows

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@st.composite
def logits(draw):
    """Rows of logits: widths around the kernel's 8- and 32-float steps, ties, and a few -inf or NaN entries."""
    rows, width = draw(st.integers(1, 6)), draw(st.sampled_from([1, 5, 8, 13, 32, 33, 100, 257, 4099]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    scale = draw(st.sampled_from([0.1, 4.0, 40.0]))
    x = torch.randn(rows, width, generator=generator) * scale
    if draw(st.booleans()):  # ties: a few values repeated
        x = x.round()
    for value in draw(st.lists(st.sampled_from([float("-inf"), float("nan"), float("inf")]), max_size=2)):
        x[draw(st.integers(0, rows - 1)), draw(st.integers(0, width - 1))] = value
    if draw(st.booleans()):
        x[draw(st.integers(0, rows - 1))] = float("-inf")
    return x


@settings(max_examples=200, deadline=None)
@given(logits())
def test_argmax_and_logsumexp_are_torchs_and_each_row_is_the_same_alone(x):
    torch.testing.assert_close(argmax_rows(x), x.argmax(-1), rtol=0, atol=0)
    expected = torch.logsumexp(x, -1)
    torch.testing.assert_close(logsumexp_rows(x), expected, rtol=2e-6, atol=2e-6, equal_nan=True)
    together = logsumexp_rows(x)
    for r in range(x.shape[0]):
        alone = logsumexp_rows(x[r : r + 1].clone())
        assert torch.equal(alone, together[r : r + 1]) or (alone.isnan().all() and together[r].isnan())
        assert torch.equal(argmax_rows(x[r : r + 1].clone()), argmax_rows(x)[r : r + 1])


def test_bad_logits_are_refused_by_name():
    ops = cpu_ops()
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.argmax_rows(torch.zeros(4))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.logsumexp_rows(torch.zeros(2, 4, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="at least one column"):
        ops.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="at least one column"):
        ops.logsumexp_rows(torch.zeros(2, 0))
