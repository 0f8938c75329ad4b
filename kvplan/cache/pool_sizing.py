"""How many blocks each pool gets: a window pool what its running sequences need, the
full-attention pool the rest of the memory budget.

Integers only (no tensor is touched); the engine builder sizes the manager's pools and the
per-layer KV tensors from one `PoolSizes`.

What one running sequence needs
-------------------------------
A full-attention pool keeps every block: ``max_blocks_per_seq`` for a sequence of the longest
length. A window pool (window ``W``) with ``release_out_of_window`` holds real blocks of a row
only in columns ``[lo, hi)`` (``BlockAllocator``): ``lo = max(0, c - W + 1) // bs`` with
``c`` committed tokens, and ``hi = cdiv(e, bs)`` where ``e <= c + T`` is the end of the
tokens scheduled past the commit point (a prefill chunk of at most
``max_num_batched_tokens``, a decode token plus its drafts, or two decode tokens when a step is
launched ahead of the previous one's commit: ``T = max(max_num_batched_tokens, 2)``). The
positions ``[c - W + 1, c + T)`` span ``L = W - 1 + T`` tokens; starting at offset ``r`` of a
block they touch ``cdiv(r + L, bs)`` blocks, at most (``r = bs - 1``)::

    window_blocks_per_seq = min(max_blocks_per_seq, cdiv(W + T + bs - 2, bs))

Example (``W = 12``, ``T = 8``, ``bs = 4``): the bound is ``cdiv(22, 4) = 6``; it is reached
with ``c = 13`` and a chunk ``[13, 21)``: positions ``2 .. 20`` lie in blocks ``0 .. 5``.

Budget split (`plan_pool_blocks`)
---------------------------------
``num_seqs``: the running sequences every window pool is sized for. Given as
``window_pool_seqs``, or by default ``max_num_seqs`` capped by the memory budget: the most
sequences of the longest length that fit when *every* pool holds them (`max_seqs_that_fit`).

* a window pool gets ``num_seqs * window_blocks_per_seq + 1`` blocks (block 0 is padding),
  raised to ``max_num_seqs + 1`` when the budget still holds ``num_seqs`` sequences in the
  full-attention pool then (a decode batch of ``max_num_seqs`` one-block rows fits: the
  CUDA-graph capture's dummy requests);
* the full-attention pool (there is at most one) takes the rest of ``memory`` (bytes), capped
  at ``max_num_seqs * max_blocks_per_seq + 1``: short sequences leave room for more of them;
* with an explicit ``num_blocks`` instead of ``memory``: the full-attention pool gets
  ``num_blocks``; a window pool at most ``num_blocks``.

Without ``release_out_of_window`` (``windowed=False``) every pool keeps full-length pages and
gets what the full-attention pool gets. Every pool must hold one sequence alone (so a request
admitted alone always runs, and preemption by recompute always makes progress); otherwise a
`ValueError` names the budget and what one sequence needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvplan._math import cdiv


def window_blocks_per_seq(
    window: int, block_size: int, max_tokens_ahead: int, max_blocks_per_seq: int
) -> int:
    """Most blocks one sequence holds in a window pool of ``window`` (module docstring).

    ``max_tokens_ahead``: the most tokens scheduled past the committed ones (the longest
    prefill chunk; at least 2 with a decode step launched ahead)."""
    for name, value in (
        ("window", window),
        ("block_size", block_size),
        ("max_tokens_ahead", max_tokens_ahead),
        ("max_blocks_per_seq", max_blocks_per_seq),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return min(max_blocks_per_seq, cdiv(window + max_tokens_ahead + block_size - 2, block_size))


def max_seqs_that_fit(
    memory: int, blocks_per_seq: Sequence[int], block_bytes: Sequence[int]
) -> int:
    """Largest ``n`` with ``sum_p (n * blocks_per_seq[p] + 1) * block_bytes[p] <= memory``
    (``n`` sequences in every pool, plus each pool's padding block); 0 when none fits."""
    fixed = sum(block_bytes)
    per_seq = sum(n * b for n, b in zip(blocks_per_seq, block_bytes))
    return max(0, (memory - fixed) // per_seq) if memory >= fixed else 0


@dataclass(frozen=True)
class PoolSizes:
    """The resolved split: one entry per pool, in the manager's pool order.

    ``num_blocks``: blocks including the padding block 0. ``blocks_per_seq``: what one running
    sequence of the longest length may hold there. ``block_bytes``: bytes of one block id
    over every layer of the pool (K and V). ``num_window_seqs``: running sequences the window
    pools are sized for (0 when there is none).
    """

    window_sizes: tuple[int | None, ...]
    num_blocks: tuple[int, ...]
    blocks_per_seq: tuple[int, ...]
    block_bytes: tuple[int, ...]
    num_window_seqs: int

    @property
    def pool_bytes(self) -> tuple[int, ...]:
        return tuple(n * b for n, b in zip(self.num_blocks, self.block_bytes))

    @property
    def total_bytes(self) -> int:
        return sum(self.pool_bytes)

    @property
    def bytes_per_seq(self) -> int:
        """KV bytes one sequence of the longest length may hold over all pools."""
        return sum(n * b for n, b in zip(self.blocks_per_seq, self.block_bytes))


def plan_pool_blocks(
    window_sizes: Sequence[int | None],
    block_bytes: Sequence[int],
    *,
    block_size: int,
    max_blocks_per_seq: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    windowed: bool = True,
    memory: int | None = None,
    num_blocks: int | None = None,
    window_pool_seqs: int | None = None,
) -> PoolSizes:
    """Blocks per pool from ``memory`` (bytes) or ``num_blocks`` (exactly one of them; module
    docstring gives the rule).

    Args:
        window_sizes: each pool's window (None = full attention; at most one such pool).
        block_bytes: each pool's bytes per block over all its layers (K and V).
        block_size, max_blocks_per_seq: the manager's geometry.
        max_num_seqs, max_num_batched_tokens: the scheduler's limits.
        windowed: window pools release out-of-window blocks (else they keep full pages).
        memory / num_blocks: the budget.
        window_pool_seqs: running sequences each window pool holds (default above).

    Raises:
        ValueError: a bad argument, or a budget in which some pool cannot hold one sequence.
    """
    windows = tuple(window_sizes)
    if len(block_bytes) != len(windows):
        raise ValueError(f"block_bytes has {len(block_bytes)} entries for {len(windows)} pools")
    if windows.count(None) > 1:
        raise ValueError(f"window_sizes has more than one full-attention pool: {windows}")
    if (memory is None) == (num_blocks is None):
        raise ValueError("give exactly one of memory and num_blocks")
    for name, value in (
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("window_pool_seqs", 1 if window_pool_seqs is None else window_pool_seqs),
        *((f"block_bytes[{p}]", b) for p, b in enumerate(block_bytes)),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    ahead = max(max_num_batched_tokens, 2)
    need = tuple(
        max_blocks_per_seq
        if w is None or not windowed
        else window_blocks_per_seq(w, block_size, ahead, max_blocks_per_seq)
        for w in windows
    )
    lazy = [p for p, w in enumerate(windows) if w is not None and windowed]
    full = [p for p in range(len(windows)) if p not in lazy]
    seqs = window_pool_seqs
    if seqs is None:
        seqs = max_num_seqs
        if memory is not None and lazy:
            seqs = min(seqs, max_seqs_that_fit(memory, need, block_bytes))
    if lazy and seqs < 1:
        raise ValueError(_too_small(memory, need, block_bytes, windows, max_blocks_per_seq))
    blocks = [0] * len(windows)
    for p in lazy:
        blocks[p] = seqs * need[p] + 1
    floor = [max(blocks[p], max_num_seqs + 1) for p in lazy]
    rest = sum((seqs * need[p] + 1) * block_bytes[p] for p in full)
    if memory is None or sum(f * block_bytes[p] for f, p in zip(floor, lazy)) + rest <= memory:
        for f, p in zip(floor, lazy):
            blocks[p] = f
    cap = max_num_seqs * max_blocks_per_seq + 1
    if num_blocks is not None:
        for p in lazy:
            blocks[p] = min(blocks[p], num_blocks)
        for p in full:
            blocks[p] = num_blocks
    elif full:
        left = memory - sum(blocks[p] * block_bytes[p] for p in lazy)
        per_full_block = sum(block_bytes[p] for p in full)  # full pools share one count
        for p in full:
            blocks[p] = min(cap, max(0, left) // per_full_block)
    for p in range(len(windows)):
        if blocks[p] < need[p] + 1:
            raise ValueError(_too_small(memory, need, block_bytes, windows, max_blocks_per_seq,
                                        num_blocks, p, blocks[p]))  # fmt: skip
    return PoolSizes(windows, tuple(blocks), need, tuple(block_bytes), seqs if lazy else 0)


def _too_small(memory, need, block_bytes, windows, max_blocks_per_seq, num_blocks=None,
               pool=None, got=None) -> str:  # fmt: skip
    """The error message of a budget in which some pool cannot hold one sequence."""
    one = sum((n + 1) * b for n, b in zip(need, block_bytes))
    if num_blocks is not None:
        return (
            f"num_blocks={num_blocks} cannot hold one sequence of {max_blocks_per_seq} blocks in "
            f"pool {pool} (window {windows[pool]}): it needs {need[pool]} blocks + the padding "
            "block 0"
        )
    where = "" if pool is None else f" (pool {pool}, window {windows[pool]}, got {got} blocks)"
    return (
        f"kv_cache_memory={memory} bytes cannot hold one sequence of max_model_len in every "
        f"pool{where}: it needs {one} bytes (blocks per pool {list(need)} + one padding block "
        f"each, {list(block_bytes)} bytes per block); raise kv_cache_memory or lower "
        "max_model_len"
    )
