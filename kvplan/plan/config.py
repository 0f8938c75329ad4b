"""``MetadataConfig``: the engine-wide constants every planning builder reads.

A frozen dataclass validated in ``__post_init__``; derived values are properties. Ratios are
compression ratios of the compressed-attention ("ca") KV pools: a compressed token of ratio
``r`` summarizes ``r`` raw positions, and one KV block of ``block_size`` slots holds
``block_size // r`` compressed tokens of ratio ``r``. Per-ratio dicts are keyed by
``ratio_key(r)`` (the ratio's decimal string).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kvplan._checks import INT32_MAX
from kvplan._math import cdiv

QUERY_INDEX_PLACEHOLDER = 998244353
"""``query_indices`` of a placeholder row: large enough that any gather with it faults."""

YOCO_MODES = ("mask", "compact")


def ratio_key(ratio: int) -> str:
    """Key of per-ratio dicts: the ratio's decimal string (``4 -> "4"``)."""
    return str(int(ratio))


def _check_positive(name: str, value: object, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    low = 0 if allow_zero else 1
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


@dataclass(frozen=True)
class MetadataConfig:
    """Constants of the planning layer (one per engine; frozen, validated).

    Attributes:
        block_size: slots per KV block of every compressed pool (and of the block table).
        dense_ratios: compression ratios of the dense compressed-attention layers (read every
            compressed token); each must divide ``block_size``.
        sparse_ratios: compression ratios of the sparse layers (read the indexer's top-k of the
            compressed tokens); each must divide ``block_size``.
        window_size: sliding-window length ``W``: a query at ``p`` sees raw keys ``p-W+1 .. p``.
        swa_block_size: ring length of a sequence's SWA state slot (``>= window_size``; the
            extra room lets a decode step write its draft tokens before it reads).
        max_model_len: longest sequence (``seqlen_k``) the engine serves.
        max_num_blocks: width of the per-token ``block_tables`` (decode); must cover
            ``max_model_len`` at the smallest ratio.
        max_ngram_size: Engram look-back length (0 disables ``ngram_token_ids``).
        pad_token_id: the id written into ``ngram_token_ids`` before the sequence start and from
            an image token on.
        force_load_balance: value of every ``gate_force_random`` row (MoE routing bypass).
        cp_size, cp_rank: context-parallel group size and this rank (CP mirror of prompts).
        yoco_keep_tokens: YoCo prefill truncation keeps the last ``k`` tokens (None = off).
        yoco_mode: ``"mask"`` or ``"compact"`` (None when YoCo is off).
        device: where the built tensors live (``"cpu"`` or a CUDA device).
        num_kv_blocks: if set, every block id must be ``< num_kv_blocks`` (range check).
        num_state_slots: if set, every ``state_id`` must be ``< num_state_slots``.

    Example:
        >>> cfg = MetadataConfig(block_size=64, dense_ratios=(4,), sparse_ratios=(4, 16),
        ...                      window_size=128, swa_block_size=136, max_model_len=4096,
        ...                      max_num_blocks=64)
        >>> cfg.ca_ratios, cfg.min_ratio, cfg.tokens_per_block(16), cfg.kv_ca_index_width(4)
        ((4, 16), 4, 4, 1024)
    """

    block_size: int
    dense_ratios: tuple[int, ...]
    sparse_ratios: tuple[int, ...]
    window_size: int
    swa_block_size: int
    max_model_len: int
    max_num_blocks: int
    max_ngram_size: int = 0
    pad_token_id: int = 0
    force_load_balance: bool = False
    cp_size: int = 1
    cp_rank: int = 0
    yoco_keep_tokens: int | None = None
    yoco_mode: str | None = None
    device: str = "cpu"
    num_kv_blocks: int | None = None
    num_state_slots: int | None = None

    def __post_init__(self) -> None:
        _check_positive("block_size", self.block_size)
        for field in ("dense_ratios", "sparse_ratios"):
            ratios = getattr(self, field)
            if not isinstance(ratios, tuple):
                raise TypeError(f"{field} must be a tuple of ints, got {ratios!r}")
            if len(set(ratios)) != len(ratios):
                raise ValueError(f"{field} has duplicates: {ratios}")
            for r in ratios:
                _check_positive(f"{field} entry", r)
                if self.block_size % r:
                    raise ValueError(f"{field} entry {r} must divide block_size={self.block_size}")
        _check_positive("window_size", self.window_size)
        _check_positive("swa_block_size", self.swa_block_size)
        if self.swa_block_size < self.window_size:
            raise ValueError(
                f"swa_block_size={self.swa_block_size} must be >= window_size={self.window_size}"
            )
        _check_positive("max_model_len", self.max_model_len)
        _check_positive("max_num_blocks", self.max_num_blocks)
        need = self.num_blocks_for(self.max_model_len)
        if self.max_num_blocks < need:
            raise ValueError(
                f"max_num_blocks={self.max_num_blocks} cannot cover max_model_len="
                f"{self.max_model_len} (needs {need} blocks at ratio {self.min_ratio})"
            )
        _check_positive("max_ngram_size", self.max_ngram_size, allow_zero=True)
        if not isinstance(self.pad_token_id, int) or isinstance(self.pad_token_id, bool):
            raise TypeError(f"pad_token_id must be an int, got {self.pad_token_id!r}")
        if not isinstance(self.force_load_balance, bool):
            raise TypeError(f"force_load_balance must be a bool, got {self.force_load_balance!r}")
        _check_positive("cp_size", self.cp_size)
        _check_positive("cp_rank", self.cp_rank, allow_zero=True)
        if self.cp_rank >= self.cp_size:
            raise ValueError(f"cp_rank={self.cp_rank} must be < cp_size={self.cp_size}")
        if (self.yoco_keep_tokens is None) != (self.yoco_mode is None):
            raise ValueError(
                f"yoco_keep_tokens={self.yoco_keep_tokens} and yoco_mode={self.yoco_mode!r} "
                "must be both set or both None"
            )
        if self.yoco_keep_tokens is not None:
            _check_positive("yoco_keep_tokens", self.yoco_keep_tokens)
            if self.yoco_mode not in YOCO_MODES:
                raise ValueError(f"yoco_mode must be one of {YOCO_MODES}, got {self.yoco_mode!r}")
        for name in ("num_kv_blocks", "num_state_slots"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device={self.device!r} is not a torch device") from exc
        # int32 address checks that only depend on the config.
        if self.num_kv_blocks is not None and self.num_kv_blocks * self.block_size > INT32_MAX:
            raise ValueError(
                f"num_kv_blocks * block_size = {self.num_kv_blocks * self.block_size} "
                "overflows int32 slots"
            )
        if (
            self.num_state_slots is not None
            and self.num_state_slots * self.swa_block_size > INT32_MAX
        ):
            raise ValueError(
                f"num_state_slots * swa_block_size = {self.num_state_slots * self.swa_block_size}"
                " overflows int32 slots"
            )

    # ---- derived values -------------------------------------------------------------------
    @cached_property
    def ca_ratios(self) -> tuple[int, ...]:
        """Sorted union of dense and sparse ratios (every ratio with a compressed pool)."""
        return tuple(sorted(set(self.dense_ratios) | set(self.sparse_ratios)))

    @cached_property
    def min_ratio(self) -> int:
        """The ratio the block table is counted at (1 when the model has no compressed pool)."""
        return min(self.ca_ratios) if self.ca_ratios else 1

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def tokens_per_block(self, ratio: int) -> int:
        """Compressed tokens of ratio ``ratio`` per KV block (``block_size // ratio``)."""
        return self.block_size // ratio

    def num_blocks_for(self, seqlen_k: int) -> int:
        """Blocks of the table a sequence of ``seqlen_k`` keys occupies (at ``min_ratio``).

        ``ceil((seqlen_k // r_min) / (block_size // r_min))``; a larger ratio ``r`` needs no
        more blocks than this, so every ratio reads a prefix of the same table.
        """
        return cdiv(seqlen_k // self.min_ratio, self.tokens_per_block(self.min_ratio))

    def kv_ca_index_width(self, ratio: int) -> int:
        """Columns of the expanded ``kv_ca_index[r]``: ``max_model_len // r`` rounded up to a
        multiple of 128 (at least 128), as ``kvplan.ops.kv_ca_index_width`` computes it."""
        return max(1, cdiv(self.max_model_len // ratio, 128)) * 128
