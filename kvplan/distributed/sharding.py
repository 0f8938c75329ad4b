"""Slice a dense model's full state dict into one rank's share.

The full state dict is `kvplan.models.llama.LlamaForCausalLM`'s or
`kvplan.models.gemma3.Gemma3ForCausalLM`'s (the same fused names: ``qkv_proj`` holds
``[q; k; v]`` rows, ``gate_up_proj`` ``[gate; up]`` rows; Gemma 3's tied head is the
embedding). Rank r of ``size`` keeps:

====================================  ===================================================
``embed_tokens.weight``, ``lm_head``   vocabulary rows ``[r * per_rank, ...)``, zero-padded
                                       to ``per_rank = ceil(V / size)`` rows
``self_attn.qkv_proj.{weight,bias}``   its query heads' rows of q, its KV heads' rows of k
                                       and of v (`TPContext.kv_head_range`: a replicated
                                       head when KV heads are fewer than ranks),
                                       concatenated in that order
``self_attn.o_proj.weight``            the input columns of its query heads
``mlp.gate_up_proj.weight``            its intermediate rows of gate and of up
``mlp.down_proj.weight``               its intermediate columns
anything else (norms, q/k norms)       the full tensor (replicated)
====================================  ===================================================
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvplan.distributed.context import TPContext, check_tensor_parallel


def _split_rows(t: torch.Tensor, sizes: list[int], tp: TPContext, what: str) -> torch.Tensor:
    """Split ``t``'s rows into consecutive blocks of ``sizes``; keep this rank's even share
    of each block; concatenate."""
    parts, at = [], 0
    for n in sizes:
        start, end = tp.split(n, what)
        parts.append(t[at + start : at + end])
        at += n
    if at != t.shape[0]:
        raise ValueError(f"{what}: expected {at} rows, got {t.shape[0]}")
    return torch.cat(parts)


def _qkv_rows(
    t: torch.Tensor, sizes: list[int], d: int, num_kv_heads: int, tp: TPContext, what: str
) -> torch.Tensor:
    """This rank's rows of a fused ``[q; k; v]`` projection: its even share of q's rows and
    the rows of its KV heads (`TPContext.kv_head_range`) in k and in v."""
    if sum(sizes) != t.shape[0]:
        raise ValueError(f"{what}: expected {sum(sizes)} rows, got {t.shape[0]}")
    q, k, v = torch.split(t, sizes)
    start, end = tp.split(sizes[0], what)
    h0, h1 = tp.kv_head_range(num_kv_heads)
    return torch.cat([q[start:end], k[h0 * d : h1 * d], v[h0 * d : h1 * d]])


def _vocab_rows(t: torch.Tensor, vocab_size: int, tp: TPContext) -> torch.Tensor:
    start, end, per_rank = tp.vocab_range(vocab_size)
    out = t.new_zeros((per_rank, *t.shape[1:]))
    out[: end - start] = t[start:end]
    return out


def shard_state_dict(
    state: Mapping[str, torch.Tensor], cfg, tp: TPContext
) -> dict[str, torch.Tensor]:
    """Rank ``tp.rank``'s tensors of ``state`` (module docstring); ``cfg`` is the
    `kvplan.models.config.ModelConfig`. Tensors are new (cloned) so the full state can be
    freed. ValueError when the model does not split over ``tp.size`` ranks."""
    check_tensor_parallel(cfg, tp.size)
    d = cfg.head_dim
    qkv = [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]
    inter = cfg.intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name in ("embed_tokens.weight", "lm_head.weight"):
            s = _vocab_rows(t, cfg.vocab_size, tp)
        elif name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
            s = _qkv_rows(t, qkv, d, cfg.num_kv_heads, tp, name)
        elif name.endswith("self_attn.o_proj.weight"):
            start, end = tp.split(t.shape[1], name)
            s = t[:, start:end]
        elif name.endswith("mlp.gate_up_proj.weight"):
            s = _split_rows(t, [inter, inter], tp, name)
        elif name.endswith("mlp.down_proj.weight"):
            start, end = tp.split(t.shape[1], name)
            s = t[:, start:end]
        else:
            s = t
        out[name] = s.clone()
    return out
