"""Compile recorded Triton kernel specializations for an sm_90 (H100 / H200) target on a
CPU-only machine: catches what the interpreter accepts and the GPU compiler rejects.

    KVPLAN_RECORD_KERNELS=/tmp/k.jsonl PYTHONPATH=. python -m pytest tests/ops -q
    PYTHONPATH=. python tools/compile_sm90.py /tmp/k.jsonl

``--calls`` also lists the specializations whose sm_90 code calls subroutines (cuobjdump's
``CALL``): a runtime int64 division in a hot loop shows up there (fp32 ``/`` keeps a call for
its rare slow path). ``--no-int64-div`` (CI) fails a specialization whose PTX divides 64-bit
integers at all.

Each line of the file (written by ``tests/kernel_record.py``) names a kernel by module and
function; it is imported here WITHOUT ``TRITON_INTERPRET`` so that ``@triton.jit`` yields real
JIT functions, then compiled through Triton's own pipeline down to a cubin. Exit status 1 when
any specialization fails; each failure prints the kernel, its constexprs and the first
compiler error line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvplan and tests from the root


def _constexpr_value(v):
    import triton.language as tl

    if isinstance(v, str) and v.startswith("triton.language."):  # a recorded tl.dtype repr
        return getattr(tl, v.rsplit(".", 1)[1])
    if isinstance(v, list):
        return tuple(_constexpr_value(x) for x in v)
    return v


def compile_kernel(fn, signature: dict, constexprs: dict, attrs=None, options=None):
    """Compile the JIT function ``fn`` for sm_90 down to a cubin (raises on a compiler
    error). Needs a process without ``TRITON_INTERPRET`` (real JIT functions) and Triton's
    bundled ptxas, no GPU. Also what ``tests/sm90_compile.py`` runs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_report(ptx: str) -> tuple[int, int]:
    """(registers per thread, spill store bytes) that Triton's bundled ptxas reports for
    ``ptx`` on sm_90a (no GPU needed)."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run(
            [get_ptxas(90).path, "-arch=sm_90a", "-v", str(src), "-o", str(src) + ".o"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    regs = spills = 0
    for line in res.stderr.splitlines():
        if "registers" in line:
            regs = int(line.split("Used ")[1].split(" reg")[0])
        if "spill stores" in line:
            spills = int(line.split("bytes spill stores")[0].split(",")[-1])
    return regs, spills


def sass(cubin: bytes) -> list[tuple[int, str]]:
    """The sm_90 instructions of ``cubin`` as ``(address, text)`` (Triton's bundled
    cuobjdump)."""
    import re
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        text = subprocess.run([str(tool), "-sass", fh.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    return [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,6})\*/\s+(.*?);", text)]  # fmt: skip


def sass_calls(cubin: bytes) -> int:
    """``CALL`` instructions in the sm_90 code of ``cubin``: subroutine calls such as the
    software 64-bit integer division (a division by a runtime int64 in a kernel's hot loop
    costs one such call per element)."""
    return sum(text.startswith("CALL.") or " CALL." in text for _, text in sass(cubin))


def int64_divisions(ptx: str) -> int:
    """64-bit integer divisions and remainders (``div`` / ``rem`` ``.s64`` / ``.u64``) in a
    kernel's PTX: sm_90 has no such instruction, and each is a software routine of dozens of
    instructions (a ``%`` by a runtime int64 per element cost a decode step 2 x 21.5 us on the
    H200 until session 39). An int32 operand, or a constexpr divisor, avoids them."""
    import re

    return len(re.findall(r"\b(?:div|rem)\.[su]64\b", ptx))


def _sass_loops(code: list[tuple[int, str]]) -> list[list[str]]:
    """The bodies (instruction texts) of every backward branch in ``code`` (`sass`), in
    address order: a kernel's loops, one iteration each."""
    import re

    loops = []
    for addr, text in code:
        m = re.search(r"BRA .*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            top = int(m.group(1), 16)
            loops.append([t for a, t in code if top <= a <= addr])
    return loops


def sass_longest_loop(cubin: bytes, min_body: int = 64) -> int:
    """Instructions of the longest backward branch's body in the sm_90 code of ``cubin``: a
    kernel's main loop (static count, one iteration; a called routine is not counted). A
    program whose loops are all shorter than ``min_body`` (one key tile a program, only
    small loops) counts as a whole."""
    code = sass(cubin)
    best = max((len(body) for body in _sass_loops(code)), default=0)
    return best if best >= min_body else len(code)


def sass_loop_ops(cubin: bytes, ops: tuple[str, ...]) -> list[dict[str, int]]:
    """Per loop of the sm_90 code of ``cubin`` (`_sass_loops`): its instruction count
    (``"len"``) and how many of its instructions have each opcode in ``ops`` (``"LDGSTS"``,
    ``"BAR"``, ... : the mnemonic before its first dot, a predicate ignored). For a kernel's
    main loop: what one iteration issues, e.g. which loads went through cp.async (LDGSTS) and
    which into registers (LDG)."""
    rows = []
    for body in _sass_loops(sass(cubin)):
        names = [(t.split()[1] if t.startswith("@") else t.split()[0]).split(".")[0]
                 for t in body]  # fmt: skip
        rows.append({"len": len(body), **{op: names.count(op) for op in ops}})
    return rows


def _kernel_module(name: str):
    """The module a recorded kernel lives in: an importable name, or a test file's (pytest
    imports ``tests/**/test_x.py`` as the top module ``test_x``) under its package path."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        tests = Path(__file__).resolve().parents[1] / "tests"
        found = sorted(tests.rglob(f"{name}.py"))
        if not found:
            raise
        rel = found[0].relative_to(tests.parent).with_suffix("")
        return importlib.import_module(".".join(rel.parts))


def compile_one(
    line: str, calls: bool = False, no_int64_div: bool = False
) -> tuple[str, str | None, str | None]:
    """``(label, compile error, note on subroutine calls when asked)``; with
    ``no_int64_div`` a 64-bit integer division in the code (`int64_divisions`) is an error."""
    os.environ.pop("TRITON_INTERPRET", None)
    rec = json.loads(line)
    label = f"{rec['module']}.{rec['name']}"
    try:
        fn = getattr(_kernel_module(rec["module"]), rec["name"])
        constexprs = {tuple(k): _constexpr_value(v) for k, v in rec["constexprs"]}
        attrs = {tuple(k): [tuple(a) for a in v] for k, v in rec["attrs"]}
        options = {"num_warps": rec["num_warps"], "num_stages": rec["num_stages"]}
        ck = compile_kernel(fn, rec["signature"], constexprs, attrs, options)
    except Exception as exc:  # report every failure, keep going
        first = next((s for s in str(exc).splitlines() if "error" in s), str(exc).splitlines()[0:1])
        shown = {tuple(k)[0]: v for k, v in rec["constexprs"]}
        return label, f"{type(exc).__name__}: {first} | constexprs {shown}", None
    if no_int64_div and (n := int64_divisions(ck.asm["ptx"])):
        shown = {tuple(k)[0]: v for k, v in rec["constexprs"]}
        return label, f"{n} 64-bit integer divisions / remainders | constexprs {shown}", None
    if calls and (n := sass_calls(ck.asm["cubin"])):
        shown = {tuple(k)[0]: v for k, v in rec["constexprs"]}
        return label, None, f"{n} calls | constexprs {shown}"
    return label, None, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("records", help="JSON-lines file written under KVPLAN_RECORD_KERNELS")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--calls", action="store_true",
                    help="also list the specializations whose code calls subroutines")  # fmt: skip
    ap.add_argument("--no-int64-div", action="store_true",
                    help="fail a specialization whose code divides 64-bit integers")  # fmt: skip
    args = ap.parse_args()
    with open(args.records) as fh:
        lines = sorted(set(fh.read().splitlines()) - {""})
    failures = 0
    with ProcessPoolExecutor(args.jobs) as pool:
        flags = [args.calls] * len(lines), [args.no_int64_div] * len(lines)
        for label, err, note in pool.map(compile_one, lines, *flags):
            if note:
                print(f"CALLS {label}: {note}")
            if err:
                failures += 1
                print(f"FAIL {label}: {err}")
    kernels = {json.loads(x)["name"] for x in lines}
    print(f"{len(lines)} specializations of {len(kernels)} kernels, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
