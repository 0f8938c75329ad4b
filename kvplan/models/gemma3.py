"""Gemma 3 text decoder (``model_type == "gemma3_text"``, e.g. Gemma-3-270M) on kvplan backends.

The same flat-batch contract as `kvplan.models.llama.LlamaForCausalLM` (``input_ids [T]``,
``positions [T]``, metadata per attention family, logits for ``logits_indices`` only), the same
fused parameter layout (``qkv_proj`` = ``[q; k; v]`` rows, ``gate_up_proj`` = ``[gate; up]``
rows) and the same Hugging Face weight names (`kvplan.models.weights` loads both models).
What differs from the Llama family, each computed as Hugging Face's ``Gemma3ForCausalLM``:

* the embedding is multiplied by ``sqrt(hidden_size)`` rounded to the model dtype;
* every RMSNorm scales by ``(1 + weight)``, in fp32, before rounding to the model dtype
  (`GemmaRMSNorm`); q and k are normed per head before RoPE;
* a layer is ``h += post_attention_norm(attn(input_norm(h)))`` then
  ``h += post_feedforward_norm(mlp(pre_feedforward_norm(h)))``;
* the MLP is ``down(gelu_tanh(gate) * up)``;
* the attention scale is ``query_pre_attn_scalar ** -0.5``;
* sliding-window layers use ``config.local_rope`` (base 1e4 in the released models), the
  full-attention layers ``config.rope`` (1e6); a sliding layer's query at position p sees keys
  ``p - W + 1 .. p`` (Hugging Face's mask ``k > p - W``);
* the output head is the embedding matrix (tied).

The small ops run as plain torch (no fused Triton kernels).

Tensor parallelism (``tp``, a `kvplan.distributed.TPContext`): the Llama family's splits
(`kvplan.models.llama`): this rank's query heads and KV heads (one replicated KV head when the
model has fewer KV heads than ranks, as Gemma-3-270M's single one), MLP columns and
vocabulary rows; ``o_proj`` and ``down_proj`` all-reduce, the embedding all-reduces its
lookups before the ``sqrt(hidden_size)`` scale, and the tied head's logits are gathered over
the vocabulary shards. The q / k norms and the four layer norms are replicated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvplan.distributed.context import TPContext, local_kv_heads
from kvplan.distributed.layers import row_linear, vocab_embedding
from kvplan.models.config import ModelConfig
from kvplan.models.kv_rotation import check_rotation_setting, hadamard_qk
from kvplan.models.llama import PAGED_FAMILY, lm_head_logits
from kvplan.models.rope import RotaryTable, rotate_qk


class GemmaRMSNorm(nn.Module):
    """``(x.float() * rsqrt(mean(x.float()^2) + eps) * (1 + weight.float())).to(x.dtype)``
    over the last dimension; ``weight [dim]`` is stored as the checkpoint holds it (zero =
    identity scale)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, backend_cls: Any, tp: TPContext | None = None
    ) -> None:
        super().__init__()
        size = 1 if tp is None else tp.size
        self.num_heads = cfg.num_heads // size  # this rank's heads (module docstring)
        self.num_kv_heads = local_kv_heads(cfg.num_kv_heads, size)
        self.head_dim = d = cfg.head_dim
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.is_local = cfg.windows[layer_idx] is not None
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = row_linear(cfg.num_heads * d, cfg.hidden_size, tp)
        self.q_norm = GemmaRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, cfg.rms_norm_eps)
        self.attn = backend_cls(
            layer_idx,
            self.num_heads,
            self.num_kv_heads,
            d,
            scale=cfg.attn_scale,
            sliding_window=cfg.windows[layer_idx],
        )
        self.kv_rotation = False  # Hadamard-rotate q/k after RoPE (`kvplan.models.kv_rotation`)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryTable, metadata: Any
    ) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; ``rotary`` is this layer's (local or global)."""
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, d))  # [T, H, D]
        k = self.k_norm(k.reshape(t, self.num_kv_heads, d))  # [T, Hkv, D]
        q, k = rotate_qk(q, k, rotary.cos, rotary.sin, positions)
        if self.kv_rotation:
            q, k = hadamard_qk(q, k)  # q k^T unchanged; K quantizes better
        v = v.reshape(t, self.num_kv_heads, d).contiguous()
        o = self.attn.forward(q.contiguous(), k.contiguous(), v, metadata)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.q_size))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext | None = None) -> None:
        super().__init__()
        self.intermediate_size = inter = cfg.intermediate_size // (1 if tp is None else tp.size)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = row_linear(cfg.intermediate_size, cfg.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, backend_cls: Any, tp: TPContext | None = None
    ) -> None:
        super().__init__()
        eps, h = cfg.rms_norm_eps, cfg.hidden_size
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = Gemma3Attention(cfg, layer_idx, backend_cls, tp)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = Gemma3MLP(cfg, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryTable, metadata: Any
    ) -> torch.Tensor:
        """The residual stream ``x [T, hidden]`` after this layer."""
        a = self.self_attn(self.input_layernorm(x), positions, rotary, metadata)
        x = x + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(m)


