"""The fp16-weight linear kernel (kvmemory/kernels/linear_fp16.cpp) computes x·Wᵀ + b with only the weight
rounded, and each output is the same bit for bit whichever rows and panels share its call, and whichever vector
width (8 or 16 floats) computes it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmemory import Engine
from kvmemory.kernels import cpu_ops
from kvmemory.runtime.weights import PackedFp16Linear, fuse_linears, store_linear_weights
from tests.conftest import tiny_model
from tests.test_batching import lone_and_packed_logprobs

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.fixture(scope="module")
def ops():
    assert cpu_ops() is not None, "the kernels should build here"
    return cpu_ops()


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 110),  # past two tiles of 48 rows: lone blocks of 1..6 rows, wide blocks of 1 or 2
    inputs=st.one_of(st.integers(0, 70), st.integers(120, 400)),  # one chunk of k, or several (128 a chunk)
    outputs=st.integers(1, 90),  # whole and partial panels of 16, groups of 1..4 panels
    has_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_product_rounds_only_the_weight_and_a_row_never_depends_on_the_others(
    ops, rows, inputs, outputs, has_bias, seed
):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(outputs, inputs, generator=g).half()
    bias = torch.randn(outputs, generator=g) if has_bias else None
    x = torch.randn(rows, inputs, generator=g) * 30  # products past fp16's range: nothing is rounded but W
    packed = ops.pack_fp16_weight(weight)
    out = ops.linear_fp16(x, packed, outputs, bias)
    expected = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    tolerance = 1e-5 * (x.double().abs() @ weight.double().abs().T) + 1e-5  # fp32 sums of |terms|
    assert out.shape == (rows, outputs) and out.dtype == torch.float32
    assert ((out.double() - expected).abs() <= tolerance).all()
    for i in range(0, rows, 7):  # alone, and in a pass of other rows: the same bits
        assert torch.equal(ops.linear_fp16(x[i : i + 1].contiguous(), packed, outputs, bias)[0], out[i])
        assert torch.equal(ops.linear_fp16(x[i : i + 9].contiguous(), packed, outputs, bias), out[i : i + 9])


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 110),  # 16-float blocks: a lone block of 1..8 rows, or tiles of blocks of up to 8
    inputs=st.one_of(st.integers(0, 70), st.integers(120, 400)),
    outputs=st.integers(1, 90),
    has_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_both_vector_widths_give_the_same_bits(ops, rows, inputs, outputs, has_bias, seed):
    if ops.linear_fp16_vector_bits() != 512:
        pytest.skip("the 16-float path needs a CPU with AVX-512")
    g = torch.Generator().manual_seed(seed)
    packed = ops.pack_fp16_weight(torch.randn(outputs, inputs, generator=g).half())
    bias = torch.randn(outputs, generator=g) if has_bias else None
    x = torch.randn(rows, inputs, generator=g) * 30
    wide = ops.linear_fp16(x, packed, outputs, bias, vector_bits=512)
    assert torch.equal(wide, ops.linear_fp16(x, packed, outputs, bias, vector_bits=256))
    assert torch.equal(wide, ops.linear_fp16(x, packed, outputs, bias))  # the default takes the widest


def test_fused_layers_compute_their_parts_bit_for_bit():
    torch.manual_seed(0)
    linears = [torch.nn.Linear(96, n) for n in (64, 32, 48)]  # whole panels of 16
    parts = [PackedFp16Linear(linear) for linear in linears]
    x = torch.randn(5, 7, 96)
    alone = [part(x) for part in parts]
    fused = fuse_linears(parts)
    assert type(fused) is PackedFp16Linear and fused.out_features == 144
    assert torch.equal(fused(x), torch.cat(alone, dim=-1))
    for linear, part, out in zip(linears, parts, alone):  # the parts read views of the fused panels now
        assert part.panels.untyped_storage().data_ptr() == fused.panels.untyped_storage().data_ptr()
        assert torch.equal(part(x), out) and torch.equal(part.weight, linear.weight.detach().half())
    assert fuse_linears([PackedFp16Linear(torch.nn.Linear(96, n)) for n in (64, 40)]) is None  # 40: a part panel


@pytest.mark.parametrize("scored", [1, 6])  # rows per session: 1 or 6 alone, 3 or 18 together
def test_with_fp16_weights_a_packed_pass_gives_each_session_its_lone_logits_bit_for_bit(scored):
    # q, k and v carry biases; layers wide enough that fbgemm's kernels would round 1 and 3 rows differently
    model = store_linear_weights(tiny_model("qwen2", hidden_size=512, intermediate_size=1024), "fp16")
    alone, together = lone_and_packed_logprobs(Engine(model), scored)
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


def test_bad_input_is_refused(ops):
    packed = ops.pack_fp16_weight(torch.randn(20, 8).half())
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="float32 tensor"):
        ops.linear_fp16(x.double(), packed, 20)
    with pytest.raises(RuntimeError, match="float32 tensor"):
        ops.linear_fp16(torch.randn(8, 3).T, packed, 20)  # not contiguous
    with pytest.raises(RuntimeError, match="pack_fp16_weight"):
        ops.linear_fp16(x, packed.float(), 20)
    with pytest.raises(RuntimeError, match="x has 7 features"):
        ops.linear_fp16(torch.randn(3, 7), packed, 20)
    with pytest.raises(RuntimeError, match="does not fill 2 panels"):
        ops.linear_fp16(x, packed, 16)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.linear_fp16(x, packed, 20, torch.randn(19))
    with pytest.raises(RuntimeError, match="vector_bits must be 0"):
        ops.linear_fp16(x, packed, 20, None, vector_bits=128)
    if ops.linear_fp16_vector_bits() == 256:
        with pytest.raises(RuntimeError, match="needs a CPU with AVX-512"):
            ops.linear_fp16(x, packed, 20, None, vector_bits=512)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.pack_fp16_weight(torch.randn(2, 3, 4))
