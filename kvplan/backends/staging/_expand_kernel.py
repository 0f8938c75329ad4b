"""Triton kernel of ``kvplan.backends.staging.expand``: one step's per-token and per-page
fields, expanded on the device from per-row facts the host staged into the arena.

Every buffer is a field of one int32 arena (``arena`` + an element offset). Program ``b``
handles batch row ``b``:

* tokens (``TOKENS``): row b's new K/V tokens ``t`` in ``[cu[b], cu[b + 1])`` sit at positions
  ``pos = cached[b] + (t - cu[b])``; each pool's slot is
  ``table[b, pos // block_size] * block_size + pos % block_size`` (int32, or int64 stored as
  two int32 words, low word first, when ``SLOTS64``); with ``TOKEN_ROWS`` it also writes
  ``positions[t] = pos`` and ``batch_indices[t] = b``;
* pages (``PAGES``): ``indices[indptr[b] + j] = table[b, j]`` for ``j < indptr[b + 1] -
  indptr[b]`` (the ragged page table, row by row).

``table[b, c]`` of pool p is ``arena[table_off + p * table_pool_stride + b * row_stride + c]``.
The host checked that every column read here holds an allocated block (``_step_rows``), so
no bounds test is needed beyond the masks. Integer arguments are not specialized: one compiled
kernel serves every offset and length, which is what lets ``DeviceExpander`` relaunch it
through the cached launcher. The loops are ``while`` loops: the CPU interpreter (numpy >= 2.4)
cannot take a loaded value as a ``range`` bound.
"""

from __future__ import annotations

import triton.language as tl

from kvplan.ops._launch import jit

_INTS = [
    "cu_off", "cached_off", "table_off", "table_pool_stride", "row_stride", "slots_off",
    "slots_pool_stride", "pos_off", "bidx_off", "indptr_off", "indices_off",
    "indices_pool_stride", "block_size",
]  # fmt: skip


@jit(do_not_specialize=_INTS)
def expand_step_kernel(
    arena,
    cu_off,
    cached_off,
    table_off,
    table_pool_stride,
    row_stride,
    slots_off,
    slots_pool_stride,
    pos_off,
    bidx_off,
    indptr_off,
    indices_off,
    indices_pool_stride,
    block_size,
    NUM_POOLS: tl.constexpr,
    TOKENS: tl.constexpr,
    SLOTS64: tl.constexpr,
    TOKEN_ROWS: tl.constexpr,
    PAGES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    row = table_off + b * row_stride
    if TOKENS:
        t0 = tl.load(arena + cu_off + b)
        count = tl.load(arena + cu_off + b + 1) - t0
        first = tl.load(arena + cached_off + b)
        i = 0
        while i < count:
            j = i + lanes
            live = j < count
            t = t0 + j
            pos = first + j
            column = pos // block_size
            in_block = pos - column * block_size
            if TOKEN_ROWS:
                tl.store(arena + pos_off + t, pos, mask=live)
                tl.store(arena + bidx_off + t, tl.zeros_like(pos) + b, mask=live)
            for p in tl.static_range(NUM_POOLS):
                blk = tl.load(arena + row + p * table_pool_stride + column, mask=live, other=0)
                slot = blk * block_size + in_block
                out = slots_off + p * slots_pool_stride
                if SLOTS64:
                    tl.store(arena + out + 2 * t, slot, mask=live)
                    tl.store(arena + out + 2 * t + 1, tl.zeros_like(slot), mask=live)
                else:
                    tl.store(arena + out + t, slot, mask=live)
            i += BLOCK
    if PAGES:
        p0 = tl.load(arena + indptr_off + b)
        num_pages = tl.load(arena + indptr_off + b + 1) - p0
        i = 0
        while i < num_pages:
            j = i + lanes
            live = j < num_pages
            for p in tl.static_range(NUM_POOLS):
                blk = tl.load(arena + row + p * table_pool_stride + j, mask=live, other=0)
                dst = indices_off + p * indices_pool_stride + p0 + j
                tl.store(arena + dst, blk, mask=live)
            i += BLOCK
