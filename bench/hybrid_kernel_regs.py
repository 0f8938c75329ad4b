"""Registers, shared memory and main-loop instructions of the hybrid attention and indexer
kernels at the DeepSeek-V4 shapes (head_dim 512, 16 heads, V41 FP8 sources; 32 index heads x
128), compiled for sm_90 on this machine (no GPU), with the launch's divisibility hints on
pointers and strides (see ``bench/decode_kernel_regs.py``). "warp instructions a key": the
main loop's static instruction count times the warps, over the keys one iteration handles --
the issue cost of a key where the loop is not latency-bound (e.g. a dequantized tile feeding
a dot whose rows, 16 heads, cannot be split across warps is dequantized by several warps).

    PYTHONPATH=. python3 bench/hybrid_kernel_regs.py [--out regs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # real JIT functions: compile, do not interpret
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]


from kvplan.ops import _sparse_attention_kernels as _k  # noqa: E402
from kvplan.ops import _sparse_split_kernels as _ks  # noqa: E402
from tools.compile_sm90 import compile_kernel, ptxas_report, sass_longest_loop  # noqa: E402

# block sizes (constexprs): a 128-row ring block, the CSA pool (128 tokens / ratio 4 a block)
V41 = dict(KIND0=2, SF0=0, GS0=32, FLAT0=True, KIND1=2, SF1=0, GS1=32, FLAT1=True, bs0=128, bs1=32)
ATTN_TYPES = {"q_ptr": "*bf16", "qk_scale": "fp32", "c0_ptr": "*u8", "c1_ptr": "*u8",
              "ws_acc_ptr": "*fp32", "ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32",
              "out_ptr": "*bf16", "sink_ptr": "*fp32", "cos_ptr": "*bf16",
              "sin_ptr": "*bf16"}  # fmt: skip
# tile_n, warps, d_chunk, pv_split, stages: the whole-tile kernel, then the chunked variants
ATTN_VARIANTS = [(16, 4, 0, 1, 2), (16, 8, 0, 1, 2), (32, 4, 0, 1, 2), (32, 8, 0, 1, 2),
                 (64, 4, 0, 1, 2), (64, 8, 0, 1, 2),
                 (16, 8, 64, 1, 2), (16, 8, 64, 4, 1), (16, 8, 64, 4, 2), (16, 8, 32, 4, 1),
                 (16, 8, 128, 4, 1), (16, 4, 64, 4, 1), (16, 8, 64, 2, 1)]  # fmt: skip
INDEX_TYPES = {"q_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32", "c_ptr": "*u8"}


def report(fn, const: dict, types: dict, warps: int, stages: int = 2) -> dict:
    sig = {n: "constexpr" if n in const else types.get(n, "*i32" if n.endswith("_ptr") else "i32")
           for n in fn.arg_names}  # fmt: skip
    # as the launcher marks them: pointers, strides, and the sources' block / token / scale
    # strides and scale offsets (V41 records are 528 bytes, index rows 128 + scales)
    hinted = ("stride", "sblk", "stok", "sstr", "soff")
    attrs = {(i,): [("tt.divisibility", 16)] for i, n in enumerate(fn.arg_names)
             if n.endswith("_ptr") or n.startswith(hinted)}  # fmt: skip
    ck = compile_kernel(fn, sig, const, attrs, {"num_warps": warps, "num_stages": stages})
    regs, spills = ptxas_report(ck.asm["ptx"])
    loop = sass_longest_loop(ck.asm["cubin"])  # the whole program where it has no main loop
    keys = const["TILE_N"]  # keys one iteration of the main loop (or the program) handles
    return dict(registers=regs, spill_bytes=spills, shared_bytes=ck.metadata.shared,
                num_warps=warps, num_stages=stages, loop_instructions=loop,
                warp_instructions_per_key=round(loop * warps / keys, 1),
                programs_per_sm=min(64 // warps, 65536 // (max(regs, 1) * 32 * warps)))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    attn = dict(HEAD_DIM=512, D_P2=512, TILE_H=16, **V41, HAS1=True, HW=True, DOT_BF16=True,
                INTERPRET=False, F16=False)  # fmt: skip
    rows = []
    for name, fn in (("sparse_attention_kernel", _k.sparse_attention_kernel),
                     ("sparse_attention_split_kernel", _ks.sparse_attention_split_kernel)):  # fmt: skip
        for tile_n, warps, d_chunk, pv_split, stages in ATTN_VARIANTS:
            const = dict(attn, TILE_N=tile_n, D_CHUNK=d_chunk, PV_SPLIT=pv_split)
            if fn is _k.sparse_attention_kernel:
                const["HALF_RD"] = 32  # the model's out_rope: 64 rotary channels of 512
            else:
                const.update(FUSED=False, HALF_RD=0)  # the two-launch split path
            r = report(fn, const, ATTN_TYPES, warps, stages)
            rows.append(dict(kernel=name, tile_n=tile_n, d_chunk=d_chunk, pv_split=pv_split,
                             **r))  # fmt: skip
    for tile_n, tiles, warps in ((64, 1, 4), (128, 1, 4), (128, 2, 4), (128, 1, 8)):
        const = dict(HEAD_DIM=128, D_P2=128, TILE_H=32, TILE_N=tile_n, TILES=tiles, KIND=2,
                     SF=0, GS=32, FLAT=True, HW=True, DOT_BF16=True, block_size=32)  # fmt: skip
        r = report(_k.index_scores_tc_kernel, const, INDEX_TYPES, warps)
        rows.append(dict(kernel="index_scores_tc_kernel", tile_n=tile_n, tiles=tiles, **r))
    # the per-sequence prompt form: ROWS rows x 32 heads as the dot's columns
    for tile_n, rows_per, warps in ((64, 4, 8), (64, 4, 4), (128, 4, 8), (64, 2, 4), (32, 4, 4)):
        const = dict(HEAD_DIM=128, D_P2=128, TILE_H=32, TILE_N=tile_n, ROWS=rows_per, KIND=2,
                     SF=0, GS=32, FLAT=True, HW=True, DOT_BF16=True, block_size=32)  # fmt: skip
        r = report(_k.index_scores_seq_kernel, const, INDEX_TYPES, warps)
        rows.append(dict(kernel="index_scores_seq_kernel", tile_n=tile_n, tiles=rows_per, **r))
    for r in rows:
        var = (
            f" d_chunk {r['d_chunk']:>3} pv_split {r['pv_split']} stages {r['num_stages']}"
            if "d_chunk" in r
            else ""
        )
        print(f"{r['kernel']:<30} tile_n {r['tile_n']:>3} warps {r['num_warps']}{var}: "
              f"{r['registers']:>3} regs, spill {r['spill_bytes']:>4} B, smem "
              f"{r['shared_bytes']:>6} B, {r['programs_per_sm']} programs/SM, "
              f"{r['warp_instructions_per_key']:>6} warp instructions a key")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(dict(rows=rows), indent=1))


if __name__ == "__main__":
    main()
