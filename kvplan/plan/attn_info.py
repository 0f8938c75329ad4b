"""``compute_attn_info``: expand the O(rows) ranges of an ``InputMetadata`` into dense indices.

Derived fields (``InputMetadata.get_clean_list``), rebuilt only when empty (idempotent):

* ``kv_ca_index[r]`` (dense ratios) [T, width_r]: prompt -> ``expand_kv_ca_index`` (rows of the
  loaded compressed buffer); decode -> ``expand_kv_ca_index_decode`` through the flattened
  ``block_tables`` (offsets are ``row * max_num_blocks * tpb``).
* ``kv_ca_index_len[r]`` [T]: the length column of ``kv_ca_index_offset_len[r]``.
* prompt: ``kv_swa_full_index`` [T, W] = ``expand_swa_index(kv_swa_full_index_pivots)``.
* decode: ``kv_swa_index`` [T, W] = ``expand_swa_index_decode(kv_swa_index_offset_len)``.
* ``klen[r]`` (sparse ratios) when empty: prompt ``ke - ks``; decode ``context_lens // r``.

With ``out`` (capture-size buffers keyed like the fields, per-ratio fields as dicts) every
expansion writes the leading ``T`` rows of its buffer and the field becomes that prefix view,
so the whole metadata -> expansion sequence can be captured in a CUDA graph and replayed with a
smaller batch. No host sync happens unless ``check=True``.
"""

from __future__ import annotations

import torch

from kvplan.plan.batch import lookup_out_buffer
from kvplan.plan.config import MetadataConfig, ratio_key


def _buffer(out: dict | None, name: str, key: str | None = None) -> torch.Tensor | None:
    if out is None:
        return None
    return lookup_out_buffer(out, name, key, name)


def _vector(src: torch.Tensor, buf: torch.Tensor | None, name: str) -> torch.Tensor:
    """``src`` [T] int32 written into ``buf[:T]`` (or a fresh contiguous copy)."""
    if buf is None:
        return src.contiguous()
    if buf.dtype != torch.int32 or buf.dim() != 1 or buf.shape[0] < src.shape[0]:
        raise ValueError(
            f"out {name} must be int32 [>= {src.shape[0]}], got {buf.dtype} {tuple(buf.shape)}"
        )
    view = buf[: src.shape[0]]
    view.copy_(src)
    return view


def compute_attn_info(
    meta, config: MetadataConfig, *, out: dict | None = None, check: bool = False
):
    """Fill every empty derived field of ``meta`` (see the module docstring); returns ``meta``.

    Args:
        meta: an ``InputMetadata`` from ``prepare_prompt`` / ``prepare_decode`` /
            ``prepare_decode_on_device`` (or a view of one).
        config: the config the metadata was built with.
        out: optional capture-size buffers for the derived fields.
        check: let the index ops validate their inputs (host syncs; off on hot paths).
    """
    from kvplan.ops import (
        expand_kv_ca_index,
        expand_kv_ca_index_decode,
        expand_swa_index,
        expand_swa_index_decode,
    )

    if not isinstance(config, MetadataConfig):
        raise TypeError(f"config must be a MetadataConfig, got {type(config).__name__}")
    for r in config.dense_ratios:
        key = ratio_key(r)
        offset_len = meta.kv_ca_index_offset_len.get(key)
        if offset_len is None:
            continue
        if key not in meta.kv_ca_index:
            buf = _buffer(out, "kv_ca_index", key)
            max_len = config.max_model_len // r
            if meta.is_prompt:
                idx = expand_kv_ca_index(offset_len, max_len, out=buf, check=check)
            else:
                flat = meta.block_tables.reshape(-1)
                idx = expand_kv_ca_index_decode(
                    offset_len, flat, config.block_size, r, max_len, out=buf, check=check
                )
            meta.kv_ca_index[key] = idx
        if key not in meta.kv_ca_index_len:
            buf = _buffer(out, "kv_ca_index_len", key)
            meta.kv_ca_index_len[key] = _vector(offset_len[:, 1], buf, f"kv_ca_index_len[{key!r}]")
    if meta.is_prompt:
        if meta.kv_swa_full_index is None and meta.kv_swa_full_index_pivots is not None:
            meta.kv_swa_full_index = expand_swa_index(
                meta.kv_swa_full_index_pivots,
                config.window_size,
                out=_buffer(out, "kv_swa_full_index"),
                check=check,
            )
    elif meta.kv_swa_index is None and meta.kv_swa_index_offset_len is not None:
        meta.kv_swa_index = expand_swa_index_decode(
            meta.kv_swa_index_offset_len,
            config.window_size,
            config.swa_block_size,
            out=_buffer(out, "kv_swa_index"),
            check=check,
        )
    for r in config.sparse_ratios:
        key = ratio_key(r)
        if key in meta.klen:
            continue
        if meta.is_prompt:
            if key not in meta.ks:
                continue
            src = meta.ke[key] - meta.ks[key]
        else:
            if meta.context_lens is None:
                continue
            src = torch.div(meta.context_lens, r, rounding_mode="floor")
        meta.klen[key] = _vector(src, _buffer(out, "klen", key), f"klen[{key!r}]")
    return meta
