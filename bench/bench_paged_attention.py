"""Paged attention benchmark: decode KV bandwidth vs a device copy, and a prefill case.

Decode (default: batch 64 x 4096 context, bf16, 32 query heads / 8 KV heads x 128, block 32,
shuffled page table): KV bytes read per second by the Triton decode kernel, as a ratio to a
device-to-device copy of the same number of bytes measured in the same run (the copy moves
2N bytes -- N read + N written -- and both ratios are reported), next to torch SDPA on
pre-gathered contiguous KV and "gather + SDPA" (what the vanilla backend does). A small
sweep over (num_splits, tile_n, num_warps, num_stages) is recorded too; every swept config's
output is checked against SDPA.

Prefill: 4 fresh prompts x 4096 tokens (causal), same heads: the Triton varlen prefill
kernel over the paged cache, the two paths the backends take for rows with no cached history
through ``prefill_fresh_rows`` into a preallocated output (``sdpa_engine``:
``kvplan.ops.sdpa_prefill``, SDPA per run of equal-length prompts on views of the packed
rows; ``flash_engine``: ``kvplan.ops.flash_prefill``, torch's varlen flash attention, also
timed alone as ``flash_op``), and SDPA on contiguous tensors; TFLOP/s and the time ratio to
SDPA. ``--prefill-shapes 32x8192`` adds shapes.

GPU:  PYTHONPATH=. python3 bench/bench_paged_attention.py --out results.json
      PYTHONPATH=. python3 bench/bench_paged_attention.py --prefill-only --no-sweep
          --prefill-shapes 32x8192 --out prefill.json   (one command line)
CPU:  PYTHONPATH=. python3 bench/bench_paged_attention.py --quick   (interpreter, tiny sizes)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kvplan.ops is imported

import torch.nn.functional as F  # noqa: E402

from kvplan.backends.fresh_prefill import prefill_fresh_rows  # noqa: E402
from kvplan.backends.page_table_attention import PagedSegment  # noqa: E402
from kvplan.ops.flash_prefill import flash_prefill, flash_prefill_unsupported  # noqa: E402
from kvplan.ops.paged_attention import (  # noqa: E402
    paged_attention_decode_triton,
    paged_attention_prefill_triton,
)


def timed(fn, reps: int, warmup: int, inner: int = 10, graph: bool = False) -> float:
    """Median seconds per call. On GPU each sample times ``inner`` back-to-back calls between
    two CUDA events, so the host-side launch cost (argument checks) overlaps the kernels
    instead of being counted (``graph``: the ``inner`` calls captured once as a CUDA graph and
    replayed, as an engine's decode step runs them: small calls whose eager launch outlasts
    the kernel time the kernel); on CPU a sample is one call timed with perf_counter."""
    for _ in range(warmup):
        fn()
    times = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        run = None
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(inner):
                    fn()
            g.replay()
            run = g.replay
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if run is not None:
                run()
            else:
                for _ in range(inner):
                    fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / inner)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_paged(batch, kv_len, num_kv_heads, head_dim, block_size, dtype, device, gen):
    """Random cache with a shuffled block-offsets page table (block 0 kept as padding)."""
    pages = -(-kv_len // block_size)
    num_blocks = batch * pages + 1
    k_cache = torch.randn(
        num_blocks, block_size, num_kv_heads, head_dim, device=device, dtype=dtype
    )
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks - 1, generator=gen).to(device) + 1
    table = perm.view(batch, pages).to(torch.int32)
    page_start = torch.arange(batch, device=device, dtype=torch.int32) * pages
    kv_lens = torch.full((batch,), kv_len, device=device, dtype=torch.int32)
    return k_cache, v_cache, table, page_start, kv_lens


def gather(cache, table, kv_len):
    """[num_blocks, bs, Hkv, D] + [B, pages] -> contiguous [B, Hkv, kv_len, D]."""
    g = cache[table.long()].flatten(1, 2)[:, :kv_len]  # [B, L, Hkv, D]
    return g.transpose(1, 2).contiguous()


def sdpa(q, k, v, causal):
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except (TypeError, RuntimeError):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@contextlib.contextmanager
def env_set(name: str, value: str):
    """``os.environ[name] = value`` inside the block, restored after."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def bench_decode(args, device, dtype, gen):
    B, L, Hkv, D, H = args.batch, args.context, args.kv_heads, args.head_dim, args.heads
    k_cache, v_cache, table, page_start, kv_lens = make_paged(
        B, L, Hkv, D, args.block_size, dtype, device, gen
    )
    page_ids = table.flatten()
    q = torch.randn(B, H, D, device=device, dtype=dtype)
    scale = D**-0.5
    kv_bytes = 2 * B * L * Hkv * D * k_cache.element_size()
    reps, warm = args.reps, args.warmup

    src = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t_copy = timed(lambda: dst.copy_(src), reps, warm)

    k_c, v_c = gather(k_cache, table, L), gather(v_cache, table, L)  # [B, Hkv, L, D]
    q4 = q[:, :, None, :]  # [B, H, 1, D]
    ref = sdpa(q4, k_c, v_c, False)[:, :, 0]
    t_sdpa = timed(lambda: sdpa(q4, k_c, v_c, False), reps, warm)
    t_gather_sdpa = timed(
        lambda: sdpa(q4, gather(k_cache, table, L), gather(v_cache, table, L), False), reps, warm
    )

    def run(**kw):
        return paged_attention_decode_triton(
            q, k_cache, v_cache, page_ids, page_start, kv_lens, scale=scale, max_kv_len=L,
            check=False, **kw,
        )  # fmt: skip

    default_err = rel_err(run(), ref)
    t_default = timed(run, reps, warm)
    sweep = []
    for cfg in args.decode_sweep:
        splits, tile_n, warps, stages = cfg
        kw = dict(num_splits=splits, tile_n=tile_n, num_warps=warps, num_stages=stages)
        try:
            err = rel_err(run(**kw), ref)
            t = timed(lambda kw=kw: run(**kw), reps, warm)
        except Exception as exc:  # a config that does not compile is recorded, not fatal
            sweep.append(dict(config=kw, error=repr(exc)[:200]))
            print(f"  decode {kw}: failed {exc!r:.200}", flush=True)
            continue
        sweep.append(dict(config=kw, seconds=t, kv_read_GBps=kv_bytes / t / 1e9, rel_err=err))
        print(f"  decode {kw}: {t * 1e3:.3f} ms {kv_bytes / t / 1e9:.0f} GB/s err {err:.1e}",
              flush=True)  # fmt: skip
    ok = [s for s in sweep if "seconds" in s and s["rel_err"] < 1e-2]
    best = min(ok, key=lambda s: s["seconds"]) if ok else None
    copy_total = 2 * kv_bytes / t_copy
    res = dict(
        shape=dict(
            batch=B,
            context=L,
            heads=H,
            kv_heads=Hkv,
            head_dim=D,
            block_size=args.block_size,
            dtype=str(dtype),
        ),  # fmt: skip
        kv_bytes=kv_bytes,
        copy=dict(seconds=t_copy, read_GBps=kv_bytes / t_copy / 1e9, total_GBps=copy_total / 1e9),
        sdpa_contiguous=dict(seconds=t_sdpa, kv_read_GBps=kv_bytes / t_sdpa / 1e9),
        gather_sdpa=dict(seconds=t_gather_sdpa, kv_read_GBps=kv_bytes / t_gather_sdpa / 1e9),
        triton_default=dict(
            seconds=t_default, kv_read_GBps=kv_bytes / t_default / 1e9, rel_err=default_err
        ),  # fmt: skip
        triton_best=best,
        sweep=sweep,
    )
    for name in ("triton_default", "sdpa_contiguous", "gather_sdpa"):
        res[name]["ratio_to_copy_total"] = res[name]["kv_read_GBps"] * 1e9 / copy_total
        res[name]["ratio_to_copy_read"] = res[name]["kv_read_GBps"] / res["copy"]["read_GBps"]
    if best is not None:
        best["ratio_to_copy_total"] = best["kv_read_GBps"] * 1e9 / copy_total
        best["ratio_to_copy_read"] = best["kv_read_GBps"] / res["copy"]["read_GBps"]
    return res


