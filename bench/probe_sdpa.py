"""Which torch SDPA backend is fastest for causal prefill on this GPU, and in which layout.

Times ``F.scaled_dot_product_attention`` forced to each backend (cuDNN, flash, memory
efficient) on B fresh prompts x L tokens, with the keys as a contiguous ``[B, Hkv, L, D]``
tensor and as the transposed view of packed ``[B * L, Hkv, D]`` rows (the layout the engine
holds), GQA native (``enable_gqa``) and expanded, and torch's ``varlen_attn`` on the packed
rows. Prints one line per variant (median ms, TFLOP/s, error against the math backend on a
small slice). Usage: ``PYTHONPATH=. python bench/probe_sdpa.py [--batch 4 --len 4096]``.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvplan.ops.flash_prefill import varlen_api


def timed(fn, reps=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    B, L, H, Hkv, D = a.batch, a.len, a.heads, a.kv_heads, a.head_dim
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q_rows = torch.randn(B * L, H, D, device=dev, dtype=dt, generator=g)
    k_rows = torch.randn(B * L, Hkv, D, device=dev, dtype=dt, generator=g)
    v_rows = torch.randn(B * L, Hkv, D, device=dev, dtype=dt, generator=g)
    flops = 4 * D * H * B * L * (L + 1) / 2

    def views(expand: bool, packed: bool):
        q = q_rows.view(B, L, H, D).transpose(1, 2)
        k = k_rows.view(B, L, Hkv, D).transpose(1, 2)
        v = v_rows.view(B, L, Hkv, D).transpose(1, 2)
        if not packed:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if expand:
            k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        return q, k, v

    q, k, v = views(True, False)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(
            q[:1, :, :512].float(), k[:1, :, :512].float(), v[:1, :, :512].float(), is_causal=True
        )
    rows = []
    for name, backend in [
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("default", None),
    ]:
        for expand in (False, True):
            for packed in (False, True):
                q, k, v = views(expand, packed)
                kw = {} if expand else {"enable_gqa": True}

                def run(q=q, k=k, v=v, kw=kw, backend=backend):
                    if backend is None:
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)

                label = (
                    f"{name:9s} gqa={'expanded' if expand else 'native  '} "
                    f"layout={'packed' if packed else 'contig'}"
                )
                try:
                    out = run()
                    qs, ks, vs = q[:1, :, :512], k[:1, :, :512], v[:1, :, :512]
                    small = run(qs, ks, vs)
                    err = float((small.float() - ref).norm() / ref.norm())
                    t = timed(run)
                    del out
                    rows.append(
                        dict(variant=label, ms=t * 1e3, tflops=flops / t / 1e12, rel_err=err)
                    )
                    print(
                        f"{label}  {t * 1e3:8.3f} ms  {flops / t / 1e12:6.1f} TFLOP/s  err {err:.1e}"
                    )
                except Exception as exc:  # noqa: BLE001 - a probe reports every failure
                    rows.append(dict(variant=label, error=repr(exc)[:160]))
                    print(f"{label}  error: {repr(exc)[:160]}")
    try:
        api = varlen_api()
        if api is None:
            raise RuntimeError("torch has no varlen_attn (or neither window_size nor is_causal)")
        cu = torch.arange(B + 1, device=dev, dtype=torch.int32) * L
        # causality as kvplan.ops.flash_prefill spells it for this torch
        kw = {"window_size": (-1, 0)} if api.has_window else {"is_causal": True}
        if api.has_enable_gqa and Hkv < H:
            kw["enable_gqa"] = True

        def vl():
            return api.fn(q_rows, k_rows, v_rows, cu, cu, L, L, **kw)

        vl()
        t = timed(vl)
        rows.append(dict(variant="varlen_attn packed", ms=t * 1e3, tflops=flops / t / 1e12))
        print(f"varlen_attn packed  {t * 1e3:8.3f} ms  {flops / t / 1e12:6.1f} TFLOP/s")
    except Exception as exc:  # noqa: BLE001
        print(f"varlen_attn error: {repr(exc)[:200]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                dict(shape=dict(B=B, L=L, H=H, Hkv=Hkv, D=D), torch=torch.__version__, rows=rows),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
