"""Does a kernel's sm_90 code change when Triton may not specialize its size arguments?

For every recorded specialization (``tests/kernel_record.py`` lines) of the kernels that mark
size arguments ``do_not_specialize`` (token / row / entry counts: see
``kvplan/ops/_launch.py``), compile the line as recorded (the sizes unspecialized, as the
GPU now compiles them) and again with each such size declared divisible by 16 (what Triton
used to compile for a size that is a multiple of 16), and compare the PTX: instruction count,
vector loads / stores (``.v2`` / ``.v4``), and whether the two differ at all. No GPU needed.

    .venv/bin/python tools/ptx_specialization_diff.py RECORD.jsonl [--kernels a,b] [--max 4]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.compile_sm90 import _constexpr_value, compile_kernel  # noqa: E402


def stats(ptx: str) -> dict:
    body = [x.strip() for x in ptx.splitlines() if x.startswith("\t") and not x.strip()
            .startswith(("//", ".", "$", "{", "}"))]  # fmt: skip
    vec = sum(1 for x in body if re.match(r"(@%p\d+ )?(ld|st)\.global\S*\.v[24]", x))
    return {"instructions": len(body), "vector_ld_st": vec}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("record")
    ap.add_argument("--kernels", default=None, help="comma-separated names (default: all with"
                    " do_not_specialize)")  # fmt: skip
    ap.add_argument("--max", type=int, default=4, help="specializations per kernel")
    args = ap.parse_args()
    wanted = set(args.kernels.split(",")) if args.kernels else None
    seen = collections.Counter()
    rows = []
    for line in Path(args.record).read_text().splitlines():
        rec = json.loads(line)
        fn = getattr(importlib.import_module(rec["module"]), rec["name"])
        dns = [p.num for p in fn.params if p.do_not_specialize]
        if not dns or (wanted and rec["name"] not in wanted) or seen[rec["name"]] >= args.max:
            continue
        seen[rec["name"]] += 1
        constexprs = {tuple(k): _constexpr_value(v) for k, v in rec["constexprs"]}
        attrs = {tuple(k): [tuple(a) for a in v] for k, v in rec["attrs"]}
        options = {"num_warps": rec["num_warps"], "num_stages": rec["num_stages"]}
        free = compile_kernel(fn, rec["signature"], constexprs, attrs, options).asm["ptx"]
        div16 = dict(attrs)
        for i in dns:
            if rec["signature"][fn.arg_names[i]].startswith("i"):
                div16[(i,)] = [("tt.divisibility", 16)]
        spec = compile_kernel(fn, rec["signature"], constexprs, div16, options).asm["ptx"]
        a, b = stats(free), stats(spec)
        same = free.replace(" ", "") == spec.replace(" ", "")
        rows.append((rec["name"], a, b, same))
        print(f"{rec['name']:>24}: unspecialized {a['instructions']:5d} instructions, "
              f"{a['vector_ld_st']:3d} vector ld/st; sizes % 16 == 0: {b['instructions']:5d}, "
              f"{b['vector_ld_st']:3d}{'  (identical PTX)' if same else ''}")  # fmt: skip
    worse = [r for r in rows if r[1]["vector_ld_st"] < r[2]["vector_ld_st"]]
    print(f"{len(rows)} specializations, {sum(r[3] for r in rows)} identical, "
          f"{len(worse)} with fewer vector accesses unspecialized")  # fmt: skip


if __name__ == "__main__":
    main()
