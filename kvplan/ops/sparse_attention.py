"""``sparse_attention``: attention with per-head sinks over index tables into key sources.

Query row ``t`` sees, for each source ``i``, the rows named by ``index_i[t, :]`` (``-1`` = not
visible); keys and values are the same rows (one shared K=V head). A source is a cache read
in place -- no gathered copy -- in one of three shapes::

    plain rows      fp32 / bf16 [N, D]                      slot s = row s
    plain paged     fp32 / bf16 [num_blocks, block_size, 1, D]
    quantized paged uint8 [num_blocks, block_size, 1, bytes_per_token] + layout
                    (token-interleaved record: e4m3 or e2m1 values, UE8M0 or e4m3 scales,
                    e.g. V41_FORMAT / V41_FP4_FORMAT; dequantized in registers)
    paged slot s = block s // block_size, row s % block_size

Example: decode of a DeepSeek-V4 CSA layer reads the SWA ring through ``kv_swa_index`` (ring
slots) and the compressed pool through the top-k slots::

    out = sparse_attention(q, [KeySource(ring_cache, swa_slots, V41_FORMAT),
                               KeySource(pool_cache, topk_slots, V41_FORMAT)], sinks, D ** -0.5)

Math (fp32; ``v_k`` the dequantized row of column ``k`` over both sources)::

    l_k = scale * q[t, h] . v_k,   m = max(max_k l_k, sinks[h])
    out[t, h] = sum_k exp(l_k - m) v_k / (sum_k exp(l_k - m) + exp(sinks[h] - m))

A row that sees nothing gets zeros. A dequantized row equals what ``load_paged_kv_cache``
returns for it (``bf16(value * scale)``; exact for these layouts). CUDA tensors run the Triton
kernel of ``kvplan.ops._sparse_attention_kernels`` (bf16 queries multiply in bf16, fp32 queries
in fp32); CPU tensors run ``sparse_attention_torch``; ``sparse_attention_ref`` is a per-row
loop for tests.

``index_scores`` is the lightning indexer's scoring over the same addressing (index keys in
the split index layouts read in place, ``kvplan.ops.index_scores``) and ``topk_columns`` its
top-k (``kvplan.ops.topk``), both re-exported here; the sources in ``kvplan.ops.sparse_sources``.

Decode (few rows): when ``T * cdiv(H, tile_h)`` programs would leave SMs idle, the columns
of a row are split across programs and merged by a second kernel
(``kvplan.ops._sparse_split_kernels``, :func:`split_count`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

from kvplan._checks import check_range, check_same_device, check_tensor
from kvplan.ops import _sparse_attention_kernels as _k
from kvplan.ops import _sparse_split_kernels as _ks
from kvplan.ops._dispatch import cuda_sm_count, env_flag, triton_interpreting, use_triton
from kvplan.ops._triton_util import MERGE_COUNTERS, merge_counters
from kvplan.ops.index_scores import index_scores, index_scores_triton, topk_columns
from kvplan.ops.sparse_sources import (
    MAX_HEAD_DIM,
    KeySource,
    SourceAddress,
    flat_scales,
    gather_rows,
    source_address,
)

__all__ = [
    "MAX_HEAD_DIM",
    "KeySource",
    "gather_rows",
    "index_scores",
    "index_scores_triton",
    "sparse_attention",
    "sparse_attention_ref",
    "sparse_attention_torch",
    "sparse_attention_triton",
    "default_tiling",
    "split_count",
    "topk_columns",
]

_ROWS_PER_CHUNK = 128  # torch path: bounds the [rows, H, K] logits held at once


def check_query(q, sinks, sources, source_type: type) -> int:
    """The checks every sparse attention entry makes of ``q`` ``[T, H, D]`` (fp32 / bf16 /
    fp16, unit stride on D, ``D <= MAX_HEAD_DIM``), ``sinks`` ``[H]`` and the number and type
    of its sources; returns ``D``."""
    check_tensor("q", q, dtype=(torch.float32, torch.bfloat16, torch.float16), ndim=3)
    _, num_heads, head_dim = q.shape
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if head_dim > 1 and q.stride(2) != 1:
        raise ValueError(f"q must have unit stride on D, got strides {q.stride()}")
    check_tensor("sinks", sinks, shape=(num_heads,))
    name = source_type.__name__
    if not 1 <= len(sources) <= 2:
        raise ValueError(f"sources must hold 1 or 2 {name}, got {len(sources)}")
    for i, src in enumerate(sources):
        if not isinstance(src, source_type):
            raise TypeError(f"sources[{i}] must be a {name}, got {type(src).__name__}")
    return head_dim


def check_source_table(name: str, t, num_rows: int) -> torch.Tensor:
    """A source's int32 ``[T, K]`` table (index or ranges): ``num_rows`` rows, unit column
    stride."""
    t = check_tensor(name, t, dtype=torch.int32, ndim=2)
    if t.shape[0] != num_rows:
        raise ValueError(f"{name} has {t.shape[0]} rows, q has {num_rows}")
    if t.shape[1] > 0 and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit column stride")
    return t


def _check(q, sources, sinks, check_values: bool) -> list[SourceAddress]:
    head_dim = check_query(q, sinks, sources, KeySource)
    num_rows = q.shape[0]
    addrs = []
    for i, src in enumerate(sources):
        idx = check_source_table(f"sources[{i}].index", src.index, num_rows)
        check_same_device(q=q, sinks=sinks, cache=src.cache, index=idx)
        addr = source_address(i, src, head_dim)
        if check_values:
            check_range(f"sources[{i}].index", idx, -1, addr.num_slots)
        addrs.append(addr)
    return addrs


def sparse_attention(
    q: torch.Tensor,
    sources: Sequence[KeySource],
    sinks: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    out_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    check: bool = True,
    counters: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every query row over its indexed rows of one or two sources, with sinks.

    Args:
        q: ``[T, H, D]`` fp32 / bf16 / fp16 (unit stride on D), ``D <= 512``.
        sources: one or two :class:`KeySource` (module docstring), index rows ``[T, K_i]``.
        sinks: ``[H]`` per-head logits (finite, or ``-inf`` for no sink).
        scale: logit scale.
        out: optional ``[T, H, D]`` destination of q's dtype (written in place).
        out_rope: ``(cos, sin)`` ``[T, RD / 2]`` tables: the output rows come back turned by
            the inverse rotation on their trailing ``RD`` channels, exactly
            ``kvplan.ops.rope.norm_rope(out, cos, sin, inverse=True)`` (DeepSeek-V4 undoes
            the values' rotation at the query's position); the Triton kernels do it in their
            epilogue.
        check: validate index values (one device sync on CUDA); False on a hot path, where
            an out-of-range slot reads as not visible.
        counters: the caller's zeroed int32 merge counters on q's device (``[N]``;
            ``kvplan.ops._triton_util.new_merge_counters``), which the split kernels leave
            zeroed; a call that splits its columns needs ``N >= T * cdiv(H, 16)`` (calls
            split when those programs are fewer than the SMs). None: the device's buffer
            for the current stream. Calls that may run at once (two streams, two engines)
            need buffers of their own. Read by the Triton kernels only.
        rows: optional int32 ``[R]`` rows to compute (distinct, each in ``[0, T)``); the
            other rows of ``out`` are left as they are. A call with rows never splits its
            columns.

    Returns ``out`` (or a new tensor) ``[T, H, D]`` in q's dtype.
    """
    if use_triton(q):
        return sparse_attention_triton(
            q,
            sources,
            sinks,
            scale,
            out=out,
            out_rope=out_rope,
            check=check,
            counters=counters,
            rows=rows,
        )
    _check_counters(counters, q)  # checked, not read, on this path
    return sparse_attention_torch(q, sources, sinks, scale, out=out, out_rope=out_rope,
                                  check=check, rows=rows)  # fmt: skip


