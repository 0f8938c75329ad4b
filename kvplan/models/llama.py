"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3, Mistral) on kvplan attention backends.

The model works on a flat batch of tokens: every step gets ``input_ids [T]`` and
``positions [T]`` of all scheduled sequences back to back (prefill chunks first, then decode
rows, the order of the attention metadata) and returns logits only for the rows named by
``logits_indices``. Each attention layer projects q/k/v, applies the optional Qwen3 q/k norm
and RoPE, then hands ``q [T, H, D]``, ``k/v [T, Hkv, D]`` to its `AttentionBackend`, which
stores k/v into the paged cache (``metadata.kv_cache``) and attends over the cached history.

Attention families: every layer of this model is served by the ``"paged"`` family
(``layer_families``); ``forward`` takes the step's planned metadata per family
(``{"paged": metadata}``) and each layer reads its own family's.

Parameters are fused for fewer kernel launches: ``qkv_proj`` holds ``[q; k; v]`` rows and
``gate_up_proj`` holds ``[gate; up]`` rows (see `kvplan.models.weights` for the name mapping).

The residual stream is carried vLLM-style: each layer returns ``(h, residual)`` and the next
norm adds ``h`` into ``residual`` in place before norming it, so a layer runs two fused
add+norm kernels and no separate residual add; the final norm fuses the last add. The small
ops between the GEMMs (`kvplan.models.fused`: add+RMSNorm, the q/k/v split with q/k norm and
RoPE, silu*mul) run as Triton kernels or as the torch path, per ``fused_kernels``; the
projections are cuBLAS GEMMs (a split-K Triton GEMM for decode-sized batches measured slower
in the engine's step on the H200: bench/RESULTS.md, session 11).

Tensor parallelism: with ``tp`` (a `kvplan.distributed.TPContext`) every layer holds its rank's
share: ``H / size`` query and ``Hkv / size`` KV heads (one replicated KV head when ``Hkv <
size``; the rank's KV cache holds only those),
``I / size`` MLP columns, ``ceil(V / size)`` vocabulary rows; ``o_proj`` and ``down_proj``
all-reduce their partial sums, the embedding all-reduces its lookups, and ``forward`` gathers
the logits of every vocabulary shard (`kvplan.distributed.layers`). ``tp=None`` is the
single-device model, with no collective and no extra work.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kvplan.distributed.context import TPContext, local_kv_heads
from kvplan.distributed.layers import row_linear, vocab_embedding
from kvplan.models import fused as ops
from kvplan.models.config import ModelConfig
from kvplan.models.kv_rotation import check_rotation_setting, hadamard_qk
from kvplan.models.rope import RotaryTable
from kvplan.ops.argmax import argmax_rows
from kvplan.ops.small_gemm import small_linear

FUSED_KERNELS_ENV = "KVPLAN_FUSED_KERNELS"
SPLIT_LINEAR_ENV = "KVPLAN_SPLIT_LINEAR"


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32 like Hugging Face."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, *, fused: bool = False
    ) -> torch.Tensor:
        """Norm of ``x`` or, with ``residual``, of ``residual += x`` (see `fused.rms_norm`)."""
        return ops.rms_norm(x, self.weight, self.eps, residual, fused=fused)


PAGED_FAMILY = "paged"  # the attention family serving every layer of this model


class Attention(nn.Module):
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
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias
        )
        self.o_proj = row_linear(cfg.num_heads * d, cfg.hidden_size, tp)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = backend_cls(
            layer_idx,
            self.num_heads,
            self.num_kv_heads,
            d,
            scale=d**-0.5,
            sliding_window=cfg.windows[layer_idx],
        )
        self.kv_rotation = False  # Hadamard-rotate q/k after RoPE (`kvplan.models.kv_rotation`)
        # the fused qkv epilogue writes K/V into a plain bf16 cache (`KVPLAN_FUSED_KV_STORE=0`:
        # the backend's store, for A/B runs)
        self.fused_kv_store = os.environ.get("KVPLAN_FUSED_KV_STORE", "1") != "0"
        # split-K partials for qkv_proj / o_proj (`LlamaForCausalLM.set_linear_splits`)
        self.qkv_splits = self.o_splits = 0

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryTable,
        metadata: Any,
        *,
        fused: bool = False,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv_w = self.qkv_proj.weight
        splits = ops.linear_splits(self.qkv_splits if fused else 0, t, *qkv_w.shape[::-1])
        if splits and self.qkv_proj.bias is None:  # the epilogue adds the partials
            qkv = ops.split_linear(x, qkv_w, splits)
        else:
            qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        norm = self.q_norm is not None
        # the fused kernel also writes k / v into the cache (bf16, or fp8 / int8 records)
        store = None
        if (
            fused
            and self.fused_kv_store
            and not self.kv_rotation
            and hasattr(self.attn, "store_target")
        ):
            store = self.attn.store_target(metadata, t)
            if store is not None and len(store) == 4:  # a quantized cache
                store = store if ops.fused_store_supports(store[3], self.head_dim) else None
        q, k, v = ops.qkv_epilogue(
            qkv, positions, rotary.cos, rotary.sin,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            q_norm_weight=self.q_norm.weight if norm else None,
            k_norm_weight=self.k_norm.weight if norm else None,
            eps=self.q_norm.eps if norm else 1e-6, kv_store=store, fused=fused,
        )  # fmt: skip
        if self.kv_rotation:
            q, k = hadamard_qk(q, k)  # q k^T unchanged; K quantizes better
        if store is not None:
            o = self.attn.forward(q, k, v, metadata, kv_stored=True)  # [T, H, D]
        else:
            o = self.attn.forward(q, k, v, metadata)  # [T, H, D]
        o = o.reshape(t, self.q_size)
        o_w = self.o_proj.weight
        splits = ops.linear_splits(self.o_splits if fused else 0, t, *o_w.shape[::-1])
        if splits:  # (row_linear: bias-free; 0 splits under tensor parallelism)
            return ops.split_linear(o, o_w, splits)  # the next norm adds them
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext | None = None) -> None:
        super().__init__()
        self.intermediate_size = inter = cfg.intermediate_size // (1 if tp is None else tp.size)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = row_linear(cfg.intermediate_size, cfg.hidden_size, tp)
        self.down_splits = 0  # split-K partials (`LlamaForCausalLM.set_linear_splits`)

    def forward(self, x: torch.Tensor, *, fused: bool = False) -> torch.Tensor | ops.SplitSums:
        a = ops.silu_and_mul(self.gate_up_proj(x), fused=fused)
        down_w = self.down_proj.weight
        splits = ops.linear_splits(
            self.down_splits if fused else 0, a.shape[0], *down_w.shape[::-1]
        )
        if splits:  # (row_linear: bias-free; 0 splits under tensor parallelism)
            return ops.split_linear(a, down_w, splits)  # the next norm adds them
        return self.down_proj(a)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, backend_cls: Any, tp: TPContext | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, backend_cls, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryTable,
        metadata: Any,
        *,
        fused: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on ``x [T, hidden]``; returns ``(mlp output, residual stream)``.

        ``residual`` is None for the first layer (``x`` is the embedding and becomes the
        residual stream); otherwise the stream so far, to which ``x`` (the previous layer's
        MLP output) is added in place. The layer's output, in the unfused notation, is
        ``returned residual + returned h``.
        """
        if residual is None:
            residual = x
            h = self.input_layernorm(x, fused=fused)
        else:
            h = self.input_layernorm(x, residual, fused=fused)
        h = self.self_attn(h, positions, rotary, metadata, fused=fused)
        h = self.post_attention_layernorm(h, residual, fused=fused)
        return self.mlp(h, fused=fused), residual


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM whose attention goes through a kvplan backend.

    Args:
        cfg: the model configuration.
        backend_cls: an `AttentionBackend` class (``kvplan.backends.get_backend(name)``);
            one instance per layer is built with ``(layer_idx, H, Hkv, D, scale=,
            sliding_window=)``.
        max_positions: size of the RoPE table (longest sequence the model will see).
        dtype, device: parameter dtype and device (fp32 on CPU, bf16 on CUDA by default).
        fused_kernels: run the small ops as fused Triton kernels (`kvplan.models.fused`)
            instead of the torch path. ``None`` = decided per forward: fused for CUDA inputs,
            torch on CPU; unless the environment variable ``KVPLAN_FUSED_KERNELS`` is ``0`` or
            ``1`` at construction (for A/B runs of engines that build the model themselves).
            Stored as the attribute ``fused_kernels``, which may be flipped at any time; CUDA
            graphs keep the choice made when they were captured. ``True`` on CPU tensors needs
            ``TRITON_INTERPRET=1``.
        tp: this rank's `kvplan.distributed.TPContext` (module docstring); None = one device.
        kv_rotation: rotate q and k of every head by a Hadamard matrix after RoPE
            (`kvplan.models.kv_rotation`): the scores are unchanged and the cached keys are
            rotated, which a quantized KV cache stores more accurately. Needs ``head_dim`` a
            power of two (ValueError); stored per layer as ``self_attn.kv_rotation``.
        linear_splits: split-K partials for the projections of decode-sized steps
            (`set_linear_splits`); None = ``KVPLAN_SPLIT_LINEAR`` (``S`` or
            ``qkv=S,o=S,down=S``) if set, else `DEFAULT_LINEAR_SPLITS`.

    Example::

        model = LlamaForCausalLM(cfg, get_backend("vanilla"), max_positions=4096)
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
        fused_kernels: bool | None = None,
        tp: TPContext | None = None,
        kv_rotation: bool = False,
        linear_splits: int | Mapping[str, int] | None = None,
    ) -> None:
        super().__init__()
        check_rotation_setting(kv_rotation, cfg.head_dim)
        self.config = cfg
        self.tp = tp
        # the attention family of each layer (`kvplan.engine.families`)
        self.layer_families: tuple[str, ...] = (PAGED_FAMILY,) * cfg.num_layers
        if fused_kernels is None:
            fused_kernels = _fused_from_env()
        self.fused_kernels = fused_kernels
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size, tp)
        vocab = self.embed_tokens.num_embeddings  # this rank's padded share under tp
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, i, backend_cls, tp) for i in range(cfg.num_layers)]
        )
        for layer in self.layers:
            layer.self_attn.kv_rotation = kv_rotation
        self.set_linear_splits(_splits_from_env() if linear_splits is None else linear_splits)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab, False)
        self.to(dtype=dtype, device=device)
        self.rotary = RotaryTable(cfg.rope, cfg.head_dim, max_positions, dtype=dtype, device=device)

    def set_rotary(self, max_positions: int) -> None:
        """(Re)build the RoPE table for ``max_positions`` on the parameters' device and dtype."""
        w = self.embed_tokens.weight
        self.rotary = RotaryTable(
            self.config.rope, self.config.head_dim, max_positions, dtype=w.dtype, device=w.device
        )

    def set_linear_splits(self, splits: int | Mapping[str, int]) -> None:
        """Run the fused path's projections of decode-sized steps (`fused.linear_splits`) as
        fp32 partial products over slices of K (`fused.split_linear`), which the kernel after
        each adds up: the qkv epilogue, the add+RMSNorm after o and down. ``splits``: one
        count for all three, or ``{"qkv": S, "o": S, "down": S}`` (missing keys 0); 0 = the
        plain GEMM. Never under tensor parallelism (o and down all-reduce), nor for a qkv
        projection with a bias. CUDA graphs keep the setting they were captured with. Stored
        as ``linear_splits``, a dict."""
        counts = parse_linear_splits(splits)
        self.linear_splits = counts if self.tp is None else dict.fromkeys(counts, 0)
        for layer in self.layers:
            layer.self_attn.qkv_splits = self.linear_splits["qkv"]
            layer.self_attn.o_splits = self.linear_splits["o"]
            layer.mlp.down_splits = self.linear_splits["down"]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

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
        """Run one step.

        Args:
            input_ids: ``[T]`` int64 token ids on the model device.
            positions: ``[T]`` int64 absolute positions (``< max_positions``).
            attention: the step's planned metadata per attention family (``{"paged":
                prepared AttentionMetadata}``), or None for backends that need none.
            logits_indices: ``[N]`` int64 rows of T whose logits are wanted (None = all).
            argmax_out: optional int64 ``[N]`` on the model device, filled with the greedy
                tokens ``logits.argmax(-1)`` (fused into the LM head where
                `kvplan.ops.small_gemm.small_linear` runs its kernel; under tensor
                parallelism taken of the gathered logits).

        Returns:
            ``[N, vocab_size]`` fp32 logits (the model's dtype without ``float_logits``).
        """
        fused = input_ids.is_cuda if self.fused_kernels is None else self.fused_kernels
        h = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer, family in zip(self.layers, self.layer_families):
            metadata = None if attention is None else attention[family]
            h, residual = layer(h, residual, positions, self.rotary, metadata, fused=fused)
        if logits_indices is not None:
            h = h.rows(logits_indices) if isinstance(h, ops.SplitSums) else h[logits_indices]
            residual = None if residual is None else residual[logits_indices]
        h = self.norm(h, residual, fused=fused)  # [N, hidden]
        return lm_head_logits(self, h, argmax_out)


