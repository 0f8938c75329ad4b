"""DeepSeek-V4 attention: low-rank q, one shared K=V head, sinks, grouped output projection.

Per step (flat rows ``[T]``), with ``x`` the normalised block input ``[T, hidden]``::

    q_res = RMSNorm_w(q_a_proj(x))                       # [T, q_lora_rank]
    q     = RoPE(RMSNorm(q_b_proj(q_res) per head))      # [T, H, D] (unweighted norm)
    kv    = RoPE(RMSNorm_w(kv_proj(x)))                  # [T, D], key = value
    CSA / HCA: compressor (and CSA's indexer) -> ctx.compress_windows / ctx.store_entries
    o     = ctx.attend(q, kv, sinks, D^-0.5, ...)        # [T, H, D]
    o     = RoPE^-1(o) at the query position             # undo the values' rotation
    out   = o_b_proj(o_a_proj per group(o))              # [T, hidden]
            (decode-sized steps on the Triton path may return o_b_proj as split-K partials,
             `o_splits`, which the hyper-connection's residual update adds up)

RoPE acts on the trailing ``rope_head_dim`` channels; sliding layers use the "main" table,
CSA / HCA layers the "compress" table for everything (queries, raw rows, entries, indexer).
The grouped ``o_a_proj`` splits the ``H * D`` output into ``o_groups`` contiguous groups and
projects each with its own ``[o_lora_rank, H*D/g]`` block of the weight ``[g*o_lora_rank,
H*D/g]`` (group ``i`` uses rows ``i*o_lora_rank .. (i+1)*o_lora_rank - 1``).

Every projection of ``x`` (``q_a_proj``, ``kv_proj``, the compressor's ``kv_proj`` /
``gate_proj``, the indexer's compressor ``kv_proj`` / ``gate_proj`` and ``weights_proj``) runs
as one GEMM through ``x_proj`` (a `LinearGroup`, fused by `fuse_projections`), whose output
is split into column views. Likewise the two projections of ``q_res`` (``q_b_proj`` and, in CSA
layers, the indexer's ``q_b_proj``) run as one GEMM through ``q_res_proj``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from kvplan.backends.hybrid.api import HybridStepContext
from kvplan.models.deepseek_v4.compressor import Compressor, Indexer
from kvplan.models.deepseek_v4.config import DeepseekV4Config
from kvplan.models.deepseek_v4.layers import LinearGroup, Rope, StepRope, rms_norm
from kvplan.ops._dispatch import env_count, use_triton
from kvplan.ops.rope import NormSpec, norm_rope, norm_rope_pair
from kvplan.ops.split_linear import SplitSums, linear_splits, split_linear

O_SPLITS_ENV = "KVPLAN_DSV4_O_SPLITS"
DEFAULT_O_SPLITS = 2
"""Split-K partials of ``o_b_proj`` (`DeepseekV4Attention.o_splits`) by default. H100,
2026-12-07 (`bench/run_s52a.sh`): the GEMM alone at 32 x 2,048 x 4,096, 8.75 us in 2 splits
(8.48 in 4) against 10.19 for cuBLAS's own split-K with its reduce kernel; the 32K x 32 fp8
decode step, three alternating pairs, async 2.82 / 2.77 / 2.73 ms against 2.84 / 2.78 /
2.82 without, its kernels 2,579 us in 285 launches."""


class GroupedLinear(nn.Module):
    """Block-diagonal linear: ``[T, g * n]`` -> ``[T, g * m]`` with weight ``[g * m, n]``."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xg = x.unflatten(-1, (self.groups, -1)).transpose(0, 1)  # [g, T, n]
        w = self.weight.unflatten(0, (self.groups, -1))  # [g, m, n]
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return torch.bmm(xg, w.transpose(1, 2)).transpose(0, 1).flatten(1)  # [T, g*m]
        # inference: the products land in [T, g, m] order (strided batches of one GEMM call),
        # so the flatten below is a view, not a copy of the whole output
        out = x.new_empty(x.shape[0], self.groups, w.shape[1])
        torch.bmm(xg, w.transpose(1, 2), out=out.transpose(0, 1))
        return out.flatten(1)


