"""Registers, shared memory and load instructions of the dense paged decode kernel per KV
format and tiling, compiled for sm_90 on this machine (no GPU): how many programs an H200 SM
can hold (its 65,536 registers and 64 warps), which explains latency-bound formats.

The launch's integer specialization is reproduced: pointers and the strides of the engine's
caches are divisible by 16 (llama-1b heads: 8 KV heads x 64, 16-token blocks), as Triton's
launcher marks them on the GPU; without those hints the compiler cannot vectorize the
page-table gathers and the register counts mean nothing.

    PYTHONPATH=. python3 bench/decode_kernel_regs.py [--out regs.json]
    PYTHONPATH=. python3 bench/decode_kernel_regs.py --loop-ops fp8:64,2,3
    PYTHONPATH=. python3 bench/decode_kernel_regs.py --loop-ops fp8+ra:32,2,3,168 --heads 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # real JIT functions: compile, do not interpret
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvplan.ops._paged_attention_kernels import _decode_kernel  # noqa: E402
from tools.compile_sm90 import (  # noqa: E402
    _sass_loops,
    compile_kernel,
    ptxas_report,
    sass,
    sass_loop_ops,
)

FORMATS = {  # name: (KV_QUANT, SF_KIND, GROUP, cache pointer type, PREFETCH)
    "bf16": (0, 0, 1, "*bf16", False),
    "fp8": (1, 2, 32, "*u8", False),
    "int8": (3, 2, 32, "*u8", False),
    "fp4": (2, 1, 16, "*u8", False),
    "fp8+pf": (1, 2, 32, "*u8", True),  # QUANT_PREFETCH: the bytes loaded a tile ahead
    "int8+pf": (3, 2, 32, "*u8", True),
    "fp4+pf": (2, 1, 16, "*u8", True),
    "fp8+ra": (1, 2, 32, "*u8", 2),  # page rows looked up a tile ahead
    "bf16+ra": (0, 0, 1, "*bf16", 2),
    "fp4+ra": (2, 1, 16, "*u8", 2),
    "fp4f16+pf": (4, 1, 16, "*u8", 1),  # KVPLAN_FP4_F16: fp16 tiles (E2M1_F16)
    "fp4f16+ra": (4, 1, 16, "*u8", 2),
    "fp4nib+ra": (5, 1, 16, "*u8", 2),  # KVPLAN_FP4_NIBBLES: fp16 tiles in nibble order
    "int8+ra": (3, 2, 32, "*u8", 2),
}
TILINGS = [  # tile_n, warps, stages (5 stages: the first depth that double-buffers K/V tiles)
    (32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2),
    (32, 2, 5), (32, 4, 5), (64, 2, 2), (64, 4, 5),
]  # fmt: skip
DIV16 = {
    "q_ptr", "k_ptr", "v_ptr", "page_ids_ptr", "page_start_ptr", "kv_lens_ptr", "out_ptr",
    "part_acc_ptr", "part_m_ptr", "part_l_ptr", "stride_qb", "stride_qh", "stride_kb",
    "stride_kt", "stride_kh", "stride_vb", "stride_vt", "stride_vh", "stride_ob", "stride_oh",
    "num_splits", "sf_off",
}  # fmt: skip


def arg_type(name: str, const: dict, kptr: str) -> str:
    """The kernel argument's type in a launch over the engine's caches."""
    if name in const:
        return "constexpr"
    if name in ("q_ptr", "out_ptr"):
        return "*bf16"
    if name in ("k_ptr", "v_ptr"):
        return kptr
    if name.endswith("_ptr"):
        return "*fp32" if name.startswith("part") else "*i32"
    return "fp32" if name == "qk_scale" else "i32"


LOOP_OPS = ("LDGSTS", "LDG", "BAR", "F2FP", "HADD2", "FMUL", "HMMA", "LDS", "LDSM", "STS")


def _launch(
    name: str, tile_n: int, warps: int, stages: int, maxnreg: int | None = None, heads: int = 1
):
    """The compiled decode kernel for a ``FORMATS`` entry and tiling (the engine's split
    launch), under a register cap when ``maxnreg`` is given, ``heads`` KV heads a program."""
    kv_quant, sf_kind, group, kptr, prefetch = FORMATS[name]
    const = dict(TILE_M=16, BLOCK_SIZE=16, TILE_N=tile_n, HEAD_DIM=64, DOT_PRECISION="tf32",
                 SPLIT=True, INTERPRET=False, KV_QUANT=kv_quant, SF_KIND=sf_kind, GROUP=group,
                 PREFETCH=prefetch, HEADS_FIRST=False, HEADS=heads, RING=0)  # fmt: skip
    sig = {n: arg_type(n, const, kptr) for n in _decode_kernel.arg_names}
    attrs = {(i,): [("tt.divisibility", 16)] for i, n in enumerate(_decode_kernel.arg_names)
             if n in DIV16}  # fmt: skip
    options = {"num_warps": warps, "num_stages": stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    return compile_kernel(_decode_kernel, sig, const, attrs, options)


def loop_ops(spec: str, heads: int = 1) -> dict:
    """``"fp8:64,2,3"`` (``"fp8:64,2,3,168"``: under a 168-register cap) -> registers, spill
    bytes and the unmasked main loop's length and instruction counts (the middle of the three
    key loops: masked head, whole tiles, masked tail), and its warp instructions per key and
    KV head (``heads`` KV heads a program)."""
    name, tiling = spec.split(":")
    tile_n, warps, stages, *cap = (int(x) for x in tiling.split(","))
    ck = _launch(name, tile_n, warps, stages, cap[0] if cap else None, heads)
    loops = sass_loop_ops(ck.asm["cubin"], LOOP_OPS)
    lengths = [len(body) for body in _sass_loops(sass(ck.asm["cubin"]))]
    mid = len(loops) // 2
    regs, spills = ptxas_report(ck.asm["ptx"])
    n = lengths[mid] if lengths else 0
    return dict(format=name, tiling=[tile_n, warps, stages, *cap], heads=heads, registers=regs,
                spill_bytes=spills, main_loop_instructions=n,
                warp_instructions_per_key_head=n * warps / (tile_n * heads),
                main_loop=loops[mid] if loops else {})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--loop-ops",
        default=None,
        metavar="FORMAT:T,W,S",
        help="instead: one launch's main-loop instruction counts (cp.async LDGSTS vs "
        "register LDG loads, barriers, conversions, MMAs, shared memory), e.g. fp8:64,2,3 "
        "(fp8:64,2,3,168 under a 168-register cap)",
    )
    ap.add_argument("--heads", type=int, default=1, help="KV heads a program (--loop-ops)")
    args = ap.parse_args()
    if args.loop_ops:
        print(json.dumps(loop_ops(args.loop_ops, args.heads)))
        return
    rows = []
    for name in FORMATS:
        for tile_n, warps, stages in TILINGS:
            ck = _launch(name, tile_n, warps, stages)
            regs, spills = ptxas_report(ck.asm["ptx"])
            per_sm = min(64 // warps, 65536 // (max(regs, 1) * 32 * warps))
            ptx = ck.asm["ptx"]
            rows.append(dict(format=name, tile_n=tile_n, num_warps=warps, num_stages=stages,
                             registers=regs, spill_bytes=spills, shared_bytes=ck.metadata.shared,
                             programs_per_sm=per_sm, cp_async=ptx.count("cp.async.cg"),
                             ld_v4=ptx.count("ld.global.v4"),
                             layout_converts=ck.asm["ttgir"].count("convert_layout")))  # fmt: skip
    print(f"{'format':>6} {'tile_n':>6} {'warps':>5} {'stages':>6} {'regs':>5} {'spill B':>7} "
          f"{'smem B':>7} {'progs/SM':>8} {'cp.async':>8} {'ld.v4':>5} {'cvt':>4}")  # fmt: skip
    for r in rows:
        print(f"{r['format']:>6} {r['tile_n']:>6} {r['num_warps']:>5} {r['num_stages']:>6} "
              f"{r['registers']:>5} {r['spill_bytes']:>7} {r['shared_bytes']:>7} "
              f"{r['programs_per_sm']:>8} {r['cp_async']:>8} {r['ld_v4']:>5} "
              f"{r['layout_converts']:>4}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(dict(kernel="_decode_kernel", rows=rows), indent=1))


if __name__ == "__main__":
    main()
