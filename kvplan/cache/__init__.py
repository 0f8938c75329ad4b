"""KV cache bookkeeping (integer block ids, numpy tables) and the per-layer KV cache tensors.

* ``BlockPool`` -- ref-counted block ids with an LRU free list and a chained-hash prefix cache;
* ``KVCacheManager`` -- per-request blocks over one pool per window size (VSWA), beams, cross
  blocks, state slots, reserved vs logical blocks, batch block tables and block offsets;
* ``KVCacheTensors`` -- per-layer K/V caches (bf16 / fp16 / fp32 / fp8) and ``store``.
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
