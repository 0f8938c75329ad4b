"""``topk_columns``: the columns of each row's ``top_k`` largest scores, in column order (the
lightning indexer's top-k), optionally mapped through a per-row table (``gather``).

Contract (row ``t``; a column is *eligible* when ``col < count[t]`` and its score is not NaN)::

    n = min(top_k, number of eligible columns)
    out[t, :n]  = the n eligible columns of largest score, ties to the lower column,
                  written in ascending column order (gather[t, col] instead when given)
    out[t, n:]  = -1

``-inf`` is an ordinary score (it ranks below every finite one, so it wins only when fewer than
``top_k`` finite eligible scores exist); ``-0.0`` ranks as ``+0.0``; NaN never wins. Example::

    scores = [[0.5, 3.0, -inf, 2.0, 9.0]], count = [4], top_k = 3
    -> eligible columns 0..3, best three: 1 (3.0), 3 (2.0), 0 (0.5) -> [[0, 1, 3]]
    gather = [[40, 41, 42, 43, 44]] -> [[40, 41, 43]]

CUDA tensors run ``_topk_kernel`` (one program per row, radix select): each score becomes an
order-preserving int32 key (``bits ^ ((bits >> 31) & 0x7fffffff)``; its digits are read
unsigned, the top one with the sign bit flipped). Each pass reads the row in chunks of
``TILE`` and builds a histogram (``tl.histogram``, ``2**RADIX_BITS`` bins) of the next digit
among the eligible keys whose higher digits match the ones chosen so far (a chunk with no
such key skips the histogram), then picks the digit where the ``n``-th largest key falls;
the search stops early once the whole chosen bin is taken. One last pass writes the keys
above the threshold plus the first ``need`` keys equal to it, in column order (positions
from one ``tl.cumsum`` of packed counts plus a running offset), then ``-1`` after them. No
allocation besides the output and no host sync (``check=False``): the op can be captured in
a CUDA graph. ``compact=True`` copies the first pass's chosen bin to a ``[T, W]`` int32
workspace, in column order, so the later digit passes read only that bin (for a 32,768-wide
row of normal scores and top-512 it is a few hundred keys) instead of the row. ``row=True``
holds the row's keys in registers for the digit passes (loaded once); ``part`` splits a row
into parts searched by parallel programs, then searches their winners. CUDA calls pick
among these by the number of rows (`topk_plan`, measured settings).
CPU tensors run the torch path (``topk_columns_torch``): ``torch.topk`` of a
unique int64 key (score key, then lower column first), the chosen columns sorted ascending.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvplan._checks import check_range, check_same_device, check_tensor
from kvplan.ops._dispatch import cuda_sm_count, env_flag, triton_interpreting, use_triton
from kvplan.ops._launch import jit

__all__ = [
    "topk_columns",
    "topk_columns_torch",
    "topk_columns_triton",
    "split_part",
    "topk_plan",
    "topk_tile",
]

DEFAULT_TILE = 2048  # default scores read per chunk by one program (8 per thread at 8 warps)
MAX_TILE = 4096  # largest chunk (packed running counts need < 2**15)
RADIX_BITS = 5  # digit width of one radix-select pass (2**RADIX_BITS histogram bins)
MAX_ROW = 16384  # widest row (or part) the digit passes may hold in registers (``row``)
# The search a CUDA call takes by default (`topk_plan`), from `bench_sparse_kernels.py --only
# topk` on the H200 (2026-12-02, random scores, top-512, CUDA-graph medians):
# - few rows (up to half the SMs: one program a row leaves SMs idle; the search is
#   latency-bound): the row in registers, split into parts of SPLIT_PART columns when wider
#   than MAX_ROW: 32 x 8,192 20.2 vs 25.8 us chunked (1.28x); 32 x 32,768 33.2 vs 105.7 us
#   (3.18x; parts of 4,096 / 16,384: 36.0 / 44.7 us);
# - more rows (the programs fill the SMs): the compacting chunked search, 256 x 32,768 103.5
#   vs 164.8 us (1.59x; the in-register split 175.8 us);
# - the part (`split_part`, 2026-12-02, 18:00): the narrowest of SPLIT_PART, 2 x SPLIT_PART,
#   ... up to MAX_ROW whose parts fit one program an SM: 64 x 32,768 parts of 16,384 44.8 us,
#   of 8,192 52.7 us, the compacting search 64.7 us;
# - rows a little wider than a power of two (a captured decode step's, max_model_len // 4
#   wide: 8,232 columns, 8,192 eligible; H100, 2026-12-05, `--topk-width 8232`): the row in
#   registers pads to 16,384 (30.7 us at 32 rows); parts of NARROW_PART columns, when one
#   program a part fits the SMs, 25.1 us (parts of 2,048 26.3, of 8,192 29.6, the
#   compacting search 25.8).
SPLIT_PART = 8192
NARROW_PART = 4096
# Two forms of the in-register search (session 53), off by default (measured slower in the
# decode step, below):
# - ``ROW_TAIL`` (``KVPLAN_TOPK_ROW_TAIL=1``): a row at most 1 / ROW_TAIL_SHARE wider than a
#   power of two keeps that power in registers and reads the rest per digit pass (`row_plan`),
#   and `topk_plan` takes such a row in one stage instead of parts: a captured 32K decode
#   step's 8,232-wide rows (8,192 eligible) in one launch instead of two (parts of 4,096, then
#   their 1,536 winners);
# - ``REG_WRITE`` (``KVPLAN_TOPK_REG_WRITE=1``): the one-stage in-register search writes its
#   winners from the registers' keys in one scan, not from the row read again in chunks.
# H100, 2026-12-07: alone on random scores (`bench/run_s53c.sh`, `bench_sparse_kernels.py
# --only topk --rows 32 --candidates 8192 --topk-width 8232`, graph replay medians) both forms
# 22.4 us against 23.1 for the parts of 4,096; but inside the 32K x 32 fp8 decode step
# (`bench/run_s54d.sh`, `bench_hybrid.py --profile 2`, same machine) the top-k took 139.8 us
# in 5 launches with them against 133.7 us in 10 without.
ROW_TAIL_SHARE = 16
ROW_TAIL = env_flag("KVPLAN_TOPK_ROW_TAIL", False)
REG_WRITE = env_flag("KVPLAN_TOPK_REG_WRITE", False)


def split_part(num_rows: int, width: int, num_sms: int) -> int:
    """Columns per part of the split in-register search: ``SPLIT_PART`` doubled (up to
    ``MAX_ROW``) while ``num_rows`` rows of ``width`` columns would take more parts than
    ``num_sms``."""
    part = SPLIT_PART
    while part < MAX_ROW and num_rows * triton.cdiv(width, part) > num_sms:
        part *= 2
    return part


def topk_plan(num_rows: int, width: int, top_k: int, num_sms: int) -> tuple[bool, int, bool]:
    """Default ``(row, part, compact)`` of ``topk_columns_triton`` for ``num_rows`` rows of
    ``width`` columns on a device of ``num_sms`` SMs (0: no device, the plain chunked
    search)."""
    if not num_sms:
        return False, 0, False
    if 2 * num_rows <= num_sms:
        if width <= MAX_ROW:
            if ROW_TAIL and row_plan(width)[1]:
                return True, 0, False
            parts = triton.cdiv(width, NARROW_PART)
            narrow = width > MAX_ROW // 2 and num_rows * parts <= num_sms
            if narrow and 2 * parts * top_k < width:
                return True, NARROW_PART, False
            return True, 0, False
        part = split_part(num_rows, width, num_sms)
        if 2 * triton.cdiv(width, part) * top_k < width:
            return True, part, False
    return False, 0, True


# the in-register row's key of an ineligible column: the key of a NaN's bit pattern
# (0xFFFFFFFF), which no eligible score has
_NO_KEY = tl.constexpr(-(2**31))


@jit
def _sort_keys(x):
    """int32 keys of fp32 ``x`` that order as the floats do (``-0.0`` as ``+0.0``)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@jit