def bench_prefill(args, device, dtype, gen, batch=None, length=None, sweep_configs=None):
    """Causal prefill of ``batch`` fresh prompts x ``length`` tokens: the Triton paged kernel,
    the SDPA and flash paths as the backends run them through ``prefill_fresh_rows`` into a
    preallocated output (each with the other switched off), the flash op alone, and SDPA on
    contiguous ``[B, H, L, D]`` tensors, each as TFLOP/s and as a time ratio to SDPA."""
    B = args.prefill_batch if batch is None else batch
    L = args.prefill_len if length is None else length
    Hkv, D, H = args.kv_heads, args.head_dim, args.heads
    k_cache, v_cache, table, page_start, kv_lens = make_paged(
        B, L, Hkv, D, args.block_size, dtype, device, gen
    )
    q = torch.randn(B * L, H, D, device=device, dtype=dtype)
    cu = torch.arange(B + 1, device=device, dtype=torch.int32) * L
    scale = D**-0.5
    flops = 4 * D * H * B * L * (L + 1) / 2  # QK^T and PV over the causal triangle
    k_c, v_c = gather(k_cache, table, L), gather(v_cache, table, L)  # [B, Hkv, L, D]
    q4 = q.view(B, L, H, D).transpose(1, 2)
    ref = sdpa(q4, k_c, v_c, True).transpose(1, 2).reshape(B * L, H, D)
    t_sdpa = timed(lambda: sdpa(q4, k_c, v_c, True), args.reps, args.warmup)
    # the step's fresh K/V rows [B * L, Hkv, D], as the engine holds them before the store
    k_new = k_c.transpose(1, 2).reshape(B * L, Hkv, D)
    v_new = v_c.transpose(1, 2).reshape(B * L, Hkv, D)

    def run(**kw):
        return paged_attention_prefill_triton(
            q, k_cache, v_cache, table.flatten(), page_start, cu, kv_lens, scale=scale,
            max_q_len=L, check=False, **kw,
        )  # fmt: skip

    sweep = []
    for tile_m, tile_n, warps, stages in sweep_configs or []:
        kw = dict(tile_m=tile_m, tile_n=tile_n, num_warps=warps, num_stages=stages)
        try:
            err = rel_err(run(**kw), ref)
            t = timed(lambda kw=kw: run(**kw), args.reps, args.warmup)
        except Exception as exc:
            sweep.append(dict(config=kw, error=repr(exc)[:200]))
            continue
        sweep.append(dict(config=kw, seconds=t, tflops=flops / t / 1e12, rel_err=err))

    def entry(t, err):
        return dict(seconds=t, tflops=flops / t / 1e12, rel_err=err, ratio_to_sdpa=t_sdpa / t)

    res = dict(
        shape=dict(batch=B, q_len=L, kv_len=L, heads=H, kv_heads=Hkv, head_dim=D, dtype=str(dtype)),
        flops=flops,
        sdpa_contiguous=dict(seconds=t_sdpa, tflops=flops / t_sdpa / 1e12, ratio_to_sdpa=1.0),
        triton_default=entry(timed(run, args.reps, args.warmup), rel_err(run(), ref)),
        sweep=sweep,
    )
    seg = PagedSegment(table.flatten(), page_start, kv_lens, cu, B * L, L, L,
                       np.arange(B + 1, dtype=np.int32) * L, 0)  # fmt: skip
    out = torch.empty_like(q)

    def engine_path():
        res = prefill_fresh_rows(
            q, k_new, v_new, k_cache, v_cache, seg, scale=scale, window=None, out=out,
            kv_layout=None, check=False,
        )  # fmt: skip
        assert res is not None, "prefill_fresh_rows fell back to the paged kernel"
        return res

    # each engine entry with the other fresh-row path switched off, so it measures its own
    for key, sdpa_on, flash_on in (("sdpa_engine", "1", "0"), ("flash_engine", "0", "1")):
        with env_set("KVPLAN_PREFILL_SDPA", sdpa_on), env_set("KVPLAN_PREFILL_FLASH", flash_on):
            try:
                err = rel_err(engine_path(), ref)
            except AssertionError as exc:
                res[key] = dict(unsupported=str(exc))
                continue
            res[key] = entry(timed(engine_path, args.reps, args.warmup), err)
    why = flash_prefill_unsupported(
        q, k_new, v_new, cache_dtype=k_cache.dtype, quantized_cache=False, sliding_window=None,
        max_q_len=L,
    )  # fmt: skip
    flash_op = (lambda: flash_prefill(q, k_new, v_new, cu, L, scale=scale)) if why is None else None
    if flash_op is not None and flash_op() is None:
        why = "varlen_attn failed at first use"
    if why is not None:
        res["flash"] = dict(unsupported=why)
        return res
    res["flash_op"] = entry(timed(flash_op, args.reps, args.warmup), rel_err(flash_op(), ref))
    return res


