"""The compressors (CSA / HCA KV entries, the indexer's keys) and the lightning indexer.

A compressor projects every token to ``kv`` and ``gate`` (``[T, k*C]``; ``k = 2`` on CSA layers,
whose two halves are the "Ca" and "Cb" series) and adds the learned position bias of the
token's offset ``p % r`` inside its window. The hybrid family groups the rows into the windows
that close in the step; `pool` turns each window ``[w, C]`` into one entry::

    entry = RMSNorm( sum_rows softmax_rows(gate) * kv )      (per channel, softmax in fp32)
    entry = RoPE_compress(entry, position = j * r)

CSA rows ``0..r-1`` are the previous window's "Ca" half (zero kv / ``-inf`` gate before
position 0, which gives them weight 0), rows ``r..2r-1`` this window's "Cb" half; the position
bias is the one of each row's own token (Hugging Face adds it before splitting the halves).

The indexer (CSA only) compresses its own ``index_head_dim``-wide keys the same way and scores
entry ``j`` for a query ``t`` as ``sum_h w[t, h] * relu(q[t, h] . key_j)``, with
``q = RoPE_compress(q_b(q_residual))`` (no norm) and ``w = weights_proj(x) / sqrt(Hi) /
sqrt(Ci)``: Hugging Face scales ``relu(q . k)`` by ``Ci^-0.5`` and the weights by ``Hi^-0.5``;
both are folded into ``index_weights`` here (a positive factor commutes with ``relu``).
"""

from __future__ import annotations

import torch
from torch import nn

from kvplan.backends.hybrid.api import HybridStepContext
from kvplan.models.deepseek_v4.layers import Rope
from kvplan.ops._dispatch import env_flag
from kvplan.ops.compress_store import (
    GateBias,
    PoolWeights,
    biased_gate,
    fused_compress_enabled,
    pool_windows,
)
from kvplan.ops.rope import norm_rope, rope_and_scale

# the indexer's query RoPE and its head weights' fp32 scaling in one launch
# (`kvplan.ops.rope.rope_and_scale`, the same bits); ``KVPLAN_FUSED_INDEX_WEIGHTS=0`` runs
# ``norm_rope`` then the cast and the product (two more launches a CSA layer), for A/B runs
FUSED_INDEX_WEIGHTS = env_flag("KVPLAN_FUSED_INDEX_WEIGHTS", True)


def pool(
    kv: torch.Tensor,
    gate: torch.Tensor,
    positions: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    rope: Rope,
) -> torch.Tensor:
    """Pool windows into entries (``kvplan.ops.compress_store.pool_windows``, the math the
    fused kernel implements).

    Args:
        kv, gate: ``[E, w, C]`` (``gate`` already biased; ``-inf`` rows get weight 0).
        positions: int64 ``[E]``, each entry's RoPE position (``j * r``).
    Returns:
        ``[E, C]`` in ``kv``'s dtype.
    """
    return pool_windows(kv, gate, positions, pool_weights(norm_weight, eps, rope))


def pool_weights(norm_weight: torch.Tensor, eps: float, rope: Rope) -> PoolWeights:
    """The pooling parameters of a compressor series (norm weight, eps, rotary table)."""
    return PoolWeights(norm_weight, eps, rope.inv_freq, rope.scale)


class Compressor(nn.Module):
    """One compressed series of a layer (``kv_proj``, ``gate_proj``, ``position_bias``,
    ``kv_norm``); ``width`` is the entry width ``C``, ``overlap`` doubles the projections."""

    def __init__(self, hidden: int, width: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        k = 2 if overlap else 1
        self.ratio, self.width, self.eps = ratio, width, eps
        self.kv_proj = nn.Linear(hidden, k * width, bias=False)
        self.gate_proj = nn.Linear(hidden, k * width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, k * width, dtype=torch.float32))
        self.kv_norm = nn.Parameter(torch.ones(width, dtype=torch.float32))

    def projections(self) -> tuple[nn.Linear, nn.Linear]:
        """(``kv_proj``, ``gate_proj``): both read the attention's normalised input ``x``."""
        return self.kv_proj, self.gate_proj

    def forward(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        ctx: HybridStepContext,
        layer_idx: int,
        name: str,
        rope: Rope,
    ) -> None:
        """Pool the windows ``ctx`` closes and store the entries back into ``ctx`` under series
        ``name``; ``kv``, ``gate``: ``[T, k*C]`` in the model dtype, ``kv_proj(x)`` and
        ``gate_proj(x)`` of the step's rows (any row stride, unit column stride). The gate is
        widened to fp32 after the projection and biased there (``position_bias[p % r]``, fp32,
        as the softmax runs in fp32). A context with ``compress_store`` (``PlannedStep``) does
        all of it in one call where ``fused_compress_enabled``, the bias included: it takes
        the raw ``gate`` and a ``GateBias``."""
        bias = GateBias(self.position_bias, ctx.positions)
        fused = getattr(ctx, "compress_store", None)  # contexts with the fused op
        if fused is not None and fused_compress_enabled(kv):
            fused(layer_idx, name, kv, gate, pool_weights(self.kv_norm, self.eps, rope), bias)
            return
        windows = ctx.compress_windows(layer_idx, name, kv, biased_gate(gate, bias))
        if windows.kv.shape[0] == 0:
            entries = kv.new_zeros((0, self.width))
        else:
            entries = pool(
                windows.kv, windows.gate, windows.positions, self.kv_norm, self.eps, rope
            )
        ctx.store_entries(layer_idx, name, entries)


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its compressor, query and head weights."""

    def __init__(
        self, hidden: int, q_lora_rank: int, heads: int, width: int, ratio: int, eps: float
    ) -> None:
        super().__init__()
        self.heads, self.width = heads, width
        self.compressor = Compressor(hidden, width, ratio, overlap=True, eps=eps)
        self.q_b_proj = nn.Linear(q_lora_rank, heads * width, bias=False)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """The linears that read the attention's normalised input ``x``: the compressor's
        ``kv_proj`` and ``gate_proj``, then ``weights_proj``."""
        return (*self.compressor.projections(), self.weights_proj)

    def forward(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        head_weights: torch.Tensor,
        q: torch.Tensor,
        ctx: HybridStepContext,
        layer_idx: int,
        rope: Rope,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's indexer keys; return ``index_q [T, Hi, Ci]`` and fp32
        ``index_weights [T, Hi]`` (all scalings folded in).

        ``kv``, ``gate`` ``[T, 2*Ci]`` and ``head_weights`` ``[T, Hi]`` are the `projections`
        of ``x`` (model dtype, any row stride); ``q``: ``[T, Hi * Ci]``, this indexer's
        ``q_b_proj`` of the attention's ``q_res`` (the attention runs it in one GEMM with its
        own ``q_b_proj``; any row stride, unit column stride)."""
        self.compressor(kv, gate, ctx, layer_idx, "indexer", rope)
        q = q.unflatten(-1, (self.heads, self.width))
        scale = (self.heads**-0.5) * (self.width**-0.5)
        if FUSED_INDEX_WEIGHTS:  # the queries' RoPE and the weights' fp32 scaling: one launch
            return rope_and_scale(q, cos, sin, head_weights, scale)
        return norm_rope(q, cos, sin), head_weights.float() * scale
