"""``PagedMetadata``: what the three paged backends' metadata share (vanilla, ragged, block
offsets all derive from it).

Each backend's ``_prepare_backend`` runs the same four moves, in order:

1. ``step = self._step_rows(decode=...)``: the batch's rows of the manager's block tables,
   checked (every row owns the blocks its ``kv_lens`` need), and where each new K/V token
   goes (the table math lives in ``block_tables``);
2. ``host = self.arena.begin(end)``: the step's private staging snapshot; the backend writes
   its fields at their arena offsets (``_put_seq_lens`` first);
3. ``self.arena.commit()``: ONE async host-to-device copy (``kvplan.backends.staging``);
4. ``self._expand_on_device(key)`` on a general step with ``expand_on_device``: one kernel
   expands the per-token slots (and the ragged page list) from the staged per-row facts.

Without a ``kv_cache_manager`` only context-only batches run (``_stage_context_only``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvplan.backends.block_tables import (
    StepRows,
    TableRows,
    block_column,
    decode_last_blocks,
    last_needed_blocks,
    logical_num_blocks,
    new_token_positions,
    pool_rows,
)
from kvplan.backends.metadata import AttentionMetadata
from kvplan.backends.staging import DeviceArena, DeviceExpander, expand_on_device_default


class PagedMetadata(AttentionMetadata):
    """``AttentionMetadata`` of a backend that reads the manager's block tables and stages
    its fields through a ``DeviceArena`` (subclasses set ``self.arena`` in ``__init__``, with
    a ``"seq_lens"`` field that becomes ``_seq_lens_gpu``). Same arguments.

    ``expand_on_device``: expand a general step's per-token slots (and the ragged page list)
    on the device from per-row facts (``staging.DeviceExpander``); default: on when
    ``device`` is a GPU. False keeps every field on the host path (numpy); tests hold both
    equal.
    """

    arena: DeviceArena

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        mgr = self.kv_cache_manager
        self.expand_on_device = expand_on_device_default(self.device)
        self._expander: DeviceExpander | None = None
        self._expand_args: dict[Any, tuple] = {}  # _bind_expansion's key -> kernel arguments
        self._block_size = 0 if mgr is None else int(mgr.block_size)
        self._max_blocks_per_seq = 0 if mgr is None else int(mgr.max_blocks_per_seq)
        self._num_pools = 1 if mgr is None else int(mgr.num_pools)
        # each pool's table as TableRows (row b at rows[b] * max_blocks_per_seq), per batch
        self._pools: list[TableRows] = []
        self._pools_rows = self._pools_tables = None
        self._row_last = np.zeros(0, np.int64)  # row_start - 1, per batch

    def _step_rows(
        self, *, decode: bool, extra_tokens: int = 0, per_token: bool = True
    ) -> StepRows:
        """The batch's block-table rows in every pool, checked, and where each new K/V token
        goes (with a ``kv_cache_manager``; call after ``_prepare_common``).

        The manager's ``batch_tables`` gives a read-only view of every pool's table
        ``[num_pools, table_rows, max_blocks_per_seq]`` and each sequence's table row:
        context requests one row (beam 0: not forked yet), generation requests
        ``beam_width`` rows (their beams' rows; cross attention repeats the request's encoder
        row). Block 0 pads each row past its allocated blocks (reserved included). Each
        pool's ``TableRows`` are rebuilt only when the manager hands out new arrays (it
        returns the same ones while the batch stays).

        Every row must own the blocks of its first ``kv_lens + extra_tokens`` tokens. On a
        ``decode`` step (one new K/V token per row at position ``cached``; needs
        ``extra_tokens == 0``) that is the block of the new token, gathered once per pool
        (the slots follow from it); otherwise the last needed block of each row is checked
        and the new tokens' positions and block indices are derived per token, unless
        ``per_token`` is False (the device expands them; ``index``, ``in_block`` and
        ``positions`` are then None).
        """
        bs, cached, n = self._block_size, self.cached_np, self._num_seqs
        bt = self.kv_cache_manager.batch_tables(
            self.request_ids, self.beam_width, self._num_contexts,
            cross=self._seq_lens_kv is not None,
        )  # fmt: skip
        pools = self._pools
        if bt.rows is not self._pools_rows or bt.tables is not self._pools_tables:
            start = bt.rows * self._max_blocks_per_seq  # int64 [n]
            pools = self._pools = [pool_rows(bt, p, start) for p in range(self._num_pools)]
            self._pools_rows, self._pools_tables = bt.rows, bt.tables
            self._row_last = start - 1  # + blocks needed = flat index of a row's last block
        if decode:
            assert not extra_tokens, "a decode step's new token is each row's last"
            column, in_block = block_column(cached, bs)
            index = pools[0].row_start[:n] + column
            max_column = (self.max_kv_len - 1) // bs
            last = [decode_last_blocks(t, column, max_column, index=index) for t in pools]
            column += 1  # blocks each row owns
            return StepRows(bt, pools, column, index, in_block, cached, last)
        lens = self.kv_lens_np + np.int32(extra_tokens) if extra_tokens else self.kv_lens_np
        needed = logical_num_blocks(lens, bs)
        what = "kv_lens (incl. num_extra_kv_tokens)" if extra_tokens else "kv_lens"
        max_needed = -(-(self.max_kv_len + extra_tokens) // bs)
        index = self._row_last[:n] + needed  # each row's last needed block, in every pool
        for t in pools:
            last_needed_blocks(t, needed, what, max_needed=max_needed, check_only=True, index=index)
        if not per_token:
            return StepRows(bt, pools, needed, None, None, None, None)
        new_lens = self._kv_np
        positions = new_token_positions(cached, self.cu_seqlens_kv_np, new_lens, self._arange)
        column, in_block = block_column(positions, bs)
        index = pools[0].row_start[:n].repeat(new_lens)
        index += column
        return StepRows(bt, pools, needed, index, in_block, positions, None)

    def _put_seq_lens(self, host: np.ndarray, at: int) -> None:
        """Write ``seq_lens`` at offset ``at`` (its arena field's) of this step's staging
        snapshot ``host``. Every step, not only when it changed: the step's copy covers the
        arena prefix from offset 0, so a field left out of a fresh snapshot would overwrite
        the device copy with whatever the snapshot memory held."""
        host[at : at + self._num_seqs] = self._seq_lens_np
        self._seq_lens_pending = False

    def _stage_context_only(self, values: dict[str, np.ndarray]) -> None:
        """``_prepare_backend`` without a KV cache manager (backends with an ``arena`` whose
        ``"seq_lens"`` field is ``_seq_lens_gpu``): context-only batches only; stages
        ``values`` and ``seq_lens`` in one copy."""
        if self._num_generations:
            raise ValueError(
                "without a kv_cache_manager only context-only batches are supported "
                f"(num_generations == 0), got {self._num_generations}"
            )
        values["seq_lens"] = self._seq_lens_np
        self._seq_lens_pending = False
        self.arena.stage(values)

    # what a backend's expansion writes besides the slots (``DeviceExpander`` flags)
    _expand_slots64 = False
    _expand_token_rows = False

    def _expands_tokens(self, decode: bool) -> bool:
        """Whether the device expands this step's per-token slots: a general step (a decode
        step's slots are O(rows) on the host) that is not cross attention (its K/V tokens
        are not the queries' rows)."""
        return self.expand_on_device and not decode and self._seq_lens_kv is None

    def _expand_on_device(self, key: Any = None) -> None:
        """Launch this step's device expansion over rows ``[0, num_seqs)``, after the
        arena's copy. The kernel arguments come from ``_bind_expansion(expander, key)``, made
        once per ``key`` (what they depend on beyond the fixed arena offsets)."""
        args = self._expand_args.get(key)
        if args is None:
            if self._expander is None:
                self._expander = DeviceExpander(
                    self.arena.buffer, num_pools=self._num_pools,
                    slots64=self._expand_slots64, token_rows=self._expand_token_rows,
                )  # fmt: skip
            args = self._expand_args[key] = self._bind_expansion(self._expander, key)
        self._expander.launch(self._num_seqs, args)

    def _bind_expansion(self, expander: DeviceExpander, key: Any) -> tuple:
        """``expander.bind(...)`` of this backend's expansion (subclasses that expand)."""
        raise NotImplementedError(f"{type(self).__name__} expands nothing on the device")