def _pick_digit(hist, need, bins):
    """The digit ``d`` whose bin holds the ``need``-th largest key, the rank inside that bin
    (``need`` minus the keys of higher digits), and whether the whole bin is taken."""
    at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys with digit >= bin
    d = tl.sum((at_least >= need).to(tl.int32), 0) - 1
    in_bin = tl.sum(tl.where(bins == d, hist, 0), 0)
    above = tl.sum(tl.where(bins == d, at_least, 0), 0) - in_bin
    return d, need - above, in_bin == need - above


@jit
def _row_keys(s_row, lo, count, width, offs):
    """Sort keys of columns ``[lo, lo + TILE)`` and which of them are eligible (NaN and the
    columns past ``count`` never count)."""
    col = lo + offs
    x = tl.load(s_row + col, mask=col < width, other=float("nan"))  # width: vector loads
    return _sort_keys(x), (x == x) & (col < count)


@jit
def _hist_chunk(
    hist, s_row, w_row, lo, count, width, m, prefix, offs, P: tl.constexpr,
    BITS: tl.constexpr, FROM_WORK: tl.constexpr,
):  # fmt: skip
    """``hist`` plus the histogram of digit ``P`` (`_hist_keys`) of the eligible keys of
    columns ``[lo, lo + TILE)``, or with ``FROM_WORK`` of workspace entries ``[lo, lo + TILE)``
    below ``m``."""
    if FROM_WORK:
        j = lo + offs
        key = tl.load(w_row + j, mask=j < m, other=0)
        ok = j < m
    else:
        key, ok = _row_keys(s_row, lo, count, width, offs)
    return _hist_keys(hist, key, ok, prefix, P, BITS)


