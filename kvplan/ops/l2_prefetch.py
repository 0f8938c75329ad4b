"""Weights pulled into the GPU's L2 cache ahead of the GEMM that reads them.

A decode step's narrow projections (llama-1b's o projection: 64 rows x 2,048 x 2,048, 8 MB of
bf16 weights) take ~6 us on an H200 where their bytes alone would take ~2: most of a small
GEMM is the ramp of its first loads from DRAM, not bandwidth. The attention kernel that runs
before the o projection, meanwhile, reads a few MB at short contexts and leaves the DRAM
mostly idle. `l2_prefetch(t)` issues Hopper's bulk L2 prefetch
(``cp.async.bulk.prefetch.L2.global``, sm_90+) over ``t``'s bytes from one small Triton
launch: each lane asks for one chunk and the program exits at once, without waiting for the
bytes; the copy engine fills L2 while the next kernels run. A hint only: it changes no value,
and the GEMM reads DRAM for whatever is not (or no longer) in L2.

Off CUDA, under the interpreter and before Hopper it does nothing. ``L2Prefetch`` is the
engine's form: the tensors of one point of a step, issued inline or on a side stream (a
parallel branch of a captured CUDA graph), and the join before their reader.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvplan.ops._dispatch import triton_interpreting
from kvplan.ops._launch import jit

__all__ = [
    "L2Prefetch",
    "L2_PREFETCH_ENV",
    "PREFETCH_MAX_ROWS",
    "l2_prefetch",
    "l2_prefetch_chunks",
    "l2_prefetch_setting",
    "prefetch_supported",
]

# One program asks for LANES x CHUNK bytes (one lane a thread). A program retires only when
# its bulk prefetches have landed, and one SM's copy engine moves ~0.2 TB/s (H100, session 45:
# one 4-warp program over 8 MB took 33-44 us), so the bytes are spread over many small programs.
# `KVPLAN_L2_PREFETCH_TILE=lanes,chunk` (read at import) for A/B runs.
LANES, CHUNK = (int(v) for v in os.environ.get("KVPLAN_L2_PREFETCH_TILE", "32,2048").split(","))
L2_PREFETCH_ENV = "KVPLAN_L2_PREFETCH"
PREFETCH_MAX_ROWS = 512  # the models prefetch in steps of at most this many tokens (decode GEMMs)
_PARTS = ("o", "qkv")  # what `l2_prefetch_setting` may name


@jit
def l2_prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Program ``p``: lanes ask L2 for bytes ``[base + (p * LANES + i) * CHUNK, +CHUNK)`` (the
    last one clipped to ``nbytes``; ``base`` 16-byte aligned, ``nbytes`` a multiple of 16)."""
    pid = tl.program_id(0).to(tl.int64)
    off = (pid * LANES + tl.arange(0, LANES).to(tl.int64)) * CHUNK
    size = tl.maximum(tl.minimum(nbytes - off, CHUNK), 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


def prefetch_supported(t: torch.Tensor) -> bool:
    """Whether `l2_prefetch` acts on ``t``: a CUDA tensor on an sm_90+ device, outside the
    interpreter."""
    if not t.is_cuda or triton_interpreting():
        return False
    return torch.cuda.get_device_capability(t.device)[0] >= 9


def l2_prefetch_chunks(
    t: torch.Tensor, lanes: int | None = None, chunk: int | None = None
) -> tuple[int, int, int]:
    """``(base, nbytes, programs)`` of `l2_prefetch`'s launch over a contiguous ``t``: the
    first 16-byte boundary at or after ``t.data_ptr()`` and the whole 16-byte units after it
    up to the tensor's end (the hint may skip up to 15 bytes at each end)."""
    if not t.is_contiguous():
        raise ValueError(f"l2_prefetch: tensor must be contiguous, got strides {t.stride()}")
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    base = -(-start // 16) * 16
    nbytes = max(0, (end - base) // 16 * 16)
    return base, nbytes, triton.cdiv(nbytes, (chunk or CHUNK) * (lanes or LANES))


def l2_prefetch(*tensors: torch.Tensor, lanes: int | None = None, chunk: int | None = None) -> None:
    """Ask the L2 cache for every byte of each tensor (a hint; no-op where
    `prefetch_supported` is False): one launch a tensor, of ``lanes`` x ``chunk``-byte
    requests a program (the module's ``LANES`` / ``CHUNK`` when None)."""
    lanes, chunk = lanes or LANES, chunk or CHUNK
    for t in tensors:
        if not prefetch_supported(t):
            continue
        base, nbytes, programs = l2_prefetch_chunks(t, lanes, chunk)
        if programs:
            l2_prefetch_kernel[(programs,)](
                base, nbytes, CHUNK=chunk, LANES=lanes, num_warps=max(1, lanes // 32)
            )


def l2_prefetch_setting(value: str | None = None) -> tuple[frozenset[str], bool]:
    """``(parts, side_stream)`` from ``KVPLAN_L2_PREFETCH`` (or ``value``): a comma list of
    ``o`` (a layer's o projection, asked for before its attention) and ``qkv`` (the next
    layer's qkv projection, at the same point), plus ``stream`` to issue them on a side stream;
    empty or ``0``: off. Raises ValueError naming an unknown word."""
    raw = os.environ.get(L2_PREFETCH_ENV, "") if value is None else value
    words = [w.strip() for w in raw.split(",") if w.strip() and w.strip() != "0"]
    bad = [w for w in words if w not in (*_PARTS, "stream")]
    if bad:
        raise ValueError(
            f"{L2_PREFETCH_ENV}: unknown part {bad[0]!r} (known: {', '.join(_PARTS)}, stream)"
        )
    return frozenset(w for w in words if w != "stream"), "stream" in words


class L2Prefetch:
    """How one point of a step asks L2 for tensors: ``issue(tensors)`` before the kernels the
    prefetch should overlap, ``join()`` before the first reader. With ``side_stream`` the
    launch is a branch off the current stream (a parallel node in a captured graph) that
    ``join`` merges back; inline it runs in order and ``join`` does nothing."""

    def __init__(
        self, *, side_stream: bool = False, lanes: int | None = None, chunk: int | None = None
    ) -> None:
        self.side_stream = side_stream
        self.lanes, self.chunk = lanes, chunk
        self._stream: torch.cuda.Stream | None = None
        self._forked = False

    def issue(self, tensors: tuple[torch.Tensor, ...]) -> None:
        tensors = tuple(t for t in tensors if prefetch_supported(t))
        if not tensors:
            return
        if not self.side_stream:
            l2_prefetch(*tensors, lanes=self.lanes, chunk=self.chunk)
            return
        if self._stream is None or self._stream.device != tensors[0].device:
            self._stream = torch.cuda.Stream(device=tensors[0].device)
        self._stream.wait_stream(torch.cuda.current_stream(tensors[0].device))
        with torch.cuda.stream(self._stream):
            l2_prefetch(*tensors, lanes=self.lanes, chunk=self.chunk)
        self._forked = True

    def join(self) -> None:
        if self._forked:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            self._forked = False
