"""KV memory of a sliding-window model: O(window) pools against full-length pages everywhere.

CPU-only arithmetic from a model config (no weights, no device): the same sizing code the
engine builder runs (`kvplan.cache.pool_sizing`, `kvplan.engine.builder.layer_block_bytes`).
Default: Gemma-3-270M's shapes (18 layers: 15 sliding with a 512-token window, 3 global; 1 KV
head of 256 dims), bf16, 16-token blocks, an 8,192-token context, 512-token chunks.

Reported per request at the context length:

* ``full_pages``: every layer keeps ``cdiv(context, block_size)`` blocks;
* ``window_pools``: full-attention layers keep every block, sliding layers the bound the pools
  are sized with (``window_blocks_per_seq`` with the chunk budget), and what a decoding
  request holds (the same bound with one token ahead);

and the largest batch of such requests that ``--memory`` bytes hold both ways (every pool
sized for that many sequences, padding blocks included: `max_seqs_that_fit`), with the
engine's split of that memory (`plan_pool_blocks`).

Usage::

    PYTHONPATH=. python bench/kv_memory.py --memory 8589934592 --out bench/results/kv_memory.json
"""

from __future__ import annotations

import argparse
import json
import sys

from kvplan._math import cdiv
from kvplan.cache.cache_config import KVCacheConfig
from kvplan.cache.pool_sizing import max_seqs_that_fit, plan_pool_blocks, window_blocks_per_seq
from kvplan.engine.builder import layer_block_bytes
from kvplan.models.config import ModelConfig


def gemma3_270m_hf_config(**overrides):
    """Gemma-3-270M's shapes as transformers' ``Gemma3TextConfig`` (its defaults give the rest:
    5 sliding layers then 1 full, RoPE bases 1e4 local / 1e6 global, ``query_pre_attn_scalar``
    256, tied embeddings); ``overrides`` replace any field."""
    from transformers import Gemma3TextConfig

    shapes = dict(
        sliding_window=512, num_hidden_layers=18, num_key_value_heads=1, head_dim=256,
        num_attention_heads=4, hidden_size=640, intermediate_size=2048, vocab_size=262144,
        max_position_embeddings=32768,
    )  # fmt: skip
    return Gemma3TextConfig(**{**shapes, **overrides})


def gemma3_270m_config() -> ModelConfig:
    """Gemma-3-270M's attention shapes (transformers' Gemma3TextConfig with its window)."""
    return ModelConfig.from_hf(gemma3_270m_hf_config())


def report(cfg: ModelConfig, *, context: int, block_size: int, kv_format: str, chunk: int,
           memory: int) -> dict:  # fmt: skip
    """Every figure of the module docstring, as a JSON-ready dict."""
    windows, layer_to_pool = KVCacheConfig.layer_windows_to_pools(cfg.windows)
    layers = [layer_to_pool.count(p) for p in range(len(windows))]
    lb = layer_block_bytes(cfg, block_size, kv_format)
    block_bytes = [lb * n for n in layers]
    full_blocks = cdiv(context, block_size)

    def per_pool(ahead: int) -> list[int]:
        return [
            full_blocks if w is None else window_blocks_per_seq(w, block_size, ahead, full_blocks)
            for w in windows
        ]

    sized, decoding = per_pool(max(chunk, 2)), per_pool(1)
    full_bytes = full_blocks * lb * cfg.num_layers
    window_bytes = sum(n * b for n, b in zip(sized, block_bytes))
    decoding_bytes = sum(n * b for n, b in zip(decoding, block_bytes))
    big = 1 << 20  # max_num_seqs high enough that memory is the only limit
    geom = dict(block_size=block_size, max_blocks_per_seq=full_blocks, max_num_seqs=big,
                max_num_batched_tokens=chunk, memory=memory)  # fmt: skip
    split = plan_pool_blocks(windows, block_bytes, **geom)
    return {
        "model": "gemma-3-270m shapes",
        "num_layers": cfg.num_layers,
        "layer_windows": {str(w): n for w, n in zip(windows, layers)},
        "kv_heads_x_head_dim": [cfg.num_kv_heads, cfg.head_dim],
        "kv_format": kv_format,
        "block_size": block_size,
        "context_tokens": context,
        "chunk_tokens": chunk,
        "layer_block_bytes": lb,
        "per_request": {
            "full_pages_bytes": full_bytes,
            "window_pools_bytes": window_bytes,
            "window_pools_decoding_bytes": decoding_bytes,
            "blocks_per_pool_window_pools": dict(zip(map(str, windows), sized)),
            "blocks_per_pool_decoding": dict(zip(map(str, windows), decoding)),
            "ratio": round(full_bytes / window_bytes, 3),
        },
        "memory_bytes": memory,
        "max_batch": {
            "full_pages": max_seqs_that_fit(memory, [full_blocks] * len(windows), block_bytes),
            "window_pools": max_seqs_that_fit(memory, sized, block_bytes),
        },
        "engine_split": {
            "num_blocks": dict(zip(map(str, windows), split.num_blocks)),
            "num_window_seqs": split.num_window_seqs,
            "total_bytes": split.total_bytes,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192, help="tokens per request")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--kv-format", default="bf16", choices=("bf16", "fp16", "fp32", "fp8", "int8")
    )
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--memory", type=int, default=8 << 30, help="KV cache bytes")
    parser.add_argument("--out", help="append the JSON row to this file")
    args = parser.parse_args(argv)
    row = report(gemma3_270m_config(), context=args.context, block_size=args.block_size,
                 kv_format=args.kv_format, chunk=args.chunk, memory=args.memory)  # fmt: skip
    req, batch = row["per_request"], row["max_batch"]
    print(
        f"{'':24s}{'bytes / request':>18s}{'max batch':>12s}\n"
        f"{'full pages':24s}{req['full_pages_bytes']:>18,d}{batch['full_pages']:>12d}\n"
        f"{'window pools':24s}{req['window_pools_bytes']:>18,d}{batch['window_pools']:>12d}\n"
        f"{'  (while decoding)':24s}{req['window_pools_decoding_bytes']:>18,d}",
        file=sys.stderr,
    )
    line = json.dumps(row)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
