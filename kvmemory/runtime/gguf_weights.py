"""Weights kept in a GGUF file's own quantized blocks: the linear layers and the token embedding.

A Q4_K_M file stores most weights in 4.5 bits (Q4_K) and some in 6.5 (Q6_K); expanded to fp16 they are 3.5×
the bytes, and a decoded token reads every one of them, so on a CPU decoding is bound by that read. With
``weights="gguf"`` (the CPU default for a GGUF file) the engine keeps the file's blocks as they are and
multiplies them by integer dot products (``kernels/linear_gguf.cpp``): each layer's input rows are quantized
to 8 bits per group of 32 (as llama.cpp does for the same blocks), so a layer's output moves by about 0.5%
of its size from the product on fp32 inputs, where the weights themselves are the file's to the last bit.
Blocks of Q4_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are kept; a weight in another type is expanded to
fp16 (``store_linear_weights``). The token embedding keeps its blocks too and expands only the rows it
looks up; an output head tied to it reads the same blocks.
"""

from __future__ import annotations

import torch
from torch import nn

# GGML type ids of the blocks the kernel multiplies
KEPT_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
INPUTS_PER_BLOCK = {2: 32, 3: 32, 6: 32, 7: 32, 8: 32, 12: 256, 14: 256}
INTERLEAVED = 1000  # the kernel's id of a type's layout interleaved by 8 rows: INTERLEAVED + the GGML id


def type_name(ggml_type: int) -> str:
    name = next(k for k, v in KEPT_TYPES.items() if v == ggml_type % INTERLEAVED)
    return name if ggml_type < INTERLEAVED else f"{name} by 8 rows"


def kept(ggml_type: int, in_features: int) -> bool:
    """Whether a weight of this type and input size stays in its blocks (``linear_gguf`` multiplies them)."""
    return ggml_type in INPUTS_PER_BLOCK and in_features % INPUTS_PER_BLOCK[ggml_type] == 0


class GgufLinear(nn.Module):
    """A linear layer on a GGUF tensor's blocks (``blocks``: (out_features, bytes of a row) uint8, each row
    one output feature's blocks as the file stores them), fp32 in and out. With ``interleave``, Q4_K blocks
    are rearranged by groups of 8 rows (``repack_gguf``: the same bytes but 2.8% more, the 12 bytes of a block's
    packed 6-bit scales spread to one a byte), which the kernel multiplies about twice as fast. Each output is
    one sum in a fixed order, so a row's result is the same bit for bit whichever rows share its pass, and
    layers of one type fuse (``side_by_side``)."""

    def __init__(
        self,
        blocks: torch.Tensor,
        ggml_type: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        interleave: bool = True,
    ):
        super().__init__()
        if interleave and ggml_type < INTERLEAVED:
            blocks, ggml_type = torch.ops.kvmemory.repack_gguf(blocks, ggml_type, in_features)
        self.in_features, self.ggml_type = in_features, ggml_type
        self.out_features = blocks.shape[0] * (8 if ggml_type >= INTERLEAVED else 1)
        self.register_buffer("blocks", blocks)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @classmethod
    def side_by_side(cls, parts: list[GgufLinear]) -> GgufLinear | None:
        """One layer computing ``parts`` side by side (their rows joined, the parts' blocks becoming views of
        the joined ones); None unless all share a type, an input size and having a bias or not."""
        if len({(p.ggml_type, p.in_features, p.bias is None) for p in parts}) != 1:
            return None
        blocks = torch.cat([p.blocks for p in parts])
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        fused = cls(blocks, parts[0].ggml_type, parts[0].in_features, bias, interleave=False)
        row, block_row = 0, 0
        for part in parts:
            part.blocks = blocks[block_row : block_row + part.blocks.shape[0]]
            if bias is not None:
                part.bias = nn.Parameter(fused.bias[row : row + part.out_features], requires_grad=False)
            row, block_row = row + part.out_features, block_row + part.blocks.shape[0]
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()
        out = torch.ops.kvmemory.linear_gguf(rows, self.blocks, self.ggml_type, self.bias)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows ``ids`` in fp32 (the output head's rows of given tokens: counter-causal)."""
        return torch.ops.kvmemory.dequantize_gguf(self.blocks, self.ggml_type, self.in_features, ids.reshape(-1))

    @property
    def weight(self) -> torch.Tensor:
        """The whole weight in fp32, expanded on each read (for readers of the dense matrix; the forward never is)."""
        return self.rows(torch.arange(self.out_features))

    @property
    def packed_bytes(self) -> int:
        return self.blocks.numel()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={type_name(self.ggml_type)}"


class GgufEmbedding(nn.Module):
    """A token embedding on a GGUF tensor's blocks: a lookup expands the rows of its tokens only."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.ggml_type = blocks.shape[0], embedding_dim, ggml_type
        self.register_buffer("blocks", blocks)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = torch.ops.kvmemory.dequantize_gguf(self.blocks, self.ggml_type, self.embedding_dim, ids.reshape(-1))
        return rows.view(*ids.shape, self.embedding_dim)

    def as_head(self) -> GgufLinear:
        """The output head tied to this embedding: the same blocks (not interleaved: they are held once)."""
        return GgufLinear(self.blocks, self.ggml_type, self.embedding_dim, interleave=False)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, ggml_type={self.ggml_type}"