def _check_rows(rows: torch.Tensor | None, q: torch.Tensor, check: bool) -> None:
    """``rows`` (when given): int32 ``[R]`` on q's device, values in ``[0, T)`` (checked with
    ``check``: one device sync)."""
    if rows is None:
        return
    check_tensor("rows", rows, dtype=torch.int32, ndim=1, device=q.device, contiguous=True)
    if check:
        check_range("rows", rows, 0, q.shape[0])


def _check_counters(counters: torch.Tensor | None, q: torch.Tensor) -> None:
    """``counters`` (when given): a contiguous 1-D int32 tensor on q's device."""
    if counters is not None:
        check_tensor("counters", counters, dtype=torch.int32, ndim=1, device=q.device,
                     contiguous=True)  # fmt: skip


def _check_out_rope(q: torch.Tensor, out_rope) -> int:
    """``HALF_RD`` of ``out_rope`` (0 without), after checking its tables against ``q``."""
    if out_rope is None:
        return 0
    if not (isinstance(out_rope, tuple) and len(out_rope) == 2):
        raise TypeError("out_rope must be a (cos, sin) tuple")
    cos, sin = out_rope
    t, _, d = q.shape
    check_tensor("out_rope cos", cos, dtype=_FLOATS, ndim=2, device=q.device)
    half = cos.shape[1]
    if cos.shape[0] != t or not 0 < 2 * half <= d:
        raise ValueError(
            f"out_rope cos must be [T, RD / 2] with T = {t} and 0 < RD <= D = {d}, "
            f"got {list(cos.shape)}"
        )
    check_tensor("out_rope sin", sin, dtype=cos.dtype, shape=tuple(cos.shape), device=q.device)
    return half


