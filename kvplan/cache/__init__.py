"""KV cache bookkeeping (integer block ids, numpy tables) and the per-layer KV cache tensors.

* ``KVCacheManager`` (``kv_cache_manager.py``) -- per-request blocks over one pool per window
  size (VSWA), beams, cross blocks, state slots, reserved vs logical blocks, batch block
  tables and block offsets. Built from parts it owns:
  ``BlockPool`` (``block_pool.py``: ref-counted block ids, LRU free list, chained-hash prefix
  cache), ``RequestTable`` (``request_table.py``: rows, numpy block tables, lengths),
  ``BlockAllocator`` (``block_allocator.py``), ``PrefixCache`` (``prefix_cache.py``),
  ``DecodeStepUpdates`` (``decode_step.py``: the batched decode-step calls) and
  ``BatchTableViews`` (``batch_views.py`` over ``batch_tables.py`` formats and
  ``block_offsets.py`` staging); ``KVCacheConfig`` (``cache_config.py``) validates its
  arguments, ``allocation_result.py`` holds the typed outcomes.
* ``KVCacheTensors`` (``kv_tensors.py``) -- per-layer K/V caches (bf16 / fp16 / fp32 / fp8)
  and ``store``.
"""

from kvplan.cache.block_pool import PADDING_BLOCK_ID, BlockPool, hash_block_tokens
from kvplan.cache.kv_cache_manager import AllocationResult, KVCacheManager, PrefixCacheStats

__all__ = [
    "PADDING_BLOCK_ID",
    "AllocationResult",
    "BlockPool",
    "KVCacheManager",
    "KVCacheTensors",
    "PrefixCacheStats",
    "hash_block_tokens",
]


def __getattr__(name: str):
    # KVCacheTensors imports torch and the storage formats; load it on first use only.
    if name == "KVCacheTensors":
        from kvplan.cache.kv_tensors import KVCacheTensors

        return KVCacheTensors
    raise AttributeError(f"module 'kvplan.cache' has no attribute {name!r}")