def print_prefill(pre) -> None:
    sh = pre["shape"]
    print(f"prefill B={sh['batch']} x {sh['q_len']} causal, H={sh['heads']}/{sh['kv_heads']}"
          f"x{sh['head_dim']} {sh['dtype']}")  # fmt: skip
    print(f"  {'path':<26}{'ms':>10}{'TFLOP/s':>10}{'sdpa_t/t':>10}{'rel err':>10}")
    for name, key in (("sdpa (contiguous)", "sdpa_contiguous"), ("triton paged", "triton_default"),
                      ("sdpa engine path", "sdpa_engine"),
                      ("flash op (varlen_attn)", "flash_op"),
                      ("flash engine path", "flash_engine")):  # fmt: skip
        r = pre.get(key)
        if r and "unsupported" in r:
            print(f"  {name:<26} unsupported: {r['unsupported']}")
        elif r:
            err = f"{r['rel_err']:10.1e}" if "rel_err" in r else f"{'-':>10}"
            print(f"  {name:<26}{r['seconds'] * 1e3:10.3f}{r['tflops']:10.0f}"
                  f"{r['ratio_to_sdpa']:10.2f}{err}")  # fmt: skip
    if "flash" in pre:
        print(f"  flash path unsupported here: {pre['flash']['unsupported']}")
    for sw in pre["sweep"]:
        if "seconds" in sw:
            print(f"  triton {sw['config']}: {sw['seconds'] * 1e3:.3f} ms err {sw['rel_err']:.1e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the JSON record here")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU interpreter)")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--prefill-only", action="store_true", help="skip the decode benchmark")
    p.add_argument(
        "--prefill-shapes", default="",
        help="extra prefill shapes BxL, comma separated (e.g. 32x8192), after the default one",
    )  # fmt: skip
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.quick or not cuda:
        sizes = dict(batch=2, context=100, heads=4, kv_heads=2, head_dim=16, block_size=16,
                     prefill_batch=1, prefill_len=40, reps=2, warmup=1)  # fmt: skip
        decode_sweep = [(2, 32, 4, 2)]
        prefill_sweep = [(16, 16, 4, 2)]
    else:
        sizes = dict(batch=64, context=4096, heads=32, kv_heads=8, head_dim=128, block_size=32,
                     prefill_batch=4, prefill_len=4096, reps=15, warmup=3)  # fmt: skip
        # (num_splits, tile_n, num_warps, num_stages); each new (tile_n, warps, stages) costs a
        # compile (~2-4 s), other split counts reuse it.
        decode_sweep = [(s, 64, 4, 3) for s in (1, 2, 4, 8, 16)]
        decode_sweep += [(s, 64, 4, 2) for s in (1, 2, 4, 8)]
        decode_sweep += [(s, 32, 4, 3) for s in (1, 2, 4, 8)]
        decode_sweep += [(2, 128, 4, 2), (4, 128, 4, 2), (4, 32, 4, 4), (4, 64, 8, 3)]
        prefill_sweep = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 2)]
    for key, val in sizes.items():
        setattr(args, key, val)
    args.decode_sweep = [] if args.no_sweep else decode_sweep
    args.prefill_sweep = [] if args.no_sweep else prefill_sweep
    if args.prefill_shapes and not cuda:
        raise SystemExit("--prefill-shapes needs a GPU (the CPU run is the tiny --quick case)")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    record = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name() if cuda else "cpu (triton interpreter)",
        command="PYTHONPATH=. python3 " + " ".join(sys.argv),
        torch=torch.__version__,
    )
    if not args.prefill_only:
        record["decode"] = dec = bench_decode(args, device, dtype, gen)
        _write(args.out, record)  # keep the decode figures even if the prefill part is cut short
        print_decode(args, dec)
    record["prefill"] = pre = bench_prefill(
        args, device, dtype, gen, sweep_configs=args.prefill_sweep
    )
    _write(args.out, record)
    print_prefill(pre)
    record["prefill_shapes"] = []
    for shape in filter(None, args.prefill_shapes.split(",")):
        batch, length = (int(x) for x in shape.lower().split("x"))
        torch.cuda.empty_cache() if cuda else None
        record["prefill_shapes"].append(bench_prefill(args, device, dtype, gen, batch, length))
        _write(args.out, record)
        print_prefill(record["prefill_shapes"][-1])
    return 0