@jit
def _hist_keys(
    hist, key, ok, prefix, P: tl.constexpr, BITS: tl.constexpr, SKIP: tl.constexpr = True
):
    """``hist`` plus the histogram of digit ``P`` (``BITS`` wide, most significant first, read
    as unsigned) of the keys where ``ok`` whose higher digits equal ``prefix`` (the key's own
    bits). With ``SKIP`` a chunk without such keys skips the histogram."""
    high: tl.constexpr = BITS * P  # bits chosen before this pass
    low: tl.constexpr = max(32 - BITS * (P + 1), 0)  # bits below this digit
    digit = (key >> low) & ((1 << (32 - high - low)) - 1)
    if P == 0:
        hist += tl.histogram(digit ^ (1 << (BITS - 1)), 1 << BITS, mask=ok)  # sign bit flipped
    else:
        match = ok & (((key >> (32 - high)) & ((1 << high) - 1)) == prefix)
        if SKIP:
            if tl.max(match.to(tl.int32), 0) != 0:
                hist += tl.histogram(digit, 1 << BITS, mask=match)
        else:
            hist += tl.histogram(digit, 1 << BITS, mask=match)
    return hist


@jit
def _compact_chunk(m, s_row, w_row, lo, count, width, prefix, offs, BITS: tl.constexpr):
    """Append to ``w_row`` (from entry ``m`` on, in column order) the keys of the eligible
    columns of ``[lo, lo + TILE)`` whose first digit is ``prefix``; returns the new count."""
    key, ok = _row_keys(s_row, lo, count, width, offs)
    sel = (ok & (((key >> (32 - BITS)) & ((1 << BITS) - 1)) == prefix)).to(tl.int32)
    pos = m + tl.cumsum(sel, 0) - 1
    tl.store(w_row + pos, key, mask=sel != 0)
    return m + tl.sum(sel, 0)


