"""What the host-side building blocks of ``prepare()`` cost on this machine (median us).

``prepare()`` is a few dozen numpy / torch calls; on a slow host CPU each call's fixed cost,
not the bytes it touches, sets the step time. This prints the median cost of each primitive
that ``prepare()`` uses (and of some alternatives), so a design can be costed before it is
written. Arrays are the sizes of ``bench_prepare``'s batches: 256 rows, 5,155 tokens, 10.6K
pages.

    PYTHONPATH=. python3 bench/host_primitives.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import numpy as np
import torch


def med_us(fn, iters: int = 2000) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(iters // 5):
            fn()
        samples.append((time.perf_counter_ns() - t0) / 1e3 / (iters // 5))
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    cuda = torch.cuda.is_available()
    rows, tokens, pages = 256, 5155, 10600
    lens_list = [int(x) for x in rng.integers(1, 2048, rows)]
    a_rows = np.asarray(lens_list, np.int32)
    a_tok = rng.integers(0, 1 << 20, tokens).astype(np.int32)
    idx_tok = rng.integers(0, tokens, tokens).astype(np.int64)
    a_pages = rng.integers(0, 1 << 20, pages).astype(np.int64)
    counts = np.full(rows, pages // rows, np.int64)
    out_tok = np.empty(tokens, np.int32)
    results: dict[str, float] = {}

    class Obj:
        pass

    o = Obj()
    o.x = 1
    cases = {
        "python attribute read": lambda: o.x,
        "python method call (empty)": lambda: None,
        "np.fromiter 256 ints": lambda: np.fromiter(lens_list, np.int32, rows),
        "sum(list of 256)": lambda: sum(lens_list),
        "np.cumsum 256": lambda: np.cumsum(a_rows),
        "np.max 256 (ufunc reduce)": lambda: np.maximum.reduce(a_rows),
        "np add 256": lambda: a_rows + a_rows,
        "np add 5155": lambda: a_tok + a_tok,
        "np add 5155 out=": lambda: np.add(a_tok, a_tok, out=out_tok),
        "np.take 5155 int64 idx": lambda: a_tok.take(idx_tok),
        "np.take 5155 mode=clip": lambda: a_tok.take(idx_tok, mode="clip"),
        "np.repeat 256 -> 10.6K": lambda: np.arange(rows, dtype=np.int64).repeat(counts),
        "np.take 10.6K": lambda: a_pages.take(a_pages & 8191, mode="clip"),
        "np.zeros 5155": lambda: np.zeros(tokens, np.int64),
        "np.cumsum 5155 int64": lambda: np.cumsum(idx_tok),
        "slice view numpy": lambda: a_tok[10:100],
        "torch.empty 16K int32 (pageable)": lambda: torch.empty(16384, dtype=torch.int32),
        "tensor.numpy()": lambda: out_tok.view(np.int32),
    }
    if cuda:
        dev = torch.device("cuda")
        buf = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
        pinned = torch.empty(16384, dtype=torch.int32, pin_memory=True)
        ev = torch.cuda.Event()
        ev.record()

        def pinned_copy():
            snap = torch.empty(16384, dtype=torch.int32, pin_memory=True)
            buf[:16384].copy_(snap, non_blocking=True)

        sizes = (1024, 4096, 16384, 32768, 65536)
        big = torch.zeros(max(sizes), dtype=torch.int32, device=dev)

        def pinned_step(size):
            def step():
                snap = torch.empty(size, dtype=torch.int32, pin_memory=True)
                big[:size].copy_(snap, non_blocking=True)

            return step

        for size in sizes:
            cases[f"pinned empty + copy_ {size * 4 // 1024} KB"] = pinned_step(size)
        cases.update({
            "torch.empty 16K int32 pin_memory": lambda: torch.empty(
                16384, dtype=torch.int32, pin_memory=True
            ),
            "copy_ 64 KB pinned -> device, non_blocking": lambda: buf[:16384].copy_(
                pinned, non_blocking=True
            ),
            "pinned empty + copy_ (one arena step)": pinned_copy,
            "device tensor slice": lambda: buf[:1000],
            "device tensor slice + view(int64)": lambda: buf[:1000].view(torch.int64),
            "torch.cuda.Event() create": lambda: torch.cuda.Event(),
            "event.record()": lambda: ev.record(),
            "event.query()": lambda: ev.query(),
            "torch add on device (launch)": lambda: torch.add(buf, 1),
            "torch.cumsum on device (launch)": lambda: torch.cumsum(buf[:256], 0),
        })  # fmt: skip
    for name, fn in cases.items():
        results[name] = med_us(fn)
        if cuda:
            torch.cuda.synchronize()
        print(f"{results[name]:9.2f} us  {name}")
    if args.out:
        record = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "numpy": np.__version__,
            "torch": torch.__version__,
            "us": results,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