def lm_head_logits(
    model: Any, h: torch.Tensor, argmax_out: torch.Tensor | None = None
) -> torch.Tensor:
    """The LM head of a dense model (`LlamaForCausalLM`, the Gemma-3 model): logits ``[N, V]``
    of ``h [N, hidden]`` by ``model.lm_head_weight``, fp32 with ``model.float_logits``, else
    in the model's dtype. ``argmax_out`` (int64 ``[N]``): filled with their argmax -- fused
    into `small_linear` on one device; under tensor parallelism (``model.tp``: each rank holds
    a share of the vocabulary) `argmax_rows` of the gathered logits. The argmax of the
    model-dtype logits is that of their fp32 copy (widening is exact)."""
    tp = model.tp
    logits = small_linear(h, model.lm_head_weight, None if tp is not None else argmax_out)
    if tp is not None:  # [N, V / tp] -> [N, V]
        logits = tp.gather_vocab(logits, model.config.vocab_size)
        if argmax_out is not None:
            argmax_rows(logits, out=argmax_out)
    return logits.float() if model.float_logits else logits


LINEAR_SPLIT_NAMES = ("qkv", "o", "down")


def parse_linear_splits(splits: int | Mapping[str, int]) -> dict[str, int]:
    """`LlamaForCausalLM.set_linear_splits`'s argument as ``{"qkv": S, "o": S, "down": S}``."""
    if isinstance(splits, Mapping):
        unknown = set(splits) - set(LINEAR_SPLIT_NAMES)
        if unknown:
            raise ValueError(
                f"linear_splits names {sorted(unknown)}; known: {list(LINEAR_SPLIT_NAMES)}"
            )
        counts = {name: splits.get(name, 0) for name in LINEAR_SPLIT_NAMES}
    else:
        counts = dict.fromkeys(LINEAR_SPLIT_NAMES, splits)
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"linear_splits[{name!r}] must be an int >= 0, got {value!r}")
    return counts


