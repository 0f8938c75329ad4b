"""One rank's model shard, KV sizing and checks (shared by rank 0 and the worker ranks).

Weights: the full model is built the single-device way (`kvplan.engine.builder.build_model`:
random weights from ``seed``, or a checkpoint) and sliced with
`kvplan.distributed.sharding.shard_state_dict`; the shard model is then allocated on the rank's
device and loaded. Random weights are drawn on the rank's device (so every rank, and a
``tensor_parallel_size=1`` engine on the same kind of device, draws the same full matrices);
checkpoints are loaded on the host, so a device holds only its shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvplan.distributed.context import TPContext, check_tensor_parallel, local_kv_heads
from kvplan.distributed.sharding import shard_state_dict


def check_model(source: Any, size: int) -> None:
    """ValueError unless the `ModelSource` ``source`` can run on ``size`` ranks: a dense
    model (the Llama family or Gemma 3) whose heads and MLP split over ``size``
    (`check_tensor_parallel`)."""
    check_tensor_parallel(source.config, size)


def local_kv_config(cfg: Any, size: int) -> Any:
    """``cfg`` with this rank's KV heads (`local_kv_heads`): the shape of its KV cache, for
    sizing and allocating it."""
    if size == 1:
        return cfg
    return dataclasses.replace(cfg, num_kv_heads=local_kv_heads(cfg.num_kv_heads, size))


def build_rank_model(
    source: Any,
    backend_cls: Any,
    *,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    tp: TPContext,
) -> Any:
    """This rank's shard of the model (`LlamaForCausalLM` or `Gemma3ForCausalLM`) with its
    weights (module docstring)."""
    from kvplan.engine.builder import build_model, model_class

    check_model(source, tp.size)
    full_device = device if source.weights is None else torch.device("cpu")
    full = build_model(
        source, backend_cls, max_positions=2, dtype=dtype, device=full_device, seed=seed
    )
    state = shard_state_dict(full.state_dict(), source.config, tp)
    del full
    with torch.device("meta"):
        cls = model_class(source.config)
        model = cls(source.config, backend_cls, max_positions=1, dtype=dtype, tp=tp)
    model = model.to_empty(device=device)
    model.set_rotary(max_positions)
    model.load_state_dict(state, strict=True)
    model.float_logits = False  # as `build_model`'s (workers discard theirs: no fp32 copy)
    return model.eval()


def agree_num_blocks(num_blocks: int, device: torch.device, tp: TPContext) -> int:
    """The smallest of every rank's KV pool size (each rank sized its own memory)."""
    import torch.distributed as dist

    t = torch.tensor([num_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
    return int(t.item())
