"""The gated MLP kernel's silu(gate)·up is torch's within float rounding on any row count, width and layout
(large gates of either sign included); each row's result is the same whatever else the call holds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

from tests.conftest import kernel_rows

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@settings(max_examples=150, deadline=None)
@given(kernel_rows(40, [2, 14, 16, 18, 64, 66, 3072], [0.1, 3.0, 40.0, 200.0]))
def test_the_kernel_is_torchs_silu_times_up_within_rounding(cpu_kernels, x):
    out = cpu_kernels.silu_mul(x)
    assert out.shape == (*x.shape[:-1], x.shape[-1] // 2)
    torch.testing.assert_close(out, reference(x), rtol=4e-6, atol=1e-6)


def test_a_rows_result_does_not_depend_on_the_other_rows(cpu_kernels):
    x = torch.randn(100, 3072) * 5
    alone = torch.cat([cpu_kernels.silu_mul(x[i : i + 1]) for i in range(100)])
    assert torch.equal(cpu_kernels.silu_mul(x), alone)


def test_bad_input_is_refused_with_a_clear_error(cpu_kernels):
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.silu_mul(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="even dimension"):
        cpu_kernels.silu_mul(torch.randn(2, 7))
