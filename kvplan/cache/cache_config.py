"""``KVCacheConfig``: the validated shape of a KV cache manager (pools, blocks, limits)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from kvplan._checks import check_int32


@dataclass(frozen=True)
class KVCacheConfig:
    """What ``KVCacheManager`` is built from (its constructor's arguments, validated once).

    ``num_blocks``: blocks per pool including the padding block 0 (an int for every pool, or
    one per pool). ``window_sizes``: one pool per distinct window (None = full attention).
    ``layer_to_pool``: ``layer -> pool index`` (sequence or mapping); None maps every layer to
    pool 0 and is only allowed with one pool. The other fields are documented on
    ``KVCacheManager``. Bad values raise ``ValueError`` naming the field.
    """

    num_blocks: int | Sequence[int]
    block_size: int
    max_blocks_per_seq: int
    window_sizes: Sequence[int | None] = (None,)
    layer_to_pool: Sequence[int] | Mapping[int, int] | None = None
    enable_prefix_caching: bool = True
    num_state_slots: int = 0
    max_beam_width: int = 1
    release_out_of_window: bool = False

    def __post_init__(self) -> None:
        windows = tuple(self.window_sizes)
        if not windows:
            raise ValueError("window_sizes must name at least one pool")
        if len(set(windows)) != len(windows):
            raise ValueError(f"window_sizes must be distinct (one pool each), got {windows}")
        for w in windows:
            if w is not None and (not isinstance(w, int) or w < 1):
                raise ValueError(f"window_sizes entries must be None or ints >= 1, got {w!r}")
        if len(self.blocks_per_pool) != len(windows):
            raise ValueError(
                f"num_blocks has {len(self.blocks_per_pool)} entries for {len(windows)} pools"
            )
        bs, width = self.block_size, self.max_blocks_per_seq
        if not isinstance(bs, int) or bs < 1:
            raise ValueError(f"block_size must be an int >= 1, got {bs!r}")
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"max_blocks_per_seq must be an int >= 1, got {width!r}")
        if self.max_beam_width < 1:
            raise ValueError(f"max_beam_width must be >= 1, got {self.max_beam_width}")
        if self.num_state_slots < 0:
            raise ValueError(f"num_state_slots must be >= 0, got {self.num_state_slots}")
        for n in self.blocks_per_pool:  # slots (block * block_size + offset) are int32
            check_int32("num_blocks * block_size", n * bs)
        _ = self.pool_of_layer  # validates layer_to_pool

    @property
    def num_pools(self) -> int:
        return len(tuple(self.window_sizes))

    @property
    def blocks_per_pool(self) -> tuple[int, ...]:
        if isinstance(self.num_blocks, int):
            return (self.num_blocks,) * self.num_pools
        return tuple(self.num_blocks)

    @property
    def max_seq_len(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    @cached_property
    def pool_of_layer(self) -> dict[int, int] | None:
        """``layer_to_pool`` as a dict (None when every layer uses pool 0)."""
        num_pools, layer_to_pool = self.num_pools, self.layer_to_pool
        if layer_to_pool is None:
            if num_pools != 1:
                raise ValueError(f"layer_to_pool is required with {num_pools} pools")
            return None
        if isinstance(layer_to_pool, Mapping):
            items = layer_to_pool.items()
        else:
            items = enumerate(layer_to_pool)
        out = {}
        for layer, pool in items:
            if not 0 <= pool < num_pools:
                raise ValueError(f"layer_to_pool[{layer}] = {pool} outside [0, {num_pools})")
            out[int(layer)] = int(pool)
        return out

    @staticmethod
    def layer_windows_to_pools(
        layer_windows: Sequence[int | None],
    ) -> tuple[list[int | None], list[int]]:
        """``(window_sizes, layer_to_pool)``: one pool per distinct window of
        ``layer_windows``, in first-seen order."""
        windows: list[int | None] = []
        for w in layer_windows:
            if w not in windows:
                windows.append(w)
        return windows, [windows.index(w) for w in layer_windows]
