"""Assemble an engine from a model and an `EngineConfig`: model + weights, KV cache manager
and tensors, one object per attention family, runner, scheduler, engine core.

Sizing rules:

* ``max_model_len`` (default ``min(4096, max_position_embeddings)``) sets the RoPE table and
  ``max_blocks_per_seq = ceil(max_model_len / block_size)``;
* one KV pool per distinct sliding window (`kvplan.cache.pool_sizing` states the split):
  each sliding-window pool holds what ``window_pool_seqs`` running sequences can keep inside
  the window (O(window) blocks each), the full-attention pool takes the rest of
  ``kv_cache_memory`` (or gets ``num_blocks``), capped at what ``max_num_seqs`` full-length
  sequences need; every pool holds at least one sequence plus the padding block 0, so every
  admitted request can always run alone (preemption by recompute then always makes
  progress). A layer's K/V tensors hold its pool's block count.

Attention families: the model names the family of each layer (``model.layer_families``);
``_FAMILY_BUILDERS`` maps each name to the function that builds its object.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvplan.cache.cache_config import KVCacheConfig
from kvplan.cache.kv_tensors import QUANTIZED_KV_FORMATS, kv_bytes_per_value
from kvplan.cache.pool_sizing import PoolSizes, plan_pool_blocks
from kvplan.engine.config import EngineConfig
from kvplan.engine.core import EngineCore
from kvplan.engine.families import PAGED, AttentionFamily, PagedFamily
from kvplan.engine.hybrid import (
    HYBRID,
    KEEP_STATE_IN_CHUNK,
    HybridSource,
    build_hybrid,
    hybrid_source,
)
from kvplan.engine.runner import ModelRunner
from kvplan.engine.scheduler import Scheduler
from kvplan.engine.speculative import NgramProposer
from kvplan.models.config import ModelConfig
from kvplan.models.gemma3 import Gemma3ForCausalLM
from kvplan.models.llama import LlamaForCausalLM
from kvplan.models.loader import ModelSource, resolve_source, tokenizer_from_folder
from kvplan.models.weights import init_random_weights, load_weights


@dataclass
class EngineParts:
    """What `build_engine` made (kept by `kvplan.LLM` as ``llm.parts``)."""

    core: EngineCore
    model: LlamaForCausalLM
    config: ModelConfig
    engine_config: EngineConfig
    tokenizer: Any
    manager: Any
    kv_cache: Any
    metadata: Any  # the paged family's AttentionMetadata
    source: ModelSource
    kv_format: str
    num_blocks: int  # the largest pool's block count (``pool_sizes`` has every pool's)
    pool_sizes: PoolSizes | None = None  # None for hybrid models
    # rank 0's `kvplan.distributed.TensorParallelGroup` (None on one device): `LLM.close` stops it
    tensor_parallel: Any = None


def layer_block_bytes(cfg: ModelConfig, block_size: int, kv_format: str) -> int:
    """Bytes of one block of one layer's K and V caches in ``kv_format`` (scales included)."""
    per_value = kv_bytes_per_value(kv_format)
    return math.ceil(2 * block_size * cfg.num_kv_heads * cfg.head_dim * per_value)


def pool_sizes(
    cfg: ModelConfig, config: EngineConfig, kv_format: str, max_blocks_per_seq: int
) -> PoolSizes:
    """Blocks of each KV pool (pools in the manager's order: first-seen layer windows) from
    ``config``'s budget (`kvplan.cache.pool_sizing`)."""
    windows, layer_to_pool = KVCacheConfig.layer_windows_to_pools(cfg.windows)
    per_layer = layer_block_bytes(cfg, config.block_size, kv_format)
    budget = {"num_blocks": config.num_blocks}
    if config.num_blocks is None:
        budget = {"memory": config.resolve_kv_cache_memory()}
    return plan_pool_blocks(
        windows,
        [per_layer * layer_to_pool.count(p) for p in range(len(windows))],
        block_size=config.block_size,
        max_blocks_per_seq=max_blocks_per_seq,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        windowed=_releases_out_of_window(cfg, config),
        window_pool_seqs=config.window_pool_seqs,
        **budget,
    )


