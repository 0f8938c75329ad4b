"""Assemble an engine: model + weights, KV cache manager + tensors, backend metadata, scheduler.

Sizing rules:

* ``max_model_len`` (default ``min(4096, max_position_embeddings)``) sets the RoPE table and
  ``max_blocks_per_seq = ceil(max_model_len / block_size)``;
* ``num_blocks`` (per pool; one pool per distinct sliding window) defaults to what
  ``kv_cache_memory`` holds, capped at what ``max_num_seqs`` full-length sequences need, and
  is at least one full-length sequence plus the padding block 0, so every admitted request
  can always run alone (preemption by recompute then always makes progress).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from kvplan.cache.kv_tensors import KV_FORMATS as STORED_KV_FORMATS
from kvplan.engine.core import EngineCore
from kvplan.engine.runner import ModelRunner
from kvplan.engine.scheduler import Scheduler
from kvplan.engine.speculative import NgramProposer
from kvplan.models.config import ModelConfig
from kvplan.models.llama import LlamaForCausalLM
from kvplan.models.loader import ModelSource, resolve_source
from kvplan.models.weights import init_random_weights, load_weights

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
KV_FORMATS = ("auto", *STORED_KV_FORMATS)


@dataclass
class EngineParts:
    core: EngineCore
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any
    manager: Any
    kv_cache: Any
    metadata: Any
    source: ModelSource
    kv_format: str
    num_blocks: int


def resolve_dtype(dtype: Any, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def resolve_kv_format(kv_format: str, dtype: torch.dtype, head_dim: int) -> str:
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    if kv_format == "auto":
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    if kv_format == "fp8" and head_dim % 32:
        raise ValueError(f"kv_format='fp8' needs head_dim % 32 == 0, got head_dim={head_dim}")
    return kv_format


def _bytes_per_block(cfg: ModelConfig, block_size: int, kv_format: str) -> int:
    per_value = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1 + 1 / 32}[kv_format]
    return int(cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * per_value) + 1


def build_model(
    source: ModelSource,
    backend_cls: Any,
    *,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> LlamaForCausalLM:
    """Allocate the model directly on ``device`` (no throwaway init) and fill its weights."""
    with torch.device("meta"):
        model = LlamaForCausalLM(source.config, backend_cls, max_positions=1, dtype=dtype)
    model = model.to_empty(device=device)
    model.set_rotary(max_positions)
    if source.weights is None:
        init_random_weights(model, seed=seed)
    else:
        load_weights(model, source.weights())
    return model.eval()


def build_engine(
    model: Any,
    *,
    device: Any,
    dtype: Any,
    backend: str,
    kv_format: str,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int | None,
    num_blocks: int | None,
    kv_cache_memory: int | None,
    enable_prefix_caching: bool,
    enable_chunked_prefill: bool,
    num_speculative_tokens: int,
    use_cuda_graph: bool | None,
    seed: int,
    async_scheduling: bool | None = None,
) -> EngineParts:
    from kvplan.backends import get_backend
    from kvplan.cache import KVCacheManager
    from kvplan.cache.kv_tensors import KVCacheTensors

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    torch_dtype = resolve_dtype(dtype, dev)
    backend_cls = get_backend(backend)
    source = resolve_source(model)
    cfg = source.config
    fmt = resolve_kv_format(kv_format, torch_dtype, cfg.head_dim)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if max_model_len is None:
        max_model_len = min(4096, cfg.max_position_embeddings)
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    max_blocks_per_seq = -(-max_model_len // block_size)

    net = build_model(
        source, backend_cls, max_positions=max_model_len, dtype=torch_dtype, device=dev, seed=seed
    )
    if num_blocks is None:
        if kv_cache_memory is None:
            if dev.type == "cuda":
                kv_cache_memory = int(torch.cuda.mem_get_info(dev)[0] * 0.6)
            else:
                kv_cache_memory = 1 << 30
        by_memory = kv_cache_memory // _bytes_per_block(cfg, block_size, fmt)
        num_blocks = min(by_memory, max_num_seqs * max_blocks_per_seq + 1)
    if num_blocks < max_blocks_per_seq + 1:
        raise ValueError(
            f"num_blocks={num_blocks} cannot hold one sequence of max_model_len={max_model_len} "
            f"({max_blocks_per_seq} blocks + the padding block 0)"
        )
    windows = cfg.windows
    manager = KVCacheManager.from_layer_windows(
        num_blocks,
        block_size,
        windows,
        max_blocks_per_seq=max_blocks_per_seq,
        enable_prefix_caching=enable_prefix_caching,
    )
    kv_cache = KVCacheTensors(
        cfg.num_layers,
        num_blocks,
        block_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        kv_format=fmt,
        device=dev,
    )
    max_num_tokens = max_num_batched_tokens
    metadata = backend_cls.Metadata(
        max_num_requests=max_num_seqs,
        max_num_tokens=max_num_tokens,
        kv_cache_manager=manager,
        kv_cache=kv_cache,
        layer_windows=windows,
        device=dev,
    )
    graphs = None
    if use_cuda_graph is None:
        use_cuda_graph = dev.type == "cuda"
    if use_cuda_graph:
        from kvplan.engine.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs.maybe_create(
            net, backend_cls, metadata, manager, max_num_seqs, max_model_len
        )
    runner = ModelRunner(net, metadata, dev, graphs)
    proposer = NgramProposer(num_speculative_tokens) if num_speculative_tokens > 0 else None
    scheduler = Scheduler(
        manager,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=enable_chunked_prefill,
        propose_drafts=(lambda r: proposer.propose(r.all_token_ids)) if proposer else None,
    )
    tok = source.tokenizer
    eos = set(cfg.eos_token_ids)
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
        seed=seed,
        async_scheduling=async_scheduling,
    )
    print(
        f"kvplan: {source.name} ({cfg.num_params / 1e6:.0f}M params) on {dev}, {torch_dtype}, "
        f"backend={backend}, kv_format={fmt}, {num_blocks} blocks x {block_size} tokens",
        file=sys.stderr,
    )
    return EngineParts(core, net, cfg, tok, manager, kv_cache, metadata, source, fmt, num_blocks)