class DeepseekV4Attention(nn.Module):
    """One attention layer of kind ``config.layer_types[layer_idx]``."""

    def __init__(self, config: DeepseekV4Config, layer_idx: int, rope: Rope) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.kind = c.layer_types[layer_idx]
        self.num_heads, self.head_dim, self.eps = c.num_heads, c.head_dim, c.rms_norm_eps
        self.rope = rope
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_norm = nn.Parameter(torch.ones(c.q_lora_rank, dtype=torch.float32))
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_heads * c.head_dim, bias=False)
        self.kv_proj = nn.Linear(c.hidden_size, c.head_dim, bias=False)
        self.kv_norm = nn.Parameter(torch.ones(c.head_dim, dtype=torch.float32))
        in_per_group = c.num_heads * c.head_dim // c.o_groups
        self.o_a_proj = GroupedLinear(in_per_group, c.o_groups * c.o_lora_rank, c.o_groups)
        self.o_b_proj = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(c.num_heads, dtype=torch.float32))
        ratio = c.ratio(layer_idx)
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.kind != "sliding_attention":
            csa = self.kind == "compressed_sparse_attention"
            self.compressor = Compressor(c.hidden_size, c.head_dim, ratio, csa, c.rms_norm_eps)
        if self.kind == "compressed_sparse_attention":
            self.indexer = Indexer(
                c.hidden_size,
                c.q_lora_rank,
                c.index_n_heads,
                c.index_head_dim,
                ratio,
                c.rms_norm_eps,
            )
        readers_of_x = [self.q_a_proj, self.kv_proj]
        for series in (self.compressor, self.indexer):
            if series is not None:
                readers_of_x += series.projections()
        self.x_proj = LinearGroup(*readers_of_x)
        # the output's inverse RoPE in the attention's epilogue (`KVPLAN_FUSED_OUT_ROPE=0`: a
        # norm_rope launch after it, for A/B runs; the same bits)
        self.fused_out_rope = os.environ.get("KVPLAN_FUSED_OUT_ROPE", "1") != "0"
        readers_of_q_res = [self.q_b_proj]
        if self.indexer is not None:
            readers_of_q_res.append(self.indexer.q_b_proj)
        self.q_res_proj = LinearGroup(*readers_of_q_res)
        # o_b_proj as this many split-K fp32 partials on the Triton path, for decode-sized
        # steps (`linear_splits`'s rows and weight size); the hyper-connection's residual
        # update after the block adds them (`hc_post_pre` of a `SplitSums`). 0: the plain GEMM
        self.o_splits = env_count(O_SPLITS_ENV, DEFAULT_O_SPLITS)

    def forward(
        self, x: torch.Tensor, ctx: HybridStepContext, tables: StepRope | None = None
    ) -> torch.Tensor | SplitSums:
        """``x``: ``[T, hidden]`` (after ``input_layernorm``) -> ``[T, hidden]`` (a `SplitSums`
        of it when ``o_splits`` applies: the caller's residual update adds the partials);
        ``tables``: the step's shared rotary tables (computed here when None)."""
        tables = tables or StepRope(ctx.positions, x.dtype)
        cos, sin = tables.get(self.rope)  # [T, R/2]
        q_a, kv, *series = self.x_proj(x)  # column views of one GEMM, x_proj's member order
        q_res = rms_norm(q_a, self.q_a_norm, self.eps)  # [T, q_lora_rank]
        q, *index_q_lin = self.q_res_proj(q_res)  # one GEMM (CSA: with the indexer's q_b)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        # q [T, H, D] (unweighted norm) and kv [T, D] (weighted): one launch on CUDA
        q, kv = norm_rope_pair(
            q, kv, cos, sin, NormSpec(None, self.eps), NormSpec(self.kv_norm, self.eps)
        )
        index_q = index_weights = None
        if self.compressor is not None:
            comp_kv, comp_gate, *series = series
            self.compressor(comp_kv, comp_gate, ctx, self.layer_idx, "compressor", self.rope)
        if self.indexer is not None:
            index_q, index_weights = self.indexer(
                *series, *index_q_lin, ctx, self.layer_idx, self.rope, cos, sin
            )
        out = ctx.attend(
            self.layer_idx,
            q,
            kv,
            self.sinks.float(),
            self.head_dim**-0.5,
            index_q=index_q,
            index_weights=index_weights,
            out_rope=(cos, sin) if self.fused_out_rope else None,  # RoPE^-1 at the query position
        )  # [T, H, D]
        if not self.fused_out_rope:
            out = norm_rope(out, cos, sin, inverse=True)
        o = self.o_a_proj(out.flatten(1))  # [T, o_groups * o_lora_rank]
        w = self.o_b_proj.weight
        splits = linear_splits(self.o_splits, o.shape[0], w.shape[1], w.shape[0])
        if splits and use_triton(o):
            return split_linear(o, w, splits)
        return self.o_b_proj(o)