def _releases_out_of_window(cfg: ModelConfig, config: EngineConfig) -> bool:
    """Sliding-window layers keep O(window) blocks per request (unless
    ``config.sliding_window_kv == "full"``: full-length pages, the window a mask)."""
    return config.sliding_window_kv == "window" and any(w is not None for w in cfg.windows)


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM] | type[Gemma3ForCausalLM]:
    """The model class serving ``cfg`` (by its ``model_type``)."""
    return Gemma3ForCausalLM if cfg.is_gemma3 else LlamaForCausalLM


def build_model(
    source: ModelSource,
    backend_cls: Any,
    *,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    kv_rotation: bool = False,
) -> LlamaForCausalLM:
    """Allocate the model directly on ``device`` (no throwaway init) and fill its weights;
    ``kv_rotation``: the models' Hadamard q/k rotation (`kvplan.models.kv_rotation`). The
    model returns logits in its dtype (``float_logits = False``): greedy steps take
    `kvplan.ops.argmax.argmax_rows` of them, sampling and logprobs widen what they read (the
    same fp32 values the skipped copy would hold)."""
    with torch.device("meta"):
        model = model_class(source.config)(
            source.config, backend_cls, max_positions=1, dtype=dtype, kv_rotation=kv_rotation
        )
    model = model.to_empty(device=device)
    model.set_rotary(max_positions)
    if source.weights is None:
        init_random_weights(model, seed=seed)
    else:
        load_weights(model, source.weights())
    model.float_logits = False
    return model.eval()


@dataclass(frozen=True)
class _Sizes:
    """Settings resolved for this model (device, KV format, lengths, pool size)."""

    device: torch.device
    kv_format: str
    max_model_len: int
    max_blocks_per_seq: int
    pools: PoolSizes | None = None  # set once the model's weights are on the device


def paged_sizes(
    kv_cfg: ModelConfig,
    config: EngineConfig,
    kv_format: str,
    max_model_len: int,
    max_blocks_per_seq: int,
    agree: Callable[[int], int] | None = None,
) -> _Sizes:
    """Sizes of a paged engine on the device ``config`` names: the pools from ``kv_cfg`` (the
    KV heads this rank holds). ``agree``: under tensor parallelism, a collective that returns
    the smallest of every rank's count, applied to each pool (every rank sized its own
    memory; all ranks must use one block count per pool)."""
    pools = pool_sizes(kv_cfg, config, kv_format, max_blocks_per_seq)
    if agree is not None:
        pools = replace(pools, num_blocks=tuple(agree(n) for n in pools.num_blocks))
    return _Sizes(config.torch_device, kv_format, max_model_len, max_blocks_per_seq, pools)


def _paged_family(cfg: ModelConfig, config: EngineConfig, sizes: _Sizes, manager: Any):
    """The paged family: KV tensors of every layer + the backend's metadata object."""
    from kvplan.backends import get_backend
    from kvplan.cache.kv_tensors import KVCacheTensors

    pool_blocks = sizes.pools.num_blocks
    kv_cache = KVCacheTensors(
        cfg.num_layers,
        [pool_blocks[manager.pool_for_layer(layer)] for layer in range(cfg.num_layers)],
        config.block_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        kv_format=sizes.kv_format,
        device=sizes.device,
    )
    metadata = get_backend(config.backend).Metadata(
        max_num_requests=config.max_num_seqs,
        max_num_tokens=config.max_num_batched_tokens,
        kv_cache_manager=manager,
        kv_cache=kv_cache,
        layer_windows=cfg.windows,
        device=sizes.device,
    )
    recent = None
    if config.kv_exact_window:
        from kvplan.cache.recent_window import RecentKV, RecentWindow

        ring = RecentKV(
            cfg.num_layers, config.max_num_seqs, config.kv_exact_window, cfg.num_kv_heads,
            cfg.head_dim, slack=config.num_speculative_tokens, dtype=torch.bfloat16,
            device=sizes.device,
        )  # fmt: skip
        tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        recent = RecentWindow(ring, tokens, sizes.device)
    return PagedFamily(metadata, recent)