@jit
def _write_chunk(
    taken, base, s_row, g_row, o_row, v_row, lo, count, width, top_k, thr, need, offs,
    col_base, GATHER: tl.constexpr, VALUES: tl.constexpr,
):  # fmt: skip
    """Write the winners among columns ``[lo, lo + TILE)`` from output entry ``base`` on:
    keys above ``thr`` and keys equal to it while fewer than ``need`` were taken (``taken``
    so far); their column plus ``col_base`` (or their ``gather`` entry), with ``VALUES``
    their scores too (to ``v_row``). Returns the updated ``(taken, base)``."""
    col = lo + offs
    x = tl.load(s_row + col, mask=col < width, other=float("nan"))
    return _write_keys(taken, base, _sort_keys(x), (x == x) & (col < count), col, x, g_row,
                       o_row, v_row, top_k, thr, need, col_base, GATHER, VALUES)  # fmt: skip


@jit
def _write_keys(
    taken, base, key, ok, col, x, g_row, o_row, v_row, top_k, thr, need, col_base,
    GATHER: tl.constexpr, VALUES: tl.constexpr,
):  # fmt: skip
    """`_write_chunk` of the keys ``key`` of columns ``col`` (in column order; ``ok``: the
    eligible ones; ``x``: their scores, read only with ``VALUES``)."""
    gt = (ok & (key > thr)).to(tl.int32)
    eq = (ok & (key == thr)).to(tl.int32)
    packed = tl.cumsum(gt + (eq << 16), 0)  # one scan: running counts of both (TILE < 2**15)
    room = tl.maximum(need - taken, 0)  # equal keys still to take
    num_eq = tl.minimum(packed >> 16, room)  # equal keys taken up to each column
    sel = (gt != 0) | ((eq != 0) & ((packed >> 16) <= room))
    pos = base + (packed & 0xFFFF) + num_eq - 1
    if GATHER:
        val = tl.load(g_row + col, mask=sel, other=-1)
    else:
        val = col + col_base
    tl.store(o_row + pos, val, mask=sel & (pos < top_k))
    if VALUES:
        tl.store(v_row + pos, x, mask=sel & (pos < top_k))
    total = tl.sum(gt + (eq << 16), 0)
    return taken + (total >> 16), base + (total & 0xFFFF) + tl.minimum(total >> 16, room)


