"""The 4-bit linear kernel (kvmemory/kernels/linear_int4.cpp) computes x·Wᵀ + b from GGUF Q4_1 groups (fp16 steps
and lows) exactly as dequantised, with fp32 sums, and each output is the same bit for bit whichever rows and
panels share its call (a decode tile widens in registers, a larger one through a buffer) and whichever vector
width computes it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmemory import Engine
from kvmemory.kernels import cpu_ops
from kvmemory.runtime.weights import PackedInt4Linear, fuse_linears, int4_groups, store_linear_weights
from tests.test_batching import lone_and_packed_logprobs
from tests.test_weights import four_bit, four_bit_model

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.fixture(scope="module")
def ops():
    assert cpu_ops() is not None, "the kernels should build here"
    return cpu_ops()


def q4_1(outputs: int, inputs: int, generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Levels, steps and lows of a random Q4_1 weight (steps and lows as fp16 values, as the file stores them)."""
    levels = torch.randint(0, 16, (outputs, inputs), generator=generator)
    steps = (torch.rand(outputs, inputs // 32, generator=generator) * 0.02).half().float()
    lows = (-torch.rand(outputs, inputs // 32, generator=generator) * 0.15).half().float()
    return levels, steps, lows


def dequantised(levels, steps, lows) -> torch.Tensor:
    """w = q·step + low in fp64, as a GGUF reader widens the groups."""
    outputs, inputs = levels.shape
    grouped = levels.double().view(outputs, -1, 32) * steps.double()[..., None] + lows.double()[..., None]
    return grouped.view(outputs, inputs)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 110),  # decode tiles of 1..8 rows (widened in registers), tiles of up to 48 through a buffer
    groups=st.one_of(st.integers(1, 2), st.integers(3, 14)),  # one chunk of k (64 inputs), or several
    outputs=st.integers(1, 150),  # whole and partial panels of 16, groups of 1..8 panels
    has_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_product_is_the_dequantised_weights_and_a_row_never_depends_on_the_others(
    ops, rows, groups, outputs, has_bias, seed
):
    g = torch.Generator().manual_seed(seed)
    inputs = 32 * groups
    levels, steps, lows = q4_1(outputs, inputs, g)
    bias = torch.randn(outputs, generator=g) if has_bias else None
    x = torch.randn(rows, inputs, generator=g) * 30
    packed, scales = ops.pack_int4_weight(levels.to(torch.uint8), steps, lows)
    out = ops.linear_int4(x, packed, scales, outputs, bias)
    weight = dequantised(levels, steps, lows)
    expected = x.double() @ weight.T + (0 if bias is None else bias.double())
    tolerance = 2e-6 * (x.double().abs() @ weight.abs().T) + 1e-5  # fp32 sums of |terms|, fp32 weights
    assert out.shape == (rows, outputs) and out.dtype == torch.float32
    assert ((out.double() - expected).abs() <= tolerance).all()
    for i in range(0, rows, 7):  # alone, and in a pass of other rows: the same bits
        assert torch.equal(ops.linear_int4(x[i : i + 1].contiguous(), packed, scales, outputs, bias)[0], out[i])
        assert torch.equal(ops.linear_int4(x[i : i + 9].contiguous(), packed, scales, outputs, bias), out[i : i + 9])


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 60), groups=st.integers(1, 6), outputs=st.integers(1, 90), seed=st.integers(0, 2**16))
def test_both_vector_widths_give_the_same_bits(ops, rows, groups, outputs, seed):
    if ops.linear_fp16_vector_bits() != 512:
        pytest.skip("the 16-float path needs a CPU with AVX-512")
    g = torch.Generator().manual_seed(seed)
    levels, steps, lows = q4_1(outputs, 32 * groups, g)
    packed, scales = ops.pack_int4_weight(levels.to(torch.uint8), steps, lows)
    x = torch.randn(rows, 32 * groups, generator=g)
    wide = ops.linear_int4(x, packed, scales, outputs, None, vector_bits=512)
    assert torch.equal(wide, ops.linear_int4(x, packed, scales, outputs, None, vector_bits=256))
    assert torch.equal(wide, ops.linear_int4(x, packed, scales, outputs))  # the default takes the widest


def test_a_four_bit_layer_keeps_its_weights_exactly_and_fused_layers_compute_their_parts():
    torch.manual_seed(0)
    linears = [torch.nn.Linear(96, n) for n in (64, 32, 48)]  # whole panels of 16
    for i, linear in enumerate(linears):
        linear.weight.data = four_bit(linear.weight, seed=i)
    parts = [PackedInt4Linear.of(linear, only_if_exact=True) for linear in linears]
    x = torch.randn(5, 7, 96)
    alone = [part(x) for part in parts]
    for linear, out in zip(linears, alone):
        expected = x.double() @ linear.weight.double().T + linear.bias.double()
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    fused = fuse_linears(parts)
    assert type(fused) is PackedInt4Linear and fused.out_features == 144
    assert torch.equal(fused(x), torch.cat(alone, dim=-1))
    for part, out in zip(parts, alone):  # the parts read views of the fused panels now
        assert part.packed.untyped_storage().data_ptr() == fused.packed.untyped_storage().data_ptr()
        assert torch.equal(part(x), out)
    gaussian = torch.nn.Linear(96, 32)
    assert PackedInt4Linear.of(gaussian, only_if_exact=True) is None  # not 4-bit: "auto" keeps it in fp16
    uneven = [PackedInt4Linear.of(torch.nn.Linear(96, n)) for n in (64, 40)]
    assert fuse_linears(uneven) is None  # 40 outputs: a part panel


def test_levels_steps_and_lows_come_back_from_a_four_bit_weight():
    weight = four_bit(torch.nn.Linear(64, 48).weight, seed=3)
    levels, steps, lows = int4_groups(weight)
    rebuilt = dequantised(levels.reshape(weight.shape), steps, lows)
    torch.testing.assert_close(rebuilt.float(), weight.detach(), rtol=0, atol=1e-6 * float(weight.abs().max()))


def test_with_int4_weights_a_packed_pass_gives_each_session_its_lone_logits_bit_for_bit():
    model = store_linear_weights(four_bit_model("qwen2"), "int4")  # q, k and v carry biases
    assert any(type(m) is PackedInt4Linear for m in model.modules())
    alone, together = lone_and_packed_logprobs(Engine(model))
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


def test_bad_input_is_refused(ops):
    g = torch.Generator().manual_seed(0)
    levels, steps, lows = q4_1(20, 64, g)
    packed, scales = ops.pack_int4_weight(levels.to(torch.uint8), steps, lows)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="float32 tensor"):
        ops.linear_int4(x.double(), packed, scales, 20)
    with pytest.raises(RuntimeError, match="pack_int4_weight"):
        ops.linear_int4(x, packed.float(), scales, 20)
    with pytest.raises(RuntimeError, match="scales must be"):
        ops.linear_int4(x, packed, scales.float(), 20)
    with pytest.raises(RuntimeError, match="x has 32 features"):
        ops.linear_int4(torch.randn(3, 32), packed, scales, 20)
    with pytest.raises(RuntimeError, match="does not fill 2 panels"):
        ops.linear_int4(x, packed, scales, 16)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.linear_int4(x, packed, scales, 20, torch.randn(19))
    with pytest.raises(RuntimeError, match="vector_bits must be 0"):
        ops.linear_int4(x, packed, scales, 20, None, vector_bits=128)
    if ops.linear_fp16_vector_bits() == 256:
        with pytest.raises(RuntimeError, match="needs a CPU with AVX-512"):
            ops.linear_int4(x, packed, scales, 20, None, vector_bits=512)
    with pytest.raises(RuntimeError, match="positive multiple of 32"):
        ops.pack_int4_weight(levels[:, :40].to(torch.uint8), steps, lows)
    with pytest.raises(RuntimeError, match="levels must lie in 0..15"):
        ops.pack_int4_weight((levels + 1).to(torch.uint8), steps, lows)
    with pytest.raises(RuntimeError, match="steps and lows must be"):
        ops.pack_int4_weight(levels.to(torch.uint8), steps[:, :1], lows)
