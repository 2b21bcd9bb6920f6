"""Weights kept in a GGUF file's blocks (kernels/linear_gguf.cpp, runtime/gguf_weights.py): the blocks read as
the ``gguf`` package reads them, the product against a reference of the same arithmetic, and a model on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from hypothesis import given
from hypothesis import strategies as st

from kvmemory import Engine, InvalidArgumentError
from kvmemory.runtime.gguf_weights import GgufEmbedding, GgufLinear
from kvmemory.runtime.named_models import SMALL_MODEL, model_file
from kvmemory.runtime.weights import fuse_linears

pytestmark = pytest.mark.usefixtures("cpu_kernels")

SMALL_FORMATS = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]  # 32 inputs a block: gguf quantizes them
K_QUANTS = [T.Q4_K, T.Q6_K]  # 256 inputs a block: random blocks with sane scales
BLOCK_BYTES = {T.Q4_K: 144, T.Q6_K: 210}


def random_blocks(kind: T, rows: int, columns: int, seed: int) -> np.ndarray:
    """(rows, bytes) of ``kind``: every level and sub-scale bit drawn at random, the fp16 scales in a sane range."""
    rng = np.random.default_rng(seed)
    if kind in SMALL_FORMATS:
        return quantize(rng.standard_normal((rows, columns)).astype(np.float32), kind)
    blocks = rng.integers(0, 256, (rows, columns // 256, BLOCK_BYTES[kind]), dtype=np.uint8)
    scales = (rng.random((rows, columns // 256, 2)) * 0.01 + 0.001).astype(np.float16).view(np.uint8)
    if kind == T.Q4_K:  # d, dmin lead the block
        blocks[..., :4] = scales.reshape(rows, columns // 256, 4)
    else:  # d ends it
        blocks[..., 208:] = scales[..., :2]
    return blocks.reshape(rows, -1)


def input_levels(x: torch.Tensor, per: int) -> torch.Tensor:
    """The kernel's quantized input rows: per ``per`` inputs, round(x / d) · d with d = max |x| / 127."""
    groups = x.double().reshape(x.shape[0], -1, per)
    d = groups.abs().amax(-1, keepdim=True) / 127
    levels = torch.where(d > 0, groups / torch.where(d > 0, d, 1), 0).round()
    return (levels * d).reshape(x.shape)


def weight_of(blocks: np.ndarray, kind: T, columns: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks, kind)).reshape(blocks.shape[0], columns)


@pytest.mark.parametrize("kind", SMALL_FORMATS + K_QUANTS, ids=lambda k: k.name)
def test_blocks_read_as_the_gguf_package_reads_them(cpu_kernels, kind):
    columns = 512
    blocks = random_blocks(kind, 24, columns, seed=int(kind))
    rows = torch.tensor([5, 0, 23, 5])
    ours = cpu_kernels.dequantize_gguf(torch.from_numpy(blocks), int(kind), columns, rows)
    assert torch.equal(ours, weight_of(blocks, kind, columns)[rows])


@given(
    kind=st.sampled_from(SMALL_FORMATS + K_QUANTS),
    rows=st.integers(1, 11),
    blocks_across=st.integers(1, 3),
    outputs=st.sampled_from([16, 33, 72]),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_the_product_is_the_integer_arithmetic_it_promises(
    cpu_kernels, kind, rows, blocks_across, outputs, scale, seed
):  # noqa: E501
    """Against the same arithmetic in float64: inputs quantized per 256 (K-quants) or per 32 (an odd number of
    32-input blocks included), times the file's weights; each row's result the same bits alone or with others."""
    per = 256 if kind in K_QUANTS else 32
    columns = blocks_across * per * (1 if kind in K_QUANTS else 9)  # 32-input formats: 9 groups, chunks of 4
    blocks = random_blocks(kind, outputs, columns, seed)
    weight = weight_of(blocks, kind, columns).double()
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, columns, generator=generator) * scale
    x[0, :per] = 0  # a block of zeros: its scale 0
    bias = torch.randn(outputs, generator=generator)
    expected = input_levels(x, per) @ weight.T + bias.double()
    # the file's layout, and Q4_K's interleaved by 8 rows where the rows fill groups of 8
    file_layout = (torch.from_numpy(blocks), int(kind))
    layouts = {t: b for b, t in [file_layout, cpu_kernels.repack_gguf(*file_layout, columns)]}
    assert len(layouts) == (2 if kind == T.Q4_K and outputs % 8 == 0 else 1)
    for layout, b in layouts.items():
        assert torch.equal(cpu_kernels.dequantize_gguf(b, layout, columns, torch.arange(outputs)), weight.float())
        y = cpu_kernels.linear_gguf(x, b, layout, bias)
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
        alone = torch.cat([cpu_kernels.linear_gguf(x[i : i + 1].contiguous(), b, layout, bias) for i in range(rows)])
        assert torch.equal(y, alone)


