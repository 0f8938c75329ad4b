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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvplan.models.deepseek_v4.config import DeepseekV4Config


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    """The always-on SwiGLU MLP of width ``moe_intermediate_size``."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


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

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids int64 ``[T, k]``, weights ``[T, k]``) for ``x [T, hidden]``."""
        logits = F.linear(x, self.gate_weight)
        if self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        if self.hash_routed:
            ids = self.tid2eid[input_ids].long()
        else:
            biased = scores + self.e_score_correction_bias
            ids = biased.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, hidden]``; ``input_ids``: int64 ``[T]`` -> ``[T, hidden]``."""
        ids, weights = self.route(x, input_ids)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, slots = torch.nonzero(ids == e, as_tuple=True)
            gate, up = F.linear(x[rows], self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(swiglu(gate, up, self.limit), self.down[e])
            out.index_add_(0, rows, (y * weights[rows, slots, None]).to(out.dtype))
        return out + self.shared(x)
