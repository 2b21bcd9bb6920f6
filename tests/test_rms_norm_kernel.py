"""The RMSNorm kernel is torch's ``rms_norm`` within float rounding on any row count, width and layout; each
row's result is the same whatever else the call holds; bad input is refused with a clear error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmemory.kernels import cpu_ops
from tests.conftest import kernel_rows

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@settings(max_examples=150, deadline=None)
@given(
    kernel_rows(70, [1, 7, 8, 31, 32, 33, 64, 576, 1000], [1e-3, 1.0, 300.0]),
    st.sampled_from([1e-6, 1e-5, 0.1]),
    st.integers(0, 2**16),
)
def test_the_kernel_is_torchs_rms_norm_within_rounding(x, eps, seed):
    weight = torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(seed))
    out = cpu_ops().rms_norm(x, weight, eps)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, F.rms_norm(x, (x.shape[-1],), weight, eps), rtol=2e-6, atol=1e-6)


def test_a_rows_result_does_not_depend_on_the_other_rows():
    x = torch.randn(200, 576)
    weight = torch.randn(576)
    together = cpu_ops().rms_norm(x, weight, 1e-5)  # several threads
    alone = torch.cat([cpu_ops().rms_norm(x[i : i + 1], weight, 1e-5) for i in range(200)])
    assert torch.equal(together, alone)


def test_bad_input_is_refused_with_a_clear_error():
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops().rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.randn(8), 1e-5)
    with pytest.raises(RuntimeError, match="as long as the inputs' last dimension"):
        cpu_ops().rms_norm(torch.randn(2, 8), torch.randn(9), 1e-5)