def test_blocks_that_do_not_fit_are_refused_by_name(cpu_kernels):
    blocks = torch.from_numpy(random_blocks(T.Q4_K, 4, 512, seed=0))
    with pytest.raises(RuntimeError, match="a row of 256 inputs takes 144 bytes"):
        cpu_kernels.linear_gguf(torch.randn(2, 256), blocks, int(T.Q4_K))
    with pytest.raises(RuntimeError, match="is not kept in blocks"):
        cpu_kernels.linear_gguf(torch.randn(2, 512), blocks, int(T.Q2_K))
    with pytest.raises(RuntimeError, match="out of 0..3"):
        cpu_kernels.dequantize_gguf(blocks, int(T.Q4_K), 512, torch.tensor([4]))


def test_layers_of_one_type_fuse_and_compute_what_their_parts_did():
    parts = [GgufLinear(torch.from_numpy(random_blocks(T.Q4_K, n, 256, seed=n)), int(T.Q4_K), 256) for n in (32, 8)]
    x = torch.randn(3, 256)
    before = [p(x) for p in parts]
    fused = fuse_linears(parts)
    assert torch.equal(fused(x), torch.cat(before, dim=-1))
    assert all(torch.equal(p(x), b) for p, b in zip(parts, before))
    assert parts[0].blocks.untyped_storage().data_ptr() == fused.blocks.untyped_storage().data_ptr()  # views
    other = GgufLinear(torch.from_numpy(random_blocks(T.Q6_K, 8, 256, seed=1)), int(T.Q6_K), 256)
    assert fuse_linears([parts[0], other]) is None  # types differ: side by side instead


def test_the_embedding_expands_the_rows_it_looks_up():
    blocks = random_blocks(T.Q8_0, 50, 64, seed=3)
    embedding = GgufEmbedding(torch.from_numpy(blocks), int(T.Q8_0), 64)
    ids = torch.tensor([[3, 49, 3]])
    assert torch.equal(embedding(ids), weight_of(blocks, T.Q8_0, 64)[ids])
    assert torch.equal(embedding.as_head().rows(torch.tensor([49])), embedding(torch.tensor([49])))


def test_weights_gguf_needs_a_gguf_file(tmp_path):
    with pytest.raises(InvalidArgumentError, match="load a .gguf file or a named model"):
        Engine.from_pretrained(str(tmp_path), weights="gguf")


@pytest.mark.small_model
def test_the_small_model_on_its_blocks_reads_and_writes_as_fp32_does(small_engine):
    """Every linear layer and the embedding on the file's blocks (Q4_1, the embedding and head Q8_0): the same
    greedy reply as the dequantized model, and teacher-forced NLL within 0.01 nats."""
    from benchmarks.texts import source_text

    blocks = Engine.from_pretrained(str(model_file(SMALL_MODEL)), weights="gguf")
    assert blocks.weights == "gguf"
    assert isinstance(blocks.model.model.embed_tokens, GgufEmbedding)
    assert isinstance(blocks.model.lm_head, GgufLinear)
    ids = blocks.tokenizer.encode(source_text(4000), add_special_tokens=False)[:384]
    nll, replies = {}, {}
    for name, engine in (("blocks", blocks), ("fp32", small_engine)):
        session = engine.session()
        session.append_tokens(ids[:256])
        nll[name] = float(-session.logprobs(ids[256:]).mean())
        replies[name] = session.generate(max_new_tokens=12).token_ids
    assert abs(nll["blocks"] - nll["fp32"]) < 0.01
    assert replies["blocks"] == replies["fp32"]
