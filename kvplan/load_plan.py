"""Block load plans: the CPU-side description of what ``load_paged_kv_cache`` copies.

A plan is an int32 tensor ``[num_segments, 4]``; each row ``[src_block, src_begin, src_end,
dst_offset]`` says "copy tokens ``[src_begin, src_end)`` of cache block ``src_block`` to output
rows ``[dst_offset, dst_offset + src_end - src_begin)``". ``src_block == -1`` writes zeros
instead of reading the cache. Segments never cross a block boundary, so a kernel can give each
segment one program and copy a contiguous run of tokens.

The builder appends segments back to back: each new segment starts where the previous one ended
in the output, so ``total_k`` is the sum of segment lengths. Example with
``source_block_size = 4`` and ``block_table = [7, 2, 9]``::

    builder.append_zero_fill(2)              # [-1, 0, 2, 0]
    builder.append_paged_range(table, 3, 9)  # [ 7, 3, 4, 2] [2, 0, 4, 3] [9, 0, 1, 7]
    segments, total_k = builder.build()      # total_k == 8

    logical tokens   0 1 2 3 | 4 5 6 7 | 8 9 10 11
    block_table      7       | 2       | 9
    range [3, 9)           ^ | ^ ^ ^ ^ | ^

A ring (one state slot of ``source_block_size`` tokens, used by the sliding-window cache) maps
logical token ``t`` to offset ``t % source_block_size`` of the slot, so a window of at most
``source_block_size`` tokens becomes at most two segments (before and after the wrap point).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvplan._checks import INT32_MAX, check_int32, check_tensor
from kvplan._math import exclusive_cumsum

__all__ = ["BlockLoadPlanBuilder", "validate_load_plan"]


class BlockLoadPlanBuilder:
    """Accumulates load segments for one output buffer.

    Args:
        source_block_size: tokens per source block (for a compressed cache this is
            ``block_size // ratio``, the compressed tokens one block holds; for the SWA ring it is
            the ring size ``swa_block_size``).

    Segments of length zero are never emitted; every ``append_*`` call either appends all of
    its segments or raises ``ValueError`` and leaves the builder unchanged.
    """

    def __init__(self, source_block_size: int) -> None:
        if not isinstance(source_block_size, int) or isinstance(source_block_size, bool):
            raise TypeError(
                f"source_block_size must be an int, got {type(source_block_size).__name__}"
            )
        if source_block_size <= 0:
            raise ValueError(f"source_block_size must be positive, got {source_block_size}")
        self.source_block_size = source_block_size
        self._chunks: list[np.ndarray] = []  # each: int64 [k, 4]
        self._num_segments = 0
        self._total_k = 0

    @property
    def total_k(self) -> int:
        """Output rows described so far (sum of segment lengths)."""
        return self._total_k

    @property
    def num_segments(self) -> int:
        return self._num_segments

    def _push(self, src_block: np.ndarray, begin: np.ndarray, end: np.ndarray) -> None:
        """Append segments (all int64 [k]) with destinations following the current total."""
        lengths = end - begin
        keep = lengths > 0
        src_block, begin, end, lengths = src_block[keep], begin[keep], end[keep], lengths[keep]
        if len(lengths) == 0:
            return
        offsets = exclusive_cumsum(lengths)
        starts = offsets[:-1] + self._total_k
        new_total = self._total_k + int(offsets[-1])
        check_int32("total_k", new_total)
        self._chunks.append(np.stack([src_block, begin, end, starts], axis=1))
        self._num_segments += len(lengths)
        self._total_k = new_total

    def append_segment(self, src_block: int, src_begin: int, src_end: int) -> None:
        """Copy tokens ``[src_begin, src_end)`` of block ``src_block`` (``-1``: zeros).

        Requires ``src_block >= -1`` and ``0 <= src_begin <= src_end <= source_block_size``;
        an empty range appends nothing.
        """
        _check_int("src_block", src_block)
        _check_int("src_begin", src_begin)
        _check_int("src_end", src_end)
        if src_block < -1:
            raise ValueError(f"src_block must be >= -1, got {src_block}")
        check_int32("src_block", src_block)
        if not 0 <= src_begin <= src_end <= self.source_block_size:
            raise ValueError(
                f"segment [src_begin={src_begin}, src_end={src_end}) must satisfy "
                f"0 <= src_begin <= src_end <= source_block_size={self.source_block_size}"
            )
        self._push(np.array([src_block]), np.array([src_begin]), np.array([src_end]))

    def append_zero_fill(self, num_tokens: int) -> None:
        """Append ``num_tokens`` zero rows, as segments of at most ``source_block_size`` rows."""
        _check_int("num_tokens", num_tokens)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        check_int32("total_k", self._total_k + num_tokens)  # before building the segments
        b = self.source_block_size
        num_full, rest = divmod(num_tokens, b)
        ends = np.full(num_full + (1 if rest else 0), b, dtype=np.int64)
        if rest:
            ends[-1] = rest
        self._push(np.full_like(ends, -1), np.zeros_like(ends), ends)

    def append_paged_range(
        self, block_table: Sequence[int] | np.ndarray | torch.Tensor, begin: int, end: int
    ) -> None:
        """Append logical tokens ``[begin, end)`` of a paged sequence, one segment per block.

        Logical token ``t`` lives at offset ``t % source_block_size`` of physical block
        ``block_table[t // source_block_size]``.

        Args:
            block_table: 1-D ints (list, numpy array or CPU tensor) with at least
                ``ceil(end / source_block_size)`` entries, each a physical block id ``>= 0``.
            begin, end: ``0 <= begin <= end``.
        """
        _check_int("begin", begin)
        _check_int("end", end)
        if not 0 <= begin <= end:
            raise ValueError(f"range [begin={begin}, end={end}) must satisfy 0 <= begin <= end")
        if begin == end:
            return
        table = _as_int64_array("block_table", block_table)
        b = self.source_block_size
        first, last = begin // b, (end - 1) // b  # logical blocks touched, inclusive
        if last >= len(table):
            raise ValueError(
                f"range end={end} needs {last + 1} blocks of {b} tokens but block_table has "
                f"{len(table)} entries"
            )
        blocks = table[first : last + 1]
        if blocks.min() < 0 or blocks.max() > INT32_MAX:
            bad = int(blocks.min()) if blocks.min() < 0 else int(blocks.max())
            raise ValueError(f"block_table holds block id {bad}, outside [0, 2**31)")
        logical = np.arange(first, last + 1, dtype=np.int64)
        seg_begin = np.maximum(begin, logical * b) - logical * b
        seg_end = np.minimum(end, (logical + 1) * b) - logical * b
        self._push(blocks.copy(), seg_begin, seg_end)

    def append_ring_range(self, state_id: int, begin: int, end: int) -> None:
        """Append logical tokens ``[begin, end)`` of a ring held in block ``state_id``.

        The ring has ``source_block_size`` slots and token ``t`` sits in slot
        ``t % source_block_size``, so the window must be at most ``source_block_size`` tokens
        long; it becomes one segment, or two when it wraps. Example with a ring of 8::

            append_ring_range(3, 6, 11)  ->  [3, 6, 8, d] [3, 0, 3, d + 2]
        """
        _check_int("state_id", state_id)
        _check_int("begin", begin)
        _check_int("end", end)
        if state_id < 0:
            raise ValueError(f"state_id must be >= 0, got {state_id}")
        check_int32("state_id", state_id)
        if not 0 <= begin <= end:
            raise ValueError(f"range [begin={begin}, end={end}) must satisfy 0 <= begin <= end")
        b = self.source_block_size
        if end - begin > b:
            raise ValueError(
                f"ring range [begin={begin}, end={end}) is {end - begin} tokens, longer than "
                f"the ring (source_block_size={b})"
            )
        if begin == end:
            return
        start = begin % b
        first_len = min(end - begin, b - start)
        rest = end - begin - first_len
        self._push(
            np.array([state_id, state_id], dtype=np.int64),
            np.array([start, 0], dtype=np.int64),
            np.array([start + first_len, rest], dtype=np.int64),
        )

    def build(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, int]:
        """Return ``(segments, total_k)``.

        ``segments`` is int32 ``[num_segments, 4]`` on ``device`` (CPU by default), rows
        ``[src_block, src_begin, src_end, dst_offset]``; ``total_k`` is a Python int. The builder
        can keep appending afterwards; a later ``build`` returns the longer plan.
        """
        if self._chunks:
            rows = np.concatenate(self._chunks, axis=0)
            self._chunks = [rows]
        else:
            rows = np.zeros((0, 4), dtype=np.int64)
        segments = torch.from_numpy(rows.astype(np.int32))
        if device is not None:
            segments = segments.to(device)
        return segments, self._total_k


def validate_load_plan(
    segments: torch.Tensor,
    total_k: int,
    num_blocks: int,
    block_size: int,
    *,
    require_full_cover: bool = False,
) -> None:
    """Check a load plan against a cache of ``num_blocks`` blocks of ``block_size`` tokens.

    Raises ``TypeError``/``ValueError`` naming the first bad segment (its index and row) when:
    ``segments`` is not int32 ``[n, 4]``; ``src_block`` is outside ``[-1, num_blocks)``; the
    source range is not ``0 <= src_begin <= src_end <= block_size``; the destination range
    ``[dst_offset, dst_offset + len)`` leaves ``[0, total_k)``; two non-empty destination ranges
    overlap. With ``require_full_cover`` every output row must also be written exactly once.
    Rows not covered by any segment are otherwise allowed (``load_paged_kv_cache`` leaves them
    untouched in ``out``). Reads ``segments`` on the host (a device sync for CUDA tensors).
    """
    check_tensor("load_segments", segments, dtype=torch.int32, shape=(None, 4))
    for name, value in (
        ("total_k", total_k),
        ("num_blocks", num_blocks),
        ("block_size", block_size),
    ):
        _check_int(name, value)
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    check_int32("total_k", total_k)
    rows = segments.detach().cpu().numpy().astype(np.int64)  # [n, 4]
    if len(rows) == 0:
        if require_full_cover and total_k > 0:
            raise ValueError(f"load_segments is empty but total_k={total_k} rows must be covered")
        return
    src, begin, end, dst = rows.T
    length = end - begin

    def fail(mask: np.ndarray, what: str) -> None:
        i = int(np.flatnonzero(mask)[0])
        raise ValueError(f"load_segments[{i}] = {rows[i].tolist()}: {what}")

    bad = (src < -1) | (src >= num_blocks)
    if bad.any():
        fail(bad, f"src_block outside [-1, num_blocks={num_blocks})")
    bad = (begin < 0) | (end < begin) | (end > block_size)
    if bad.any():
        fail(bad, f"needs 0 <= src_begin <= src_end <= block_size={block_size}")
    bad = (dst < 0) | (dst + length > total_k)
    if bad.any():
        fail(bad, f"destination rows leave [0, total_k={total_k})")
    nonempty = np.flatnonzero(length > 0)
    order = nonempty[np.argsort(dst[nonempty], kind="stable")]
    if len(order) > 1:
        prev, nxt = order[:-1], order[1:]
        overlap = dst[nxt] < dst[prev] + length[prev]
        if overlap.any():
            k = int(np.flatnonzero(overlap)[0])
            i, j = int(prev[k]), int(nxt[k])
            raise ValueError(
                f"load_segments[{j}] = {rows[j].tolist()}: destination rows overlap "
                f"load_segments[{i}] = {rows[i].tolist()}"
            )
    if require_full_cover:
        covered = int(length.sum())
        if covered != total_k:
            raise ValueError(
                f"load_segments cover {covered} rows but total_k={total_k} (require_full_cover)"
            )


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _as_int64_array(name: str, values: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got dtype {values.dtype}")
        if values.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {values.device}")
        arr = values.numpy()
    else:
        arr = np.asarray(values)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return arr.astype(np.int64, copy=False)