def print_decode(args, dec) -> None:
    c = dec["copy"]
    print(f"decode  B={args.batch} L={args.context} H={args.heads}/{args.kv_heads}x{args.head_dim}"
          f"  KV {dec['kv_bytes'] / 2**20:.0f} MiB")  # fmt: skip
    print(f"  {'path':<22}{'ms':>9}{'KV GB/s':>10}{'/copy(r+w)':>12}{'/copy(read)':>12}")
    print(f"  {'d2d copy':<22}{c['seconds'] * 1e3:9.3f}{c['total_GBps']:10.0f}{'(r+w)':>12}"
          f"{c['read_GBps']:12.0f}")  # fmt: skip
    rows = [("triton (default)", dec["triton_default"]), ("triton (best sweep)", dec["triton_best"]),
            ("sdpa contiguous", dec["sdpa_contiguous"]), ("gather + sdpa", dec["gather_sdpa"])]  # fmt: skip
    for name, r in rows:
        if r:
            print(f"  {name:<22}{r['seconds'] * 1e3:9.3f}{r['kv_read_GBps']:10.0f}"
                  f"{r['ratio_to_copy_total']:12.2f}{r['ratio_to_copy_read']:12.2f}")  # fmt: skip
    if dec["triton_best"]:
        print(f"  best config: {dec['triton_best']['config']}")


def _write(path: str | None, record: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