@jit
def _topk_kernel(
    scores_ptr, count_ptr, gather_ptr, out_ptr, work_ptr, values_ptr, width, top_k, stride_s,
    stride_c, stride_g, stride_o, stride_w, TILE: tl.constexpr, BITS: tl.constexpr,
    GATHER: tl.constexpr, COMPACT: tl.constexpr, ROW: tl.constexpr, PART: tl.constexpr,
    INTERPRET: tl.constexpr, ALL: tl.constexpr = False, TAIL: tl.constexpr = 0,
    REG_WRITE: tl.constexpr = False,
):  # fmt: skip
    """One program per row (module docstring). ``COMPACT``: after the first pass the keys of
    the chosen bin are copied, in column order, to the row's workspace ``work`` (int32,
    row stride ``stride_w``), and the later passes read only them. ``ROW`` (a power of two
    >= the row's width, 0: off): the digit passes run on the whole row's keys loaded once
    into registers (ineligible columns hold ``_NO_KEY``) instead of reading it in chunks
    per pass; the last (write) pass reads it in chunks as always. ``TAIL`` (with ``ROW``; a
    power of two, 0: off): the registers hold the row's first ``ROW`` columns and every digit
    pass reads the columns past them in chunks of ``TAIL`` (a row a little wider than a power
    of two: ``ROW`` that power, not the next). ``REG_WRITE`` (with ``ROW``, no ``PART``): the
    write pass takes the registers' columns in one scan (then the tail's in chunks) instead
    of reading the row again in chunks. ``PART`` (0: off): the
    first stage of a split search, grid ``(T, cdiv(W, PART))``: program ``(t, j)`` selects
    among columns ``[j * PART, (j + 1) * PART)`` and writes its winners' columns (or
    ``gather`` entries) to ``out[t, j * top_k:]`` and their scores to ``values`` (the same
    strides; NaN after them). The CPU interpreter cannot take a runtime tensor as a
    ``range`` bound, so there each loop runs as a ``while`` loop."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    col_base = part * PART
    w_row = work_ptr + row * stride_w
    s_row = scores_ptr + row * stride_s + col_base
    g_row = gather_ptr + row * stride_g + col_base
    o_row = out_ptr + row * stride_o + part * top_k
    v_row = values_ptr + row * stride_o + part * top_k
    if ALL:  # every column counts (the split search's second stage): no count tensor
        count = width
    else:
        count = tl.load(count_ptr + row * stride_c)
    if PART > 0:  # this part's width and eligible columns
        width = tl.minimum(width - col_base, PART)
        count = count - col_base
    count = tl.minimum(tl.maximum(count, 0), width)
    offs = tl.arange(0, TILE)
    bins = tl.arange(0, 1 << BITS)
    prefix = tl.zeros([], tl.int32)  # the key's high bits chosen so far, right-aligned
    shift = tl.zeros([], tl.int32)  # bits of the key below them
    need = tl.zeros([], tl.int32)  # keys still to take from the chosen bin
    done = count <= 0  # no eligible column (e.g. a part past the row's count): nothing to search
    m = tl.zeros([], tl.int32)  # COMPACT: keys in the workspace
    if ROW > 0:  # the whole row's keys, once
        row_key = tl.full([ROW], _NO_KEY, tl.int32)
        if not done:  # a part past the row's count loads nothing
            key0, ok0 = _row_keys(s_row, 0, count, width, tl.arange(0, ROW))
            row_key = tl.where(ok0, key0, _NO_KEY)
    for p in tl.static_range((32 + BITS - 1) // BITS):
        hist = tl.zeros([1 << BITS], tl.int32)
        if ROW > 0:
            if not done:
                hist = _hist_keys(hist, row_key, row_key != _NO_KEY, prefix, p, BITS, False)
                if TAIL > 0:  # the columns past the registers' ROW
                    tail = tl.arange(0, TAIL)
                    if INTERPRET:
                        lo = ROW
                        while lo < count:
                            hist = _hist_chunk(hist, s_row, w_row, lo, count, width, m, prefix,
                                               tail, p, BITS, False)  # fmt: skip
                            lo += TAIL
                    else:
                        for lo in range(ROW, count, TAIL):
                            hist = _hist_chunk(hist, s_row, w_row, lo, count, width, m, prefix,
                                               tail, p, BITS, False)  # fmt: skip
        else:
            if COMPACT and p > 0:  # the workspace's keys, else the row's
                hi = m * (1 - done.to(tl.int32))
            else:
                hi = count * (1 - done.to(tl.int32))  # no reads once the search is done
            if INTERPRET:
                lo = 0
                while lo < hi:
                    hist = _hist_chunk(hist, s_row, w_row, lo, count, width, m, prefix, offs,
                                       p, BITS, COMPACT and p > 0)  # fmt: skip
                    lo += TILE
            else:
                for lo in range(0, hi, TILE):
                    hist = _hist_chunk(hist, s_row, w_row, lo, count, width, m, prefix, offs,
                                       p, BITS, COMPACT and p > 0)  # fmt: skip
        if p == 0:  # the number of eligible keys; n = min(top_k, that)
            need = tl.minimum(tl.sum(hist, 0), top_k)
            done = need == 0
        d, rank, whole = _pick_digit(hist, need, bins)
        if p == 0:  # from the unsigned digit back to the key's own top bits
            prefix = tl.where(done, prefix, d ^ (1 << (BITS - 1)))
        else:  # the last digit may be narrower: 32 bits in all
            prefix = tl.where(done, prefix, (prefix << min(BITS, 32 - BITS * p)) | d)
        shift = tl.where(done, shift, max(32 - BITS * (p + 1), 0))
        need = tl.where(done, need, tl.where(whole, width + 1, rank))  # whole bin: all equal
        done = done | whole
        if COMPACT and p == 0:  # the chosen bin's keys, for the later passes
            hi = count * (1 - done.to(tl.int32))
            if INTERPRET:
                lo = 0
                while lo < hi:
                    m = _compact_chunk(m, s_row, w_row, lo, count, width, prefix, offs, BITS)
                    lo += TILE
            else:
                for lo in range(0, hi, TILE):
                    m = _compact_chunk(m, s_row, w_row, lo, count, width, prefix, offs, BITS)
    thr = prefix << shift  # the lowest key of the chosen bin (the shift wraps into the sign)
    taken = tl.zeros([], tl.int32)  # keys equal to thr taken so far
    base = tl.zeros([], tl.int32)  # output entries written so far
    lo_write = 0
    if ROW > 0 and PART == 0 and REG_WRITE:  # the registers' columns in one scan, then the tail
        taken, base = _write_keys(taken, base, row_key, row_key != _NO_KEY, tl.arange(0, ROW),
                                  row_key, g_row, o_row, v_row, top_k, thr, need, col_base,
                                  GATHER, False)  # fmt: skip
        lo_write = ROW
    if INTERPRET:
        lo = lo_write
        while lo < count:
            taken, base = _write_chunk(
                taken, base, s_row, g_row, o_row, v_row, lo, count, width, top_k, thr, need,
                offs, col_base, GATHER, PART > 0,
            )  # fmt: skip
            lo += TILE
    else:
        for lo in range(lo_write, count, TILE):
            taken, base = _write_chunk(
                taken, base, s_row, g_row, o_row, v_row, lo, count, width, top_k, thr, need,
                offs, col_base, GATHER, PART > 0,
            )  # fmt: skip
    none = tl.full([TILE], -1, tl.int32)
    nan = tl.full([TILE], float("nan"), tl.float32)
    if INTERPRET:
        lo = base
        while lo < top_k:
            tl.store(o_row + lo + offs, none, mask=lo + offs < top_k)
            if PART > 0:
                tl.store(v_row + lo + offs, nan, mask=lo + offs < top_k)
            lo += TILE
    else:
        for lo in range(base, top_k, TILE):
            tl.store(o_row + lo + offs, none, mask=lo + offs < top_k)
            if PART > 0:
                tl.store(v_row + lo + offs, nan, mask=lo + offs < top_k)


def topk_tile(width: int) -> int:
    """Default scores per chunk of ``_topk_kernel`` for rows of ``width`` columns."""
    return max(16, min(DEFAULT_TILE, triton.next_power_of_2(max(width, 1))))


def _row_size(width: int) -> int:
    """``ROW`` of an in-register row of ``width`` columns: the power of two holding them."""
    return max(16, triton.next_power_of_2(width))


def row_plan(width: int, tail: bool | None = None) -> tuple[int, int]:
    """``(ROW, TAIL)`` of an in-register row of ``width`` columns: the power of two holding
    them, or, with ``tail`` (None: ``ROW_TAIL``) and at most 1 / ``ROW_TAIL_SHARE`` of them
    past the power of two below, that power and the rest read per digit pass in chunks of
    ``TAIL`` (the next power of two of the rest, at most ``DEFAULT_TILE``): a 8,232-wide row
    (a captured decode step's ``max_model_len // 4`` for a 32K context) keeps 8,192 keys in
    registers, not 16,384."""
    row = _row_size(width)
    low = row // 2
    rest = width - low
    if (ROW_TAIL if tail is None else tail) and low >= 16 and 0 < rest * ROW_TAIL_SHARE <= width:
        return low, min(DEFAULT_TILE, max(16, triton.next_power_of_2(rest)))
    return row, 0


def _row_warps(row: int) -> int:
    """Warps of an in-register row of ``row`` keys: 16 keys a thread up to 8,192 keys, 16
    warps above (128 registers a thread there; no spills on sm_90 at 5-bit digits)."""
    return max(4, min(16, row // 512))


def _check_args(scores, count, top_k, gather, check) -> None:
    check_tensor("scores", scores, dtype=torch.float32, ndim=2)
    num_rows, width = scores.shape
    if width > 1 and scores.stride(1) != 1:
        raise ValueError(f"scores must have unit column stride, got strides {scores.stride()}")
    check_tensor("count", count, dtype=torch.int32, shape=(num_rows,))
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
    if width >= 2**31 - 1 or top_k >= 2**31 - 1:
        raise ValueError(f"scores width {width} / top_k {top_k} must stay below 2**31 - 1")
    if gather is not None:
        check_tensor("gather", gather, dtype=torch.int32, shape=(num_rows, width))
        if width > 1 and gather.stride(1) != 1:
            raise ValueError(f"gather must have unit column stride, got strides {gather.stride()}")
        check_same_device(scores=scores, count=count, gather=gather)
    else:
        check_same_device(scores=scores, count=count)
    if check:
        check_range("count", count, 0, width + 1)


def topk_columns_torch(
    scores: torch.Tensor, count: torch.Tensor, top_k: int, *, gather: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch path of :func:`topk_columns` (arguments checked there)."""
    num_rows, width = scores.shape
    out = torch.full((num_rows, top_k), -1, dtype=torch.int32, device=scores.device)
    if num_rows == 0 or width == 0:
        return out
    x = torch.where(scores == 0, 0.0, scores)  # -0.0 ranks as +0.0
    bits = x.view(torch.int32).long()
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # [T, W] order-preserving, in [-2**31, 2**31)
    col = torch.arange(width, device=scores.device)
    low = 2**31 - 1
    unique = ((key + 2**31) << 31) | (low - col)  # ties: the lower column ranks higher
    eligible = (col[None, :] < count.long()[:, None]) & ~torch.isnan(scores)
    unique = unique.masked_fill(~eligible, -1)
    k = min(top_k, width)
    best = unique.topk(k, dim=1).values  # [T, k]
    chosen = torch.where(best >= 0, low - (best & low), width).sort(dim=1).values
    found = chosen < width
    if gather is not None:
        chosen = gather.gather(1, chosen.clamp(max=width - 1))
    out[:, :k] = torch.where(found, chosen, -1).to(torch.int32)
    return out


def topk_columns_triton(
    scores: torch.Tensor, count: torch.Tensor | None, top_k: int, *, gather: torch.Tensor | None = None,
    tile: int | None = None, bits: int = RADIX_BITS, num_warps: int | None = None,
    compact: bool | None = None, row: bool | None = None, part: int | None = None,
    reg_write: bool | None = None, tail: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton path of :func:`topk_columns` (arguments checked there; ``count`` None: every
    column counts, no count tensor read): ``_topk_kernel``, one
    program per row, ``tile`` scores per chunk (a power of two, default :func:`topk_tile`),
    ``bits``-wide digits (2 to 8), ``num_warps`` (of the first stage). The same winners
    with every setting:

    - ``compact``: the passes after the first read only the first pass's chosen bin, copied
      to a workspace;
    - ``row``: the digit passes run on the row's keys held in registers, loaded once (rows
      up to ``MAX_ROW`` columns, or parts of them);
    - ``part`` (a power of two >= 16, or 0): a split search, first the top-k of every
      ``part`` columns of a row (programs in parallel), then the top-k of those winners
      (their scores and columns kept by the first stage);
    - ``reg_write`` (the one-stage ``row`` search; None: ``REG_WRITE``): the winners written
      from the registers' keys in one scan, not from the row read again in chunks;
    - ``tail`` (``row`` searches; None: ``ROW_TAIL``): a row a little wider than a power of
      two keeps that power in registers and reads the rest per pass (`row_plan`).

    With all three None, :func:`topk_plan` picks them (CUDA tensors; elsewhere the plain
    chunked search); any one given, the others left None are off."""
    num_rows, width = scores.shape
    tile = tile or topk_tile(width)
    if tile & (tile - 1) or not 16 <= tile <= MAX_TILE:
        raise ValueError(f"tile must be a power of two in [16, {MAX_TILE}], got {tile}")
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be in [2, 8], got {bits}")
    if row is None and part is None and compact is None:
        sms = cuda_sm_count(scores.device) if scores.is_cuda and not triton_interpreting() else 0
        row, part, compact = topk_plan(num_rows, width, top_k, sms)
    row, part, compact = bool(row), part or 0, bool(compact)
    if part and (part & (part - 1) or part < 16):
        raise ValueError(f"part must be 0 or a power of two >= 16, got {part}")
    if row and row_plan(min(part or width, width), tail)[0] > MAX_ROW:
        raise ValueError(
            f"row holds at most {MAX_ROW} columns, got {part or width} (width {width}, part {part})"
        )
    if compact and (row or part):
        raise ValueError("compact is a form of the one-stage, chunked search: no row or part")
    g = gather if gather is not None else scores
    if part:  # first stage: every part's winners and their scores, in column order
        parts = max(1, triton.cdiv(width, part))
        vals = torch.empty((num_rows, parts * top_k), dtype=torch.int32, device=scores.device)
        cand = torch.empty((num_rows, parts * top_k), dtype=torch.float32, device=scores.device)
        if num_rows:
            _launch(scores, count, g, vals, vals, cand, width, top_k, (num_rows, parts),
                    tile=min(tile, part), bits=bits, gather=gather is not None, compact=False,
                    row=row_plan(min(part, width), tail) if row else (0, 0),
                    part=part, num_warps=num_warps)  # fmt: skip
        # second stage: every candidate counts (the NaNs of the first stage's short parts
        # never win; ``count=None``: no count tensor to fill), the first stage's values
        # mapped through
        row2 = row and parts * top_k <= MAX_ROW
        return topk_columns_triton(
            cand, None, top_k, gather=vals, bits=bits, row=row2, part=0, compact=False, tail=tail
        )
    out = torch.empty((num_rows, top_k), dtype=torch.int32, device=scores.device)
    if num_rows == 0:
        return out
    # the compacting search's workspace: room for a whole row's keys (the chosen bin can hold
    # them all, e.g. equal scores)
    work = (
        torch.empty((num_rows, width), dtype=torch.int32, device=scores.device) if compact else out
    )
    _launch(scores, count, g, out, work, scores, width, top_k, (num_rows, 1), tile=tile,
            bits=bits, gather=gather is not None, compact=compact,
            row=row_plan(width, tail) if row else (0, 0), part=0,
            num_warps=num_warps,
            reg_write=REG_WRITE if reg_write is None else reg_write)  # fmt: skip
    return out


def _launch(scores, count, g, out, work, values, width, top_k, grid, *, tile, bits, gather,
            compact, row, part, num_warps, reg_write=False) -> None:  # fmt: skip
    every = count is None  # every column counts: the kernel reads no count
    count = scores if every else count
    row, tail = row
    _topk_kernel[grid](
        scores, count, g, out, work, values, width, top_k, scores.stride(0),
        0 if every else count.stride(0), g.stride(0), out.stride(0), work.stride(0), TILE=tile,
        BITS=bits, GATHER=gather, COMPACT=compact, ROW=row, PART=part,
        INTERPRET=triton_interpreting(), ALL=every, TAIL=tail, REG_WRITE=reg_write,
        num_warps=num_warps or (_row_warps(row) if row else max(1, min(8, tile // 256))),
    )  # fmt: skip


def topk_columns(
    scores: torch.Tensor, count: torch.Tensor, top_k: int, *, gather: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """The columns of each row's ``min(top_k, eligible)`` largest scores, ascending.

    Args:
        scores: fp32 ``[T, W]`` (any row stride, unit column stride).
        count: int32 ``[T]``: columns ``>= count[t]`` never win (``0 <= count[t] <= W``).
        top_k: entries per output row (``>= 1``; may exceed ``W``).
        gather: optional int32 ``[T, W]`` (unit column stride): return ``gather[t, col]``
            instead of ``col`` (e.g. the pool slot of each candidate column).
        check: validate ``count``'s range (one device sync on CUDA).

    Returns:
        int32 ``[T, top_k]`` on ``scores``' device (contract and example in the module
        docstring): the chosen columns (or their ``gather`` values) in ascending column
        order, ``-1`` after them.
    """
    _check_args(scores, count, top_k, gather, check)
    fn = topk_columns_triton if use_triton(scores) else topk_columns_torch
    return fn(scores, count, top_k, gather=gather)
