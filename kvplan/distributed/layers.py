"""Tensor-parallel layers of the Llama-family model (`kvplan.models.llama`).

Column-parallel projections (fused ``qkv_proj``, ``gate_up_proj``) are plain ``nn.Linear``
layers with this rank's output rows (`kvplan.distributed.sharding` slices them); no
communication. Row-parallel projections (``o_proj``, ``down_proj``) hold this rank's input
columns, so each rank's product is a partial sum: `RowParallelLinear` all-reduces it, once per
attention block and once per MLP block. `VocabParallelEmbedding` holds this rank's vocabulary
rows and all-reduces the lookups (each token's row is non-zero on exactly one rank, so the sum
is exact); the LM head is a column-parallel ``[per_rank, hidden]`` matrix whose logits
`TPContext.gather_vocab` joins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvplan.distributed.context import TPContext


class RowParallelLinear(nn.Linear):
    """``x [T, in_features / size] -> sum over ranks of x @ W_r^T`` ``[T, out_features]``
    (no bias: the Llama family's row-parallel projections have none)."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext) -> None:
        start, end = tp.split(in_features, "in_features")
        super().__init__(end - start, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce_(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Embedding):
    """This rank's ``per_rank`` rows of a ``[vocab_size, dim]`` embedding; ``forward(ids [T])``
    returns the full ``[T, dim]`` lookup on every rank (one all-reduce)."""

    def __init__(self, vocab_size: int, dim: int, tp: TPContext) -> None:
        start, end, per_rank = tp.vocab_range(vocab_size)
        super().__init__(per_rank, dim)
        self.tp = tp
        self.vocab_start, self.vocab_end = start, end

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce_(h)


def row_linear(in_features: int, out_features: int, tp: TPContext | None) -> nn.Linear:
    """A bias-free projection whose input is split across ranks (all-reduced under ``tp``;
    a plain ``nn.Linear`` on one device)."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=False)
    return RowParallelLinear(in_features, out_features, tp)


def vocab_embedding(vocab_size: int, dim: int, tp: TPContext | None) -> nn.Embedding:
    """The token embedding: this rank's padded vocabulary rows under ``tp`` (also its share
    of a tied head), the whole ``nn.Embedding`` on one device."""
    if tp is None:
        return nn.Embedding(vocab_size, dim)
    return VocabParallelEmbedding(vocab_size, dim, tp)