# family name -> f(model config, engine config, sizes, cache manager) -> AttentionFamily
_FAMILY_BUILDERS: dict[str, Callable[..., AttentionFamily]] = {PAGED: _paged_family}


def _hybrid_source(model: Any) -> HybridSource | None:
    """``model`` as a hybrid (DeepSeek-V4) folder, or None for every other kind of model."""
    if not isinstance(model, (str, Path)) or str(model).startswith("random:"):
        return None
    path = Path(model).expanduser()
    return hybrid_source(path) if path.is_dir() else None


def build_engine(model: Any, config: EngineConfig) -> EngineParts:
    """Build every part of an engine for ``model`` (see `kvplan.LLM` for what it may be);
    ``tensor_parallel_size > 1`` starts the other ranks (`kvplan.distributed.engine`)."""
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
    if config.tensor_parallel_size == 1:
        return _build_engine(model, config, None)
    if _hybrid_source(model) is not None:
        raise NotImplementedError(
            "tensor_parallel_size > 1 is implemented for the Llama family; DeepSeek-V4 "
            "(hybrid) models run on one device"
        )
    from kvplan.distributed.engine import build_tensor_parallel

    return build_tensor_parallel(model, config, _build_engine, resolve_source(model))


def _build_engine(model: Any, config: EngineConfig, tp: Any) -> EngineParts:
    """`build_engine` on one device, or rank 0's part of a tensor-parallel engine with the
    hooks ``tp`` (a `kvplan.distributed.engine.TPBuild`)."""
    from kvplan.backends import get_backend
    from kvplan.cache import KVCacheManager

    dev = config.torch_device
    torch_dtype = config.torch_dtype
    hybrid = _hybrid_source(model)
    if hybrid is not None:
        if config.kv_rotation:
            raise ValueError("kv_rotation=True is supported for dense models, not DeepSeek-V4")
        if config.kv_exact_window:
            raise ValueError(
                f"kv_exact_window={config.kv_exact_window} is supported for dense models, not "
                "DeepSeek-V4 (its sliding-window ring already holds the newest rows)"
            )
        parts = build_hybrid(hybrid, config)
        net, manager, graphs = parts.model, parts.manager, None
        if config.cuda_graphs_on:
            from kvplan.engine.hybrid_graphs import HybridDecodeGraphs

            graphs = HybridDecodeGraphs.maybe_create(net, parts.family.family, config.max_num_seqs)
            parts.family.graphs = graphs
        families = {HYBRID: parts.family}
        runner = ModelRunner(net, families, dev, graphs)
        source = ModelSource(
            hybrid.folder.name, hybrid.config, None, tokenizer_from_folder(hybrid.folder)
        )
        cfg, fmt, num_blocks = hybrid.config, parts.kv_format, parts.num_blocks
        max_model_len, eos_ids = parts.max_model_len, hybrid.eos_token_ids
        async_scheduling = config.async_scheduling_on  # steps ahead: kvplan.engine.hybrid
        summary = f"block_size={parts.block_size}, cuda_graphs={graphs is not None}"
        pools = None
        resume_block_size = parts.resume_block_size
    else:
        source = resolve_source(model)
        cfg = source.config
        fmt = config.resolve_kv_format(cfg.head_dim)
        if config.kv_exact_window and fmt not in QUANTIZED_KV_FORMATS:
            raise ValueError(
                f"kv_exact_window={config.kv_exact_window} needs a quantized kv_format "
                f"{tuple(QUANTIZED_KV_FORMATS)}, got {fmt!r}"
            )
        max_model_len = config.model_max_len(cfg.max_position_embeddings)
        max_blocks_per_seq = -(-max_model_len // config.block_size)
        backend_cls = get_backend(config.backend)
        rotation = {"kv_rotation": True} if config.kv_rotation else {}  # one device only
        net = (build_model if tp is None else tp.build_model)(
            source, backend_cls, max_positions=max_model_len, dtype=torch_dtype, device=dev,
            seed=config.seed, **rotation,
        )  # fmt: skip
        kv_cfg = cfg if tp is None else tp.kv_config(cfg)  # this rank's KV heads
        sizes = paged_sizes(
            kv_cfg,
            config,
            fmt,
            max_model_len,
            max_blocks_per_seq,
            None if tp is None else tp.num_blocks,
        )
        pools = sizes.pools
        num_blocks = max(pools.num_blocks)
        manager = KVCacheManager.from_layer_windows(
            list(pools.num_blocks),
            config.block_size,
            cfg.windows,
            max_blocks_per_seq=max_blocks_per_seq,
            enable_prefix_caching=config.enable_prefix_caching,
            release_out_of_window=_releases_out_of_window(cfg, config),
        )
        names = sorted(set(net.layer_families))
        unknown = [n for n in names if n not in _FAMILY_BUILDERS]
        if unknown:
            raise ValueError(
                f"unknown attention families {unknown}; known: {sorted(_FAMILY_BUILDERS)}"
            )
        families = {n: _FAMILY_BUILDERS[n](kv_cfg, config, sizes, manager) for n in names}
        metadata = families[PAGED].metadata if PAGED in families else None
        graphs = None
        if config.cuda_graphs_on and metadata is not None:
            from kvplan.engine.cuda_graphs import DecodeGraphs, kv_format_context_bounds

            graphs = DecodeGraphs.maybe_create(
                net,
                backend_cls,
                metadata,
                manager,
                config.max_num_seqs,
                max_model_len,
                kv_format_context_bounds(fmt),
                families[PAGED].recent,
            )
        if tp is None:
            runner = ModelRunner(net, families, dev, graphs)
        else:
            runner = tp.runner(net, families, dev, manager)
        eos_ids = list(cfg.eos_token_ids)
        async_scheduling = config.async_scheduling_on
        resume_block_size = 0
        summary = (
            f"{cfg.num_params / 1e6:.0f}M params, backend={config.backend}, "
            f"{config.block_size} tokens per block"
        )
    n = config.num_speculative_tokens
    proposer = NgramProposer(n) if n > 0 else None
    scheduler = Scheduler(
        manager,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        enable_chunked_prefill=config.enable_chunked_prefill,
        propose_drafts=(lambda r: proposer.propose(r.all_token_ids)) if proposer else None,
        on_free=runner.free,
        num_draft_tokens=n,
        resume_block_size=resume_block_size,
        wait_for_shared_prefix=config.wait_for_shared_prefix,
        keep_state_in_chunk=KEEP_STATE_IN_CHUNK,  # only where resume_block_size cuts
    )
    tok = source.tokenizer
    eos = set(eos_ids)
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        eos.add(int(tok.eos_token_id))
    decode_text = None
    if tok is not None:
        decode_text = lambda ids: tok.decode(ids, skip_special_tokens=True)
    core = EngineCore(
        scheduler,
        runner,
        eos_token_ids=sorted(eos),
        decode_text=decode_text,
        max_model_len=max_model_len,
        seed=config.seed,
        async_scheduling=async_scheduling,
        vocab_size=getattr(cfg, "vocab_size", None),
        tokenizer=tok,
    )
    recent = getattr(families.get(PAGED), "recent", None)
    ring = "" if recent is None else (
        f", kv_exact_window={recent.kv.window} (ring {recent.kv.nbytes / 2**20:.1f} MiB)"
    )  # fmt: skip
    print(
        f"kvplan: {source.name} on {dev}, {torch_dtype}, {summary}, kv_format={fmt}, "
        f"{num_blocks if pools is None else list(pools.num_blocks)} blocks{ring}",
        file=sys.stderr,
    )
    metadata = runner.metadata
    kv_cache = None if metadata is None else metadata.kv_cache
    return EngineParts(
        core, net, cfg, config, tok, manager, kv_cache, metadata, source, fmt, num_blocks, pools
    )