def rope_kernel_args(q: torch.Tensor, out_rope, placeholder: torch.Tensor):
    """``(HALF_RD, (cos, sin, row stride))`` of ``out_rope`` for the kernels' epilogue
    (checked; tables made unit-stride on their columns); without it ``HALF_RD`` 0 and
    ``placeholder`` for the unused pointers."""
    half_rd = _check_out_rope(q, out_rope)
    if not half_rd:
        return 0, (placeholder, placeholder, 0)
    cos, sin = out_rope
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return half_rd, (cos, sin, cos.stride(0))


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _out(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return check_tensor("out", out, dtype=q.dtype, shape=tuple(q.shape), device=q.device)


def sparse_attention_triton(
    q: torch.Tensor, sources: Sequence[KeySource], sinks: torch.Tensor, scale: float, *,
    out: torch.Tensor | None = None, out_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    check: bool = True, tile_h: int = 16,
    tile_n: int | None = None, num_warps: int | None = None, num_splits: int | None = None,
    num_stages: int | None = None, d_chunk: int | None = None, pv_split: int | None = None,
    counters: torch.Tensor | None = None, rows: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The Triton kernels (also on CPU under ``TRITON_INTERPRET=1``); contract of
    :func:`sparse_attention`. ``tile_h`` heads and ``tile_n`` keys per tile; ``num_splits``
    column splits per (row, head group) (``kvplan.ops._sparse_split_kernels``; 1: one
    program walks all of a row's columns; None: :func:`split_count` on CUDA, 1 otherwise);
    ``num_stages``: the attention kernels' software pipelining (None: Triton's default).
    Register footprint knobs (same products, bit for bit on the tensor cores): ``d_chunk``
    (0, or a power of two >= 16) sums the logits over query / key column chunks of that
    width instead of holding the whole query tile; ``pv_split`` (1, 2 or 4) splits the
    value product and the accumulator into that many column chunks, each re-reading its
    values. A launch setting left None takes the path's entry in :func:`default_tiling` if
    any, else the built-in default. ``counters``: as in :func:`sparse_attention`."""
    addrs = _check(q, sources, sinks, check)
    _check_rows(rows, q, check)
    out = _out(q, out)
    half_rd, rope_args = rope_kernel_args(q, out_rope, sinks)
    num_rows, num_heads, head_dim = q.shape
    if rows is not None:
        if num_splits not in (None, 1):
            raise ValueError(f"a call with rows takes num_splits 1, got {num_splits}")
        num_splits = 1
    d_p2 = max(16, triton.next_power_of_2(head_dim))
    a0 = addrs[0]
    a1 = addrs[1] if len(addrs) > 1 else a0
    i0 = sources[0].index
    i1 = sources[1].index if len(sources) > 1 else i0
    n1 = i1.shape[1] if len(sources) > 1 else 0
    num_cols = i0.shape[1] + n1
    groups = triton.cdiv(num_heads, tile_h)
    _check_counters(counters, q)
    interpret = triton_interpreting()
    if num_splits is None:
        num_splits = (
            1
            if interpret or not q.is_cuda
            else split_count(
                num_rows * groups, num_cols, tile_n or _SPLIT_TILE_N, cuda_sm_count(q.device)
            )
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    grid_rows = num_rows if rows is None else rows.numel()
    few = (
        not interpret
        and q.is_cuda
        and grid_rows * groups <= FEW_PROGRAMS_PER_SM * cuda_sm_count(q.device)
    )
    table = default_tiling(num_splits, a0.kind >= _k.KIND_E4M3, few)
    tile_n = tile_n or table.get("tile_n")
    num_warps = num_warps or table.get("num_warps") or (8 if d_p2 >= 512 else 4)
    num_stages = num_stages if num_stages is not None else table.get("num_stages")
    d_chunk = d_chunk if d_chunk is not None else table.get("d_chunk", 0)
    pv_split = pv_split if pv_split is not None else table.get("pv_split", 1)
    if d_chunk and not (16 <= d_chunk <= d_p2 and d_chunk & (d_chunk - 1) == 0):
        raise ValueError(f"d_chunk must be 0 or a power of two in [16, {d_p2}], got {d_chunk}")
    if pv_split not in (1, 2, 4) or d_p2 // pv_split < 16:
        raise ValueError(f"pv_split must be 1, 2 or 4 with D_P2 / pv_split >= 16, got {pv_split}")
    if num_rows == 0 or grid_rows == 0:
        return out
    tile_n = tile_n or (_SPLIT_TILE_N if num_splits > 1 else 16 if d_p2 >= 512 else 32)
    cols_per_split = triton.cdiv(triton.cdiv(max(num_cols, 1), num_splits), tile_n) * tile_n
    num_splits = triton.cdiv(max(num_cols, 1), cols_per_split)

    sink32 = sinks.float().contiguous()
    srcs = (
        a0.ptr, i0, i0.stride(0), i0.shape[1], a0.num_slots, a0.block_size, a0.stride_block,
        a0.stride_token, a0.scale_stride, a0.scale_offset,
        a1.ptr, i1, i1.stride(0), n1, a1.num_slots, a1.block_size, a1.stride_block,
        a1.stride_token, a1.scale_stride, a1.scale_offset,
    )  # fmt: skip
    f16 = f16_tiles(q.dtype, addrs, head_dim, d_p2, d_chunk, pv_split)
    consts = dict(
        HEAD_DIM=head_dim, D_P2=d_p2, TILE_H=tile_h, TILE_N=tile_n, F16=f16,
        KIND0=a0.kind, SF0=a0.sf, GS0=a0.group, FLAT0=flat_scales(a0, head_dim, d_p2),
        KIND1=a1.kind, SF1=a1.sf, GS1=a1.group, FLAT1=flat_scales(a1, head_dim, d_p2),
        HAS1=len(sources) > 1, HW=not interpret,
        DOT_BF16=q.dtype == torch.bfloat16, D_CHUNK=d_chunk,
        PV_SPLIT=pv_split, INTERPRET=interpret, num_warps=num_warps,
    )  # fmt: skip
    if half_rd and (d_p2 // pv_split) % 2:
        raise ValueError(f"out_rope needs an even column chunk, got D_P2 / pv_split = "
                         f"{d_p2 // pv_split}")  # fmt: skip
    stages = {} if num_stages is None else {"num_stages": num_stages}
    if num_splits == 1:
        row_list = {} if rows is None else {"rows_ptr": rows, "HAS_ROWS": True}
        _k.sparse_attention_kernel[(grid_rows, groups)](
            q, out, sink32, q.stride(0), q.stride(1), out.stride(0), out.stride(1), num_heads,
            scale * _k.LOG2E, *srcs, *rope_args, **consts, HALF_RD=half_rd, **stages,
            **row_list,
        )  # fmt: skip
        return out
    # one fp32 workspace: acc [T, S, H, D], then m and l [T, S, H]
    parts = num_rows * num_splits * num_heads
    ws = torch.empty(parts * (head_dim + 2), dtype=torch.float32, device=q.device)
    ws_acc, ws_m, ws_l = ws[: parts * head_dim], ws[parts * head_dim : -parts], ws[-parts:]
    if counters is not None and counters.numel() < num_rows * groups:
        raise ValueError(
            f"counters must hold at least T * cdiv(H, {tile_h}) = {num_rows * groups} int32 "
            f"values for a split call, got {counters.numel()}"
        )
    fused = FUSED_COMBINE and (counters is not None or num_rows * groups <= MERGE_COUNTERS)
    merge = {}
    if fused:  # the last split program of each (row, head group) merges: one launch
        cnt = merge_counters(q.device) if counters is None else counters
        merge = dict(out_ptr=out, sink_ptr=sink32, cnt_ptr=cnt,
                     stride_ot=out.stride(0), stride_oh=out.stride(1), cos_ptr=rope_args[0],
                     sin_ptr=rope_args[1], stride_rt=rope_args[2], FUSED=True,
                     HALF_RD=half_rd)  # fmt: skip
    _ks.sparse_attention_split_kernel[(num_rows, groups, num_splits)](
        q, ws_acc, ws_m, ws_l, q.stride(0), q.stride(1), num_heads, num_splits, cols_per_split,
        scale * _k.LOG2E, *srcs, **consts, **stages, **merge,
    )  # fmt: skip
    if fused:
        return out
    _ks.sparse_attention_combine_kernel[(num_rows, groups)](
        out, sink32, ws_acc, ws_m, ws_l, out.stride(0), out.stride(1), num_heads, num_splits,
        *rope_args, HEAD_DIM=head_dim, D_P2=d_p2, TILE_H=tile_h, INTERPRET=interpret,
        HALF_RD=half_rd, HW=not interpret, num_warps=4,
    )  # fmt: skip
    return out


FP4_F16_TILES = env_flag("KVPLAN_SPARSE_FP4_F16", True)
"""bf16 / fp16 queries over e2m1 sources with e4m3 scales (V41 FP4 records) take fp16 products
(True, the default; ``KVPLAN_SPARSE_FP4_F16=0`` at import: off): the key tiles are read as
int32 words of nibbles and scaled in fp16 (``kvplan.ops._paged_kv_tiles.e2m1_f16_tile``: the
same, exact values), the query (`query_f16`) and probabilities enter the MMAs in fp16. sm_90
split kernel at the DeepSeek-V4 shapes (64 keys x 8 warps): 2,042 main-loop instructions at 222
registers against 3,398 at 255 (bytes loaded one at a time, decoded in fp32). On the H200,
hybrid decode with fp4 records at batch 32 (bench/RESULTS.md, session 23), async step 3.21 ->
3.04 ms at 32K and 4.51 -> 4.04 ms at 128K."""

FP4_NIBBLE_TILES = env_flag("KVPLAN_SPARSE_FP4_NIBBLES", True)
"""Where `FP4_F16_TILES` applies, the tiles in nibble order (True, the default;
``KVPLAN_SPARSE_FP4_NIBBLES=0`` at import: in order; ``kvplan.ops._paged_kv_tiles.
e2m1_f16_tile`` with ``TINY``): four integer operations a pair of values and one fp16
multiply, the values 2^-14 small, the query permuted to match and the accumulator back in
order times 2^14 (exact) before it is stored. sm_90 split kernel at the DeepSeek-V4 shapes (64
keys x 8 warps, fused merge): 1,381 main-loop instructions at 173 registers against 2,042 at
244. H200, hybrid decode with fp4 records at batch 32 (bench/RESULTS.md, session 24): async
step 2.97 -> 2.94 ms at 32K, 4.05 -> 3.97 ms at 128K (graph step 3.63 -> 3.44, 4.69 ->
4.52)."""


def f16_tiles(q_dtype, addrs, head_dim: int, d_p2: int, d_chunk: int, pv_split: int) -> int:
    """The kernels' ``F16``: 1 where a call takes fp16 tiles (`FP4_F16_TILES`; 2 in nibble
    order, `FP4_NIBBLE_TILES`), else 0: a bf16 / fp16 query held whole (``d_chunk`` 0), and
    every source e2m1 with e4m3 scales in whole power-of-two groups, also per value-product
    chunk, its value runs 4-byte aligned (word loads)."""
    if not FP4_F16_TILES or q_dtype not in (torch.bfloat16, torch.float16) or d_chunk:
        return 0
    chunk = d_p2 // pv_split
    for a in addrs:
        groups = chunk // a.group if chunk % a.group == 0 else 0
        if not (a.kind == _k.KIND_E2M1 and a.sf == _k.SF_E4M3 and groups
                and groups & (groups - 1) == 0 and flat_scales(a, head_dim, d_p2)):  # fmt: skip
            return 0
        offsets = (a.stride_block, a.stride_token, a.ptr.data_ptr(), chunk // 2)
        if any(x % 4 for x in offsets):
            return 0
    return 2 if FP4_NIBBLE_TILES else 1


FUSED_COMBINE = env_flag("KVPLAN_SPARSE_FUSED_COMBINE", True)
"""Split calls merge their partials in the split kernel's last program of each (row, head
group) (True, the default) instead of a second launch (``sparse_attention_combine_kernel``;
``KVPLAN_SPARSE_FUSED_COMBINE=0`` at import). The same bits either way (GPU test, eager and
CUDA-graph replays). H200, session 22, DeepSeek-V4-shaped decode at batch 32, fp8 records,
fused vs two launches in one call: graph step 3.07 vs 3.19 ms (32K), 3.69 vs 3.87 (128K);
async 2.66 vs 2.68, 3.25 vs 3.28. The merge counters: the caller's (``counters``; each hybrid
family owns one buffer), else a buffer per device and CUDA stream."""

_PROGRAMS_PER_SM = 1  # split target: about this many programs per SM
# Launch settings (tile_n, num_warps, num_stages, d_chunk, pv_split) where the caller gives
# none; missing keys: the built-in defaults. `bench_sparse_kernels.py --attention-sweep stages`
# on the H200 (2026-12-02, V41 fp8 records, 16 heads x 512, window 128):
# - one program, quantized keys (decode batches that fill the SMs alone): 32 keys x 4 warps x 3
#   stages, 256 rows CSA 128+512 0.107 vs 0.155 ms at 16 x 4 x 2 (1.45x), HCA 128+1,024 0.186
#   vs 0.251 (1.35x); 8 warps 0.17 / 0.27;
# - one program, bf16 / fp32 rows, few programs (decode batches of the exact format): 64 keys
#   x 8 warps x 2 stages, 256 rows CSA 0.065 vs 0.108 ms at 16 x 4 x 2 (1.68x), HCA 0.102 vs
#   0.186 (1.82x) (`--attention-format bf16`);
# - one program, bf16 / fp32 rows, many programs (the prompt path hands its rows): 4 warps and
#   2 stages, 8,192 prompt rows x 640 keys 1.9 vs 3.6 ms at 8 warps (`--only prefill`);
# - split (small decode batches): 64 keys x 8 warps x 3 stages, 32 rows CSA 0.023 vs 0.039 ms
#   at 32 x 8 (1.68x), HCA 128+1,024 0.033 vs 0.052, 128+256 0.018 vs 0.019; on bf16 / fp32
#   rows 2 stages (2026-12-02 18:00, `--attention-format bf16`, 4 splits): CSA 0.0197 vs
#   0.0208 ms at 3 stages, HCA 128+256 0.0155 vs 0.0167, 128+1,024 0.0283 vs 0.0290.
ONE_PROGRAM_TILING: dict[str, int] = {"num_warps": 4, "num_stages": 2}
ONE_PROGRAM_TILING_FEW: dict[str, int] = {"tile_n": 64, "num_warps": 8, "num_stages": 2}
ONE_PROGRAM_TILING_QUANTIZED: dict[str, int] = {"tile_n": 32, "num_warps": 4, "num_stages": 3}
SPLIT_TILING: dict[str, int] = {"tile_n": 64, "num_warps": 8, "num_stages": 3}
SPLIT_TILING_EXACT: dict[str, int] = {"tile_n": 64, "num_warps": 8, "num_stages": 2}

_SPLIT_TILE_N = SPLIT_TILING["tile_n"]  # keys per tile of the split kernel (split_count's unit)
FEW_PROGRAMS_PER_SM = 4  # "few programs": (row, head group) pairs up to this many per SM


def default_tiling(num_splits: int, quantized: bool, few: bool = False) -> dict[str, int]:
    """The launch settings table of a call with ``num_splits`` column splits whose first
    source holds quantized records (``quantized``) or bf16 / fp32 rows, with ``few``
    (row, head group) programs (up to ``FEW_PROGRAMS_PER_SM`` a CUDA SM) or more."""
    if num_splits > 1:
        return SPLIT_TILING if quantized else SPLIT_TILING_EXACT
    if quantized:
        return ONE_PROGRAM_TILING_QUANTIZED
    return ONE_PROGRAM_TILING_FEW if few else ONE_PROGRAM_TILING


_MIN_SPLIT_TILES = 2  # fewest key tiles a split walks (1 measured the same: H200, session 28,
# batch 16 at 4K, where the HCA rows' 160 keys then split: async step 2.27 vs 2.28 ms)


SPLIT_ONE_WAVE = env_flag("KVPLAN_SPARSE_ONE_WAVE", True)
"""`split_count` rounds the splits down, so that the split programs fit one wave of
``_PROGRAMS_PER_SM`` a SM (True, the default), instead of up (``KVPLAN_SPARSE_ONE_WAVE=0`` at
import): 32 rows on 132 SMs take 4 splits (128 programs) instead of 5 (160: the split launch
holds one program a SM, so 28 of them ran as a second wave). H100, session 51
(`bench/results/h100/s51/`): the kernel alone at 32 rows (`bench_sparse_kernels.py --only
attention --rows 32 --splits 3,4,5,6`, graph replay) CSA 128+512 24.1 us at 4 splits against
31.5 at 5, HCA 128+1,024 33.6 against 40.6; the DeepSeek-V4-shaped 32K decode step's split
kernels (`bench_hybrid.py --profile 2`, 12 launches) 277.2 / 275.7 against 316.9 / 316.1 us
at batch 32 and 374.7 against 472.6 us at batch 64, the same (239.7 / 240.1 us) at batch 16."""


def split_count(
    num_programs: int, num_cols: int, tile_n: int, num_sms: int, one_wave: bool | None = None
) -> int:
    """Column splits per (row, head group) for ``num_programs`` (row, head group) pairs over
    ``num_cols`` joined columns: 1 when those programs already fill ``num_sms`` SMs, else
    about ``_PROGRAMS_PER_SM`` programs per SM (at most that many with ``one_wave``, default
    `SPLIT_ONE_WAVE`), each walking at least ``_MIN_SPLIT_TILES`` tiles of ``tile_n``
    columns. Depends on the shapes only (fixed under a CUDA graph)."""
    if num_programs >= num_sms or num_cols <= tile_n * _MIN_SPLIT_TILES:
        return 1
    slots = _PROGRAMS_PER_SM * num_sms
    one_wave = SPLIT_ONE_WAVE if one_wave is None else one_wave
    want = slots // num_programs if one_wave else triton.cdiv(slots, num_programs)
    return max(1, min(want, num_cols // (tile_n * _MIN_SPLIT_TILES)))


def sparse_attention_torch(
    q: torch.Tensor, sources: Sequence[KeySource], sinks: torch.Tensor, scale: float, *,
    out: torch.Tensor | None = None, out_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    check: bool = True, rows: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Vectorized torch path (fp32 math, rows gathered by :func:`gather_rows`; ``out_rope``
    by ``norm_rope_torch`` after)."""
    _check(q, sources, sinks, check)
    _check_rows(rows, q, check)
    out = _out(q, out)
    if rows is not None:
        r = rows.long()
        part = [KeySource(s.cache, s.index[r].contiguous(), s.layout) for s in sources]
        rope = None if out_rope is None else tuple(t[r] for t in out_rope)
        out[r] = sparse_attention_torch(q[r], part, sinks, scale, out_rope=rope, check=False)
        return out
    if _check_out_rope(q, out_rope):
        from kvplan.ops.rope import norm_rope_torch

        o = sparse_attention_torch(q, sources, sinks, scale, check=False)
        out.copy_(norm_rope_torch(o, *out_rope, inverse=True))
        return out
    sink = sinks.float().view(1, -1, 1)  # [1, H, 1]
    for lo in range(0, q.shape[0], _ROWS_PER_CHUNK):
        hi = min(lo + _ROWS_PER_CHUNK, q.shape[0])
        idx = torch.cat([src.index[lo:hi] for src in sources], dim=1)  # [t, K]
        kv = torch.cat([gather_rows(src, src.index[lo:hi]) for src in sources], dim=1)
        logits = torch.einsum("thd,tkd->thk", q[lo:hi].float(), kv) * scale
        logits = logits.masked_fill((idx < 0)[:, None, :], float("-inf"))
        m = torch.maximum(logits.amax(dim=-1, keepdim=True), sink).clamp(min=-1e30)
        p = torch.exp(logits - m)
        denom = p.sum(dim=-1, keepdim=True) + torch.exp(sink - m)
        o = torch.einsum("thk,tkd->thd", p, kv) / denom.clamp(min=1e-30)
        out[lo:hi] = o.to(q.dtype)
    return out


def sparse_attention_ref(
    q: torch.Tensor, sources: Sequence[KeySource], sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Per-row, per-head loop in float64 over the visible rows (tests only)."""
    num_rows, num_heads, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t in range(num_rows):
        rows = [gather_rows(src, src.index[t][src.index[t] >= 0]) for src in sources]
        kv = torch.cat(rows).double().cpu()  # [n, D]
        for h in range(num_heads):
            logits = (kv @ q[t, h].double().cpu()) * scale
            sink = float(sinks[h])
            m = max([sink, *logits.tolist()])
            w = torch.exp(logits - m)
            out[t, h] = (w @ kv) / (
                w.sum() + torch.exp(torch.tensor(sink - m, dtype=torch.float64))
            )
    return out