DEFAULT_LINEAR_SPLITS = {"qkv": 0, "o": 2, "down": 2}
"""The default split counts: o and down in 2 (the norm after each adds the partials); qkv
plain (its epilogue reading partials cost what the split saved). Measured on llama-1b's
short workload's decode graph (H100, bench/RESULTS.md, session 50): 1.619 against 1.657 ms."""


def _splits_from_env() -> int | dict[str, int]:
    """``KVPLAN_SPLIT_LINEAR``: the default of `set_linear_splits`: ``S`` or
    ``qkv=S,o=S,down=S`` (unset or empty: `DEFAULT_LINEAR_SPLITS`)."""
    value = os.environ.get(SPLIT_LINEAR_ENV, "")
    if not value:
        return dict(DEFAULT_LINEAR_SPLITS)
    try:
        if "=" not in value:
            return int(value)
        return {k.strip(): int(v) for k, v in (part.split("=") for part in value.split(","))}
    except ValueError:
        raise ValueError(
            f"{SPLIT_LINEAR_ENV} must be S or qkv=S,o=S,down=S (ints >= 0), got {value!r}"
        ) from None


def _fused_from_env() -> bool | None:
    """``KVPLAN_FUSED_KERNELS``: ``1`` -> True, ``0`` -> False, unset or empty -> None."""
    value = os.environ.get(FUSED_KERNELS_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{FUSED_KERNELS_ENV} must be 0 or 1, got {value!r}")
    return None if value == "" else value == "1"
