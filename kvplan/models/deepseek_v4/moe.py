"""DeepSeek-V4 mixture of experts: top-k or hash router, routed experts, one shared expert.

Routing (per token, ``x [T, hidden]``)::

    scores  = score_fn(x @ gate.weight^T)                  # [T, E]; sqrt(softplus) or sigmoid
    experts = topk(scores + e_score_correction_bias, k)    # "moe" layers
            | tid2eid[input_ids]                            # "hash_moe" layers (a fixed table)
    weights = scores[experts] / (sum + 1e-20) * routed_scaling_factor

(Hugging Face always renormalises, whatever ``norm_topk_prob`` says; a hash table row that
names an expert twice counts it twice.) Every expert and the shared expert are SwiGLU MLPs
whose gate is clamped above at ``swiglu_limit`` and whose up projection is clamped to
``[-limit, limit]``. ``gate_up`` of expert ``e`` is ``[2I, hidden]``: rows ``0..I-1`` gate,
``I..2I-1`` up.

Three ways to apply the routed experts, equal up to fp32 rounding:

* sparse (the CPU path): the rows of each routed expert are gathered and run through it; the
  list of routed experts is read on the host (a sync per layer, one per expert);
* dense (no host sync, fixed shapes, CUDA-graph capturable): every expert runs on every row and
  its output is weighted by the row's summed routing weight for it (zero when not routed), in
  a fixed handful of kernels (`kvplan.ops.moe_dense`: one GEMM for all experts' gate/up, one
  SwiGLU, one batched GEMM for all down projections, one weighted sum that also adds the
  shared expert). It costs ``n_routed_experts / k`` times the expert FLOPs. It runs while a
  CUDA graph is being captured, when ``dense_routing`` is set (see `graph_safe_routing`), and
  on CUDA whenever the batch is decode-sized: ``T * k >= n_routed_experts`` (most experts are
  read anyway) and ``T * n_routed_experts <= DENSE_AUTO_MAX_ROWS`` (bounded extra FLOPs).

* grouped (no host sync, shapes fixed by ``T``, ``k`` and ``E``, CUDA-graph capturable):
  the ``T * k`` (token, expert) pairs are sorted by expert on the device and each expert runs
  on its own pairs only (`kvplan.ops.moe_grouped`: two grouped GEMMs, the first with the
  SwiGLU fused, and a per-token sum in ascending expert order, as the sparse path adds). On
  CUDA it takes every batch the dense path does not (prefill chunks: no host sync per
  expert), and the dense path's batches too when ``n_routed_experts >=
  GROUPED_AUTO_MIN_EXPERTS`` (the dense path would read and run every expert); it runs
  everywhere when ``grouped_routing`` is set or ``KVPLAN_MOE_GROUPED=1``.

Fused weights (`DeepseekV4MoE.fuse_weights`, called by `fuse_projections` at construction,
after ``.to()`` and after loading): the three weights that read ``x`` -- every routed
expert's ``gate_up``, the shared expert's gate and up, and the router -- are row slices of
one ``[(E + 1) * 2I + E, hidden]`` tensor, and the routed and shared down projections the
slices of one ``[E + 1, hidden, I]``. The dense path then runs as the shared expert being
expert ``E``: one GEMM (router logits, every expert's gate/up and the shared one's), the
routing kernel on the logits' columns, one SwiGLU over ``E + 1`` experts, one batched down
GEMM, the weighted sum adding slice ``E`` (`experts_fused`): five kernels instead of nine,
the same arithmetic per output element (only the GEMMs' blocking can differ).

`experts_dense_loop` is the per-expert torch loop the dense path replaced (a test reference:
experts in order, a repeated expert's weights added first).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from kvplan.models.deepseek_v4.config import DeepseekV4Config
from kvplan.models.deepseek_v4.layers import LinearGroup
from kvplan.ops.moe_dense import expert_weighted_sum, moe_route, moe_swiglu, swiglu
from kvplan.ops.moe_grouped import moe_grouped

DENSE_AUTO_MAX_ROWS = 4096
"""Largest ``T * n_routed_experts`` for which CUDA batches take the dense path by default."""

GROUPED_AUTO_MIN_EXPERTS = 64
"""Fewest routed experts for which CUDA batches bound for the dense path take the grouped one."""


class SharedExpert(nn.Module):
    """The always-on SwiGLU MLP of width ``moe_intermediate_size``; ``gate_proj`` and
    ``up_proj`` run as one GEMM through ``gate_up_proj`` (a `LinearGroup`, fused by
    `fuse_projections`)."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.gate_up_proj = LinearGroup(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        gate, up = self.gate_up_proj(x)  # [T, I] each: column views of one GEMM
        return self.down_proj(swiglu(gate, up, self.limit))


