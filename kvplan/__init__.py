"""kvplan: the layer between an LLM scheduler and its attention kernels.

* storage  -- KV cache byte formats, allocation, ``store_kv_cache`` / ``load_paged_kv_cache``,
  block load plans and the index ops (``kvplan.ops``);
* planning -- scheduler state -> every tensor the attention kernels need (``kvplan.plan``);
* backends -- attention metadata and paged-attention kernels (``kvplan.backends``);
* engine   -- scheduler, model runner, sampler: ``kvplan.LLM`` and ``kvplan generate``.

Names are imported lazily so that ``import kvplan`` stays cheap (the CLI starts fast).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplan._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # storage: formats and allocation
    "KVCacheFormat": "kvplan.formats",
    "V41_FORMAT": "kvplan.formats",
    "V41_FP4_FORMAT": "kvplan.formats",
    "FP4_INDEX_KV_FORMAT": "kvplan.formats",
    "FP8_FLOAT32_SF_INDEX_KV_FORMAT": "kvplan.formats",
    "MXFP8_INDEX_KV_FORMAT": "kvplan.formats",
    "SUPPORTED_KV_CACHE_FORMATS": "kvplan.formats",
    "bf16_format": "kvplan.formats",
    "alloc_kv_cache": "kvplan.formats",
    "split_kv_cache": "kvplan.formats",
    "resolve_kv_cache_layout": "kvplan.formats",
    # storage: store / load / load plans
    "store_kv_cache": "kvplan.ops.store",
    "load_paged_kv_cache": "kvplan.ops.load",
    "BlockLoadPlanBuilder": "kvplan.load_plan",
    "validate_load_plan": "kvplan.load_plan",
    # cache bookkeeping and tensors
    "KVCacheManager": "kvplan.cache.kv_cache_manager",
    "AllocationResult": "kvplan.cache.kv_cache_manager",
    "KVCacheTensors": "kvplan.cache.kv_tensors",
    # planning
    "MetadataConfig": "kvplan.plan.config",
    "SequenceMetadata": "kvplan.plan.sequence",
    "InputMetadata": "kvplan.plan.metadata",
    "prepare_prompt": "kvplan.plan.prompt",
    "prepare_decode": "kvplan.plan.decode",
    "prepare_decode_on_device": "kvplan.plan.decode_device",
    "DecodeBatchArrays": "kvplan.plan.decode_arrays",
    # backends
    "AttentionMetadata": "kvplan.backends.metadata",
    "get_backend": "kvplan.backends",
    # engine
    "LLM": "kvplan.engine.llm",
    "EngineConfig": "kvplan.engine.config",
    "SamplingParams": "kvplan.engine.sampling",
}

__all__ = [
    "DecodeBatchArrays",
    "AllocationResult",
    "AttentionMetadata",
    "BlockLoadPlanBuilder",
    "EngineConfig",
    "FP4_INDEX_KV_FORMAT",
    "FP8_FLOAT32_SF_INDEX_KV_FORMAT",
    "InputMetadata",
    "KVCacheFormat",
    "KVCacheManager",
    "KVCacheTensors",
    "LLM",
    "MXFP8_INDEX_KV_FORMAT",
    "MetadataConfig",
    "SUPPORTED_KV_CACHE_FORMATS",
    "SamplingParams",
    "SequenceMetadata",
    "V41_FORMAT",
    "V41_FP4_FORMAT",
    "alloc_kv_cache",
    "bf16_format",
    "get_backend",
    "load_paged_kv_cache",
    "prepare_decode",
    "prepare_decode_on_device",
    "prepare_prompt",
    "resolve_kv_cache_layout",
    "split_kv_cache",
    "store_kv_cache",
    "validate_load_plan",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:  # pragma: no cover
    from kvplan.backends import get_backend
    from kvplan.backends.metadata import AttentionMetadata
    from kvplan.cache.kv_cache_manager import AllocationResult, KVCacheManager
    from kvplan.cache.kv_tensors import KVCacheTensors
    from kvplan.engine.config import EngineConfig
    from kvplan.engine.llm import LLM
    from kvplan.engine.sampling import SamplingParams
    from kvplan.formats import (
        FP4_INDEX_KV_FORMAT,
        FP8_FLOAT32_SF_INDEX_KV_FORMAT,
        MXFP8_INDEX_KV_FORMAT,
        SUPPORTED_KV_CACHE_FORMATS,
        V41_FORMAT,
        V41_FP4_FORMAT,
        KVCacheFormat,
        alloc_kv_cache,
        bf16_format,
        resolve_kv_cache_layout,
        split_kv_cache,
    )
    from kvplan.load_plan import BlockLoadPlanBuilder, validate_load_plan
    from kvplan.ops.load import load_paged_kv_cache
    from kvplan.ops.store import store_kv_cache
    from kvplan.plan.config import MetadataConfig
    from kvplan.plan.decode import prepare_decode
    from kvplan.plan.decode_arrays import DecodeBatchArrays
    from kvplan.plan.decode_device import prepare_decode_on_device
    from kvplan.plan.metadata import InputMetadata
    from kvplan.plan.prompt import prepare_prompt
    from kvplan.plan.sequence import SequenceMetadata
