"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3, Mistral) on kvplan attention backends.

The model works on a flat batch of tokens: every step gets ``input_ids [T]`` and
``positions [T]`` of all scheduled sequences back to back (prefill chunks first, then decode
rows, the order of the attention metadata) and returns logits only for the rows named by
``logits_indices``. Each attention layer projects q/k/v, applies the optional Qwen3 q/k norm
and RoPE, then hands ``q [T, H, D]``, ``k/v [T, Hkv, D]`` to its `AttentionBackend`, which
stores k/v into the paged cache (``metadata.kv_cache``) and attends over the cached history.

Parameters are fused for fewer kernel launches: ``qkv_proj`` holds ``[q; k; v]`` rows and
``gate_up_proj`` holds ``[gate; up]`` rows (see `kvplan.models.weights` for the name mapping).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvplan.models.config import ModelConfig
from kvplan.models.rope import RotaryTable


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32 like Hugging Face."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, backend_cls: Any) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = d = cfg.head_dim
        self.q_size = cfg.num_heads * d
        self.kv_size = cfg.num_kv_heads * d
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = backend_cls(
            layer_idx,
            cfg.num_heads,
            cfg.num_kv_heads,
            d,
            scale=d**-0.5,
            sliding_window=cfg.windows[layer_idx],
        )

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryTable, metadata: Any
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = rotary.apply(q, k, positions)
        o = self.attn.forward(q.contiguous(), k.contiguous(), v, metadata)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, backend_cls: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, backend_cls)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryTable, metadata: Any
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM whose attention goes through a kvplan backend.

    Args:
        cfg: the model configuration.
        backend_cls: an `AttentionBackend` class (``kvplan.backends.get_backend(name)``);
            one instance per layer is built with ``(layer_idx, H, Hkv, D, scale=,
            sliding_window=)``.
        max_positions: size of the RoPE table (longest sequence the model will see).
        dtype, device: parameter dtype and device (fp32 on CPU, bf16 on CUDA by default).

    Example::

        model = LlamaForCausalLM(cfg, get_backend("vanilla"), max_positions=4096)
        logits = model(input_ids, positions, metadata, logits_indices)  # [N, V] fp32
    """

    def __init__(
        self,
        cfg: ModelConfig,
        backend_cls: Any,
        *,
        max_positions: int = 4096,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i, backend_cls) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, False)
        )
        self.to(dtype=dtype, device=device)
        self.rotary = RotaryTable(cfg.rope, cfg.head_dim, max_positions, dtype=dtype, device=device)

    def set_rotary(self, max_positions: int) -> None:
        """(Re)build the RoPE table for ``max_positions`` on the parameters' device and dtype."""
        w = self.embed_tokens.weight
        self.rotary = RotaryTable(
            self.config.rope, self.config.head_dim, max_positions, dtype=w.dtype, device=w.device
        )

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: Any,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one step.

        Args:
            input_ids: ``[T]`` int64 token ids on the model device.
            positions: ``[T]`` int64 absolute positions (``< max_positions``).
            metadata: the step's prepared `AttentionMetadata`.
            logits_indices: ``[N]`` int64 rows of T whose logits are wanted (None = all).

        Returns:
            ``[N, vocab_size]`` fp32 logits.
        """
        x = self.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.layers:
            x = layer(x, positions, self.rotary, metadata)
        if logits_indices is not None:
            x = x[logits_indices]
        x = self.norm(x)
        return F.linear(x, self.lm_head_weight).float()  # [N, V]