class DeepseekV4MoE(nn.Module):
    """One MoE block; ``hash_routed`` picks experts from ``tid2eid[input_ids]``."""

    def __init__(self, config: DeepseekV4Config, layer_idx: int) -> None:
        super().__init__()
        c = config
        self.hash_routed = c.mlp_layer_types[layer_idx] == "hash_moe"
        self.top_k, self.limit = c.num_experts_per_tok, c.swiglu_limit
        self.scoring_func, self.scaling = c.scoring_func, c.routed_scaling_factor
        e, d, inter = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        self.gate_weight = nn.Parameter(torch.empty(e, d))
        if self.hash_routed:
            self.register_buffer(
                "tid2eid", torch.zeros(c.vocab_size, self.top_k, dtype=torch.int64)
            )
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))
        self.gate_up = nn.Parameter(torch.empty(e, 2 * inter, d))
        self.down = nn.Parameter(torch.empty(e, d, inter))
        self.shared = SharedExpert(d, inter, c.swiglu_limit)
        self.dense_routing = False  # see the module docstring
        self.grouped_routing = False  # likewise
        # (x weight [(E+1)*2I + E, hidden], down weight [E+1, hidden, I], member data_ptrs)
        # of `fuse_weights`; None: unfused
        self._fused: tuple[torch.Tensor, torch.Tensor, tuple[int, ...]] | None = None

    def _fusable(self) -> list[torch.Tensor]:
        """The six weights `fuse_weights` joins, in its order: routed gate_up, shared gate,
        shared up, router (the x weight's rows), routed down, shared down."""
        sh = self.shared
        return [self.gate_up, sh.gate_proj.weight, sh.up_proj.weight, self.gate_weight,
                self.down, sh.down_proj.weight]  # fmt: skip

    def is_fused(self) -> bool:
        """Whether every weight is still its view of the fused tensors (module docstring)."""
        f = self._fused
        return f is not None and all(
            w.data_ptr() == p for w, p in zip(self._fusable(), f[2], strict=True)
        )

    @torch.no_grad()
    def fuse_weights(self) -> None:
        """Join the weights into the two fused tensors (module docstring) and make each a
        view of them; a no-op when already fused. Weights of mixed dtypes or devices stay
        apart (the unfused paths run)."""
        if self.is_fused():
            return
        weights = [w.data for w in self._fusable()]
        first = weights[0]
        if any((w.dtype, w.device) != (first.dtype, first.device) for w in weights):
            self._fused = None
            return
        gate_up, s_gate, s_up, router, down, s_down = weights
        e, two_i, hidden = gate_up.shape
        x_weight = torch.cat([gate_up.reshape(e * two_i, hidden), s_gate, s_up, router])
        down_weight = torch.cat([down, s_down.unsqueeze(0)])  # [E + 1, hidden, I]
        sh = self.shared
        self.gate_up.data = x_weight[: e * two_i].view(e, two_i, hidden)
        sh.gate_up_proj.fuse(storage=x_weight[e * two_i : (e + 1) * two_i])
        self.gate_weight.data = x_weight[(e + 1) * two_i :]
        self.down.data = down_weight[:e]
        sh.down_proj.weight.data = down_weight[e]
        ptrs = tuple(w.data_ptr() for w in self._fusable())
        self._fused = (x_weight, down_weight, ptrs)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids int64 ``[T, k]``, weights ``[T, k]``) for ``x [T, hidden]``."""
        return self.route_dense(x, input_ids)[:2]

    def route_dense(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`route` plus the fp32 ``[T, E]`` matrix of each row's summed weights per expert
        (the router GEMM and one routing kernel on CUDA; see `kvplan.ops.moe_dense.moe_route`)."""
        return self._route_logits(F.linear(x, self.gate_weight), input_ids)

    def _route_logits(
        self, logits: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`moe_route` of router ``logits [T, E]`` (any row stride) with this block's rule."""
        return moe_route(
            logits,
            top_k=self.top_k,
            sigmoid=self.scoring_func == "sigmoid",
            scaling=self.scaling,
            bias=None if self.hash_routed else self.e_score_correction_bias,
            tid2eid=self.tid2eid if self.hash_routed else None,
            input_ids=input_ids if self.hash_routed else None,
        )

    def use_dense(self, x: torch.Tensor) -> bool:
        """Whether `forward` takes the dense expert path for ``x [T, hidden]`` (module
        docstring: capture, ``dense_routing``, or a decode-sized CUDA batch)."""
        if self.dense_routing or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return True
        return x.is_cuda and self.dense_size(x.shape[0])

    def dense_size(self, t: int) -> bool:
        """Whether a CUDA batch of ``t`` rows is decode-sized for the dense path by default
        (``t * top_k >= E`` and ``t * E <= DENSE_AUTO_MAX_ROWS``)."""
        e = self.gate_up.shape[0]
        return t * self.top_k >= e and t * e <= DENSE_AUTO_MAX_ROWS

    def use_grouped(self, x: torch.Tensor) -> bool:
        """Whether `forward` takes the grouped expert path for ``x [T, hidden]`` (module
        docstring: ``grouped_routing``, ``KVPLAN_MOE_GROUPED=1``, a CUDA batch not bound for
        the dense path, or one bound for it with many experts)."""
        flag = os.environ.get("KVPLAN_MOE_GROUPED", "")
        if self.grouped_routing or flag == "1":
            return True
        if not x.is_cuda or flag == "0":
            return False
        return not self.use_dense(x) or self.gate_up.shape[0] >= GROUPED_AUTO_MIN_EXPERTS

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, hidden]``; ``input_ids``: int64 ``[T]`` -> ``[T, hidden]``."""
        if self.use_dense(x) and not self.use_grouped(x) and self.is_fused():
            return self._experts_fused(x, input_ids)
        ids, weights, dense = self.route_dense(x, input_ids)
        if self.use_grouped(x):
            return self.experts_grouped(x, ids, weights, add=self.shared(x))
        if self.use_dense(x):
            return self.experts_batched(x, dense, add=self.shared(x))
        return self.experts_sparse(x, ids, weights) + self.shared(x)

    def experts_sparse(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Routed experts over their gathered rows (host sync: the list of routed experts).
        ``ids`` int64 / ``weights`` ``[T, k]`` from `route` -> ``[T, hidden]``."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, slots = torch.nonzero(ids == e, as_tuple=True)
            gate, up = F.linear(x[rows], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(swiglu(gate, up, self.limit), self.down[e])
            out.index_add_(0, rows, (y * weights[rows, slots, None]).to(out.dtype))
        return out

    def experts_grouped(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Routed experts over their sorted (token, expert) pairs, no host sync on CUDA
        (`kvplan.ops.moe_grouped.moe_grouped`), plus ``add`` (``[T, hidden]``, optional) after
        rounding. ``ids`` int64 / ``weights`` ``[T, k]`` from `route` -> ``[T, hidden]``."""
        return moe_grouped(x, ids, weights, self.gate_up, self.down, self.limit, add)

    def experts_batched(
        self, x: torch.Tensor, dense: torch.Tensor, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Every expert on every row, weighted by ``dense`` (fp32 ``[T, E]`` from
        `route_dense`), plus ``add`` (``[T, hidden]``, optional) after rounding: four kernels,
        no host sync, shapes depending on ``T`` only. ``x [T, hidden]`` -> ``[T, hidden]``."""
        num_experts, two_inter, hidden = self.gate_up.shape
        gu = F.linear(x, self.gate_up.view(num_experts * two_inter, hidden))  # [T, E * 2I]
        return expert_weighted_sum(self._swiglu_down(gu, self.down), dense, add)

    def _swiglu_down(self, gu: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """``[E', T, hidden]``: each expert's SwiGLU of its ``[gate | up]`` columns of ``gu
        [T, E' * 2I]``, then its down projection (``down [E', hidden, I]``, one bmm)."""
        h = moe_swiglu(gu, down.shape[0], self.limit)  # [E', T, I]
        return torch.bmm(h, down.transpose(1, 2))

    def experts_fused(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The dense path plus the shared expert and the router on the fused weights (module
        docstring; `fuse_weights` first): ``x [T, hidden]`` -> ``[T, hidden]``."""
        if not self.is_fused():
            raise RuntimeError("experts_fused needs fuse_weights() (a weight was replaced)")
        return self._experts_fused(x, input_ids)

    def _experts_fused(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        x_weight, down_weight, _ = self._fused
        e, two_i = self.gate_up.shape[:2]
        out = F.linear(x, x_weight)  # [T, (E + 1) * 2I + E]
        # the router logits: the GEMM's last E columns
        dense = self._route_logits(out[:, (e + 1) * two_i :], input_ids)[2]
        y = self._swiglu_down(out[:, : (e + 1) * two_i], down_weight)  # [E + 1, T, hidden]
        return expert_weighted_sum(y[:e], dense, add=y[e])  # the shared expert: slice E

    def experts_dense(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """`experts_batched` for ``ids`` int64 / ``weights`` ``[T, k]`` from `route` (a
        repeated expert's weights add up) -> ``[T, hidden]``."""
        dense = torch.zeros(x.shape[0], self.gate_up.shape[0], dtype=torch.float32, device=x.device)
        dense.scatter_add_(1, ids, weights.float())
        return self.experts_batched(x, dense)

    def experts_dense_loop(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Reference for `experts_dense`: one expert at a time, in order, accumulating in
        ``x``'s dtype. ``ids`` int64 / ``weights`` ``[T, k]`` -> ``[T, hidden]``."""
        num_experts = self.gate_up.shape[0]
        dense = torch.zeros(x.shape[0], num_experts, dtype=weights.dtype, device=x.device)
        dense.scatter_add_(1, ids, weights)  # [T, E]
        out = torch.zeros_like(x)
        for e in range(num_experts):
            gate, up = F.linear(x, self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(swiglu(gate, up, self.limit), self.down[e])
            out += (y * dense[:, e, None]).to(out.dtype)
        return out


@contextmanager
def graph_safe_routing(model: nn.Module) -> Iterator[None]:
    """Within the block every `DeepseekV4MoE` of ``model`` uses the dense (sync-free) expert
    path, as it does under CUDA-graph capture; the previous setting is restored after."""
    moes = [m for m in model.modules() if isinstance(m, DeepseekV4MoE)]
    before = [m.dense_routing for m in moes]
    for m in moes:
        m.dense_routing = True
    try:
        yield
    finally:
        for m, b in zip(moes, before):
            m.dense_routing = b