class Gemma3ForCausalLM(nn.Module):
    """A Gemma 3 text causal LM whose attention goes through a kvplan backend.

    Args and call as `kvplan.models.llama.LlamaForCausalLM` (``cfg.is_gemma3`` must hold;
    no ``fused_kernels``), ``tp`` and ``kv_rotation`` included.

    Example::

        cfg = ModelConfig.from_hf(gemma3_text_config)
        model = Gemma3ForCausalLM(cfg, get_backend("vanilla"), max_positions=4096)
        logits = model(input_ids, positions, {"paged": metadata}, logits_indices)  # [N, V]
    """

    # False: return the logits in the model's dtype, skipping the fp32 copy of the whole
    # ``[N, V]`` output (the engine sets it: its sampling and logprobs widen what they read)
    float_logits: bool = True

    def __init__(
        self,
        cfg: ModelConfig,
        backend_cls: Any,
        *,
        max_positions: int = 4096,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        kv_rotation: bool = False,
        tp: TPContext | None = None,
    ) -> None:
        super().__init__()
        check_rotation_setting(kv_rotation, cfg.head_dim)
        if not cfg.is_gemma3:
            raise ValueError(
                f"Gemma3ForCausalLM needs a gemma3_text config, got {cfg.model_type!r}"
            )
        if not cfg.tie_word_embeddings:
            raise ValueError("Gemma3ForCausalLM needs tie_word_embeddings = True")
        self.config = cfg
        self.tp = tp
        # the attention family of each layer (`kvplan.engine.families`)
        self.layer_families: tuple[str, ...] = (PAGED_FAMILY,) * cfg.num_layers
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            [Gemma3DecoderLayer(cfg, i, backend_cls, tp) for i in range(cfg.num_layers)]
        )
        for layer in self.layers:
            layer.self_attn.kv_rotation = kv_rotation
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None  # tied: `weights.load_weights` skips lm_head.weight
        self.to(dtype=dtype, device=device)
        self.set_rotary(max_positions)

    def set_rotary(self, max_positions: int) -> None:
        """(Re)build the global and local RoPE tables on the parameters' device and dtype."""
        w, cfg = self.embed_tokens.weight, self.config
        local = cfg.local_rope or cfg.rope
        self.rotary = RotaryTable(
            cfg.rope, cfg.head_dim, max_positions, dtype=w.dtype, device=w.device
        )
        self.rotary_local = RotaryTable(
            local, cfg.head_dim, max_positions, dtype=w.dtype, device=w.device
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Mapping[str, Any] | None,
        logits_indices: torch.Tensor | None = None,
        *,
        argmax_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one step: ``input_ids``/``positions [T]`` int64 -> ``[N, vocab_size]`` fp32
        logits of the rows ``logits_indices [N]`` (None = all T; the model's dtype without
        ``float_logits``); ``argmax_out`` (int64 ``[N]``) filled with their argmax as in
        `kvplan.models.llama.lm_head_logits`."""
        w = self.embed_tokens.weight
        # sqrt(hidden) rounded to the model dtype, as the reference multiplies it
        scale = float(torch.tensor(self.config.hidden_size**0.5).to(w.dtype))
        h = self.embed_tokens(input_ids) * scale  # [T, hidden]
        for layer, family in zip(self.layers, self.layer_families):
            metadata = None if attention is None else attention[family]
            rotary = self.rotary_local if layer.self_attn.is_local else self.rotary
            h = layer(h, positions, rotary, metadata)
        if logits_indices is not None:
            h = h[logits_indices]
        h = self.norm(h)  # [N, hidden]
        return lm_head_logits(self, h, argmax_out)
