"""KV-cache quantization quality of the dense engine on SmolLM2, teacher-forced (CPU; or CUDA
with ``--device cuda``: ``real:`` variants against the model dtype's own cache, e.g. a bf16
model against its bf16 cache, ``--model`` a converted folder of the real weights).

The fixed text ``bench/data/kv_quality_text.txt`` is tokenized (no chat template) and run
through the engine with ``kvplan.engine.scoring.prompt_logits`` in chunks: every chunk reads
the K/V that earlier chunks (and itself) stored in the cache under test. Each variant is
compared with the fp32 cache:

* top-1 agreement: share of positions whose argmax equals the fp32 run's;
* perplexity of the text (next-token NLL over positions 1..N-1) under that cache;
* relative logit error per position ``||a - b|| / ||b||``: mean and max.

Variants:

* ``real:<kv_format>[-rotk|-norot][-w<N>]``: an engine built with that ``kv_format`` (the
  shipped path); ``-rotk``: with ``kv_rotation=True`` (Hadamard-rotated q/k,
  `kvplan.models.kv_rotation`), ``-norot`` or no suffix: without; ``-w<N>``: with
  ``kv_exact_window=N`` (each sequence's last N positions read unquantized,
  `kvplan.cache.recent_window`).
* ``fake:<spec>``: the fp32 engine whose ``KVCacheTensors.store`` first rounds K and/or V
  through ``kvplan.quant.quantize`` / ``dequantize`` (bf16 input, bf16 output, as the fp8
  cache does). ``<spec>`` =
  ``<dtype>-<sf>-<group>[-k|-v][-rk][-rv][-mk][-gk][-L<i>][-X<i>...][-s<N>][-w<R>]``: dtype e4m3 |
  e2m1 | int8 (symmetric, fp32 scale amax / 127), sf ue8m0 | e4m3 | fp32 | fp32s / e4m3s
  (searched: ``KVCacheFormat.scale_search``, as the engine's fp8 / fp4 store K), values per scale, optional "only K" / "only V", "K rotated
  by the Hadamard matrix H before rounding (and back after: the same scores as rotating q)",
  "V rotated likewise (the same output as rotating the attention output back)", ``-mk``
  "K minus the layer's mean key before rounding, added back after (the softmax is unchanged
  by a key offset shared by every key; the mean over this text's keys)", ``-gk`` "K rounded
  channel by channel with the rounding error pushed onto later channels, weighted by the
  layer's query second moment (GPTQ's update; the scored text's queries, or ``--calib-text``'s)",
  "only layer i", ``-X<i>`` (repeatable) "every layer but i".
  ``fake:bf16`` rounds to bf16 only.

  Exact positions (positions counted per layer in store order from 0 at the start of each
  variant's run: the bench scores one sequence and ``prompt_logits`` stores its chunks in
  order; "exact" = bf16 only, ``round_trip(x, None)``, for the components the spec rounds,
  the others as the spec leaves them; every other row is rounded by the same function the
  spec uses without these suffixes):

  * ``-s<N>``: attention sinks: positions ``0..N-1`` are stored exact, every later one rounded
    (``-s0``: the plain spec).
  * ``-w<R>``: a recent window (KIVI's full-precision residual): a chunk is stored exact;
    at each later store of the layer, before the new chunk (first position ``s``) is stored,
    every still-exact row at a position ``< s - R`` is re-stored rounded. A query of the
    chunk thus sees exact K/V for the ``R`` positions before the chunk plus the chunk itself:
    an effective exact window of ``R`` to ``R + chunk - 1`` positions (63 more with the
    default 64-token chunks); ``-w0`` still keeps the current chunk exact, so it is not the
    plain spec. A very large ``R`` keeps everything exact (= ``fake:bf16``).
  * both combine (``-s4-w64``): sink rows are never re-stored rounded.

``--per-layer SPEC`` adds ``fake:SPEC-L<i>`` for every layer; ``--stats`` prints the per-layer
relative RMS quantization error of K and V for a few formats (from the reference run's K/V).

Usage::

    PYTHONPATH=. python bench/kv_quality.py --max-tokens 512 --out bench/results/kv_quality.json
    PYTHONPATH=. python bench/kv_quality.py --rotation   # with / without kv_rotation
    PYTHONPATH=. python bench/kv_quality.py --device cuda --model FOLDER --variants real:fp8 \
        real:fp8-w64   # on a GPU (bench/run_s45e.sh carries the weights there)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from kvplan import LLM, EngineConfig, quant
from kvplan.engine.scoring import prompt_logits
from kvplan.formats import KVCacheFormat
from kvplan.models import kv_rotation

TEXT = Path(__file__).parent / "data" / "kv_quality_text.txt"
DEFAULT_VARIANTS = (
    "real:bf16",
    "real:fp8",
    "fake:bf16",
    "fake:e4m3-ue8m0-32",
    "fake:e4m3-ue8m0-32-k",
    "fake:e4m3-ue8m0-32-v",
    "fake:e4m3-ue8m0-16",
    "fake:e4m3-e4m3-32",
    "fake:e4m3-e4m3-16",
    "fake:e4m3-fp32-32",
    "fake:e4m3-fp32-16",
    "fake:e4m3-fp32-64",
    "fake:e4m3-fp32s-32",
    "fake:e4m3-fp32s-32-k",
    "fake:e4m3-fp32s-32-v",
    "fake:e2m1-e4m3-16",
)
ROTATION_VARIANTS = (
    "real:fp8-norot",
    "real:fp8-rotk",
    "real:fp4-norot",
    "real:fp4-rotk",
    "fake:e4m3-fp32-32",
    "fake:e4m3-fp32-32-rk",
    "fake:e4m3-fp32-32-rk-rv",
    "fake:e4m3-fp32-32-k-rk",
    "fake:e2m1-e4m3-16-rk",
    "fake:e2m1-e4m3-16-rk-rv",
)


class Spec(NamedTuple):
    layout: KVCacheFormat | tuple | None  # None: bf16 rounding only; ("int8", group)
    do_k: bool
    do_v: bool
    layer: int | None  # only this layer
    rot_k: bool = False  # round K H (H: the head_dim Hadamard matrix), store (.) H
    rot_v: bool = False
    mean_k: bool = False  # round K - mu (mu: the layer's mean key), store (.) + mu
    gptq_k: bool = False  # K rounded channel by channel with query-weighted error feedback
    skip: tuple[int, ...] = ()  # layers left unrounded (``-X<i>``, repeatable)
    sink: int = 0  # ``-s<N>``: positions 0..N-1 stored exact (bf16)
    window: int | None = None  # ``-w<R>``: rows exact until older than first-new - R


def parse_spec(spec: str, hd: int) -> Spec:
    """``<dtype>-<sf>-<group>[-k|-v][-rk][-rv][-mk][-gk][-L<i>][-X<i>...][-s<N>][-w<R>]``
    -> `Spec` (the suffixes in any order)."""
    parts = spec.split("-")
    do_k = do_v = True
    rot_k = rot_v = mean_k = gptq_k = False
    layer = None
    sink, window = 0, None
    tails = ("k", "v", "rk", "rv", "mk", "gk")
    skip: list[int] = []

    def is_tail(p: str) -> bool:
        return p in tails or p[:1] in ("L", "X") or (p[:1] in ("s", "w") and p[1:].isdigit())

    while parts and is_tail(parts[-1]):
        tail = parts.pop()
        if tail[:1] == "s":
            sink = int(tail[1:])
        elif tail[:1] == "w":
            window = int(tail[1:])
        elif tail.startswith("X"):
            skip.append(int(tail[1:]))
        elif tail == "gk":
            gptq_k = True
        elif tail == "mk":
            mean_k = True
        elif tail == "rk":
            rot_k = True
        elif tail == "rv":
            rot_v = True
        elif tail == "k":
            do_v = False
        elif tail == "v":
            do_k = False
        else:
            layer = int(tail[1:])
    rest = (do_k, do_v, layer, rot_k, rot_v, mean_k, gptq_k, tuple(skip), sink, window)
    if parts == ["bf16"]:
        return Spec(None, *rest)
    dtype, sf, group = parts
    if dtype == "int8":  # symmetric int8, one fp32 scale (amax / 127) per group: no kvplan format
        if sf != "fp32":
            raise ValueError(f"{spec}: int8 takes fp32 scales")
        return Spec(("int8", int(group)), *rest)
    search = sf in ("fp32s", "e4m3s")  # searched scales, as the engine's K (kvplan.quant)
    sf = sf[:-1] if search else sf
    if gptq_k and dtype != "e4m3":
        raise ValueError(f"{spec}: -gk is implemented for e4m3 values only")
    layout = KVCacheFormat(dtype, hd, int(group), 0, True, sf, spec, True, scale_search=search)
    return Spec(layout, *rest)


def gptq_round_keys(
    k: torch.Tensor, hq: torch.Tensor, layout: KVCacheFormat, damp: float = 0.01
) -> torch.Tensor:
    """``k [T, Hkv, D]`` rounded to e4m3 with the scales ``layout``'s writer picks for the bf16
    key (plain or searched), channel by channel: each channel's rounding error is pushed onto
    the channels after it so that the score error ``e^T Hq e`` (``hq [Hkv, D, D]``: the second
    moment of the layer's post-RoPE queries that read this KV head) is minimized greedily
    (GPTQ's update with ``H = hq + damp * mean(diag)``, queries in the role of activations).
    Returns the dequantized keys in fp32."""
    t, hkv, d = k.shape
    x = k.to(torch.bfloat16)
    _, scales = quant.quantize(x.reshape(t, hkv * d), layout)
    sf = quant.scale_factors(scales, layout)  # [T, Hkv * D / group]
    scale = sf.repeat_interleave(layout.elements_per_sf, dim=1).view(t, hkv, d).double()
    x = x.float()
    out = torch.empty_like(x)
    for h in range(hkv):
        H = hq[h].double()
        H = H + damp * H.diagonal().mean() * torch.eye(d, dtype=H.dtype)
        u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
        w = x[:, h].double().clone()
        sc = scale[:, h]
        for i in range(d):
            v = (w[:, i] / sc[:, i]).clamp(-448, 448).float().to(torch.float8_e4m3fn).double()
            qv = v * sc[:, i]
            out[:, h, i] = qv.float()
            err = (w[:, i] - qv) / u[i, i]
            w[:, i + 1 :] -= err[:, None] * u[i, i + 1 :][None, :]
    return out


def rotated_round_trip(x: torch.Tensor, layout: KVCacheFormat | None) -> torch.Tensor:
    """``round_trip(x H) H`` in fp32 (``H H = I``): the values attention sees through a
    rotated cache, rotated back."""
    return kv_rotation.rotate(round_trip(kv_rotation.rotate(x.float()), layout).float())


def round_trip(x: torch.Tensor, layout: KVCacheFormat | None) -> torch.Tensor:
    """``x [T, H, D]`` -> bf16(x) quantized and dequantized by ``layout`` (bf16 when None)."""
    xb = x.to(torch.bfloat16)
    if layout is None:
        return xb
    if isinstance(layout, tuple):  # ("int8", group)
        g = xb.float().reshape(-1, layout[1])
        sf = g.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        q = (g / sf).round().clamp(-127, 127)
        return (q * sf).to(torch.bfloat16).view(x.shape)
    flat = xb.reshape(x.shape[0], -1)
    values, scales = quant.quantize(flat, layout)
    return quant.dequantize(values, scales, layout).view(x.shape)


class FakeQuantStore:
    """Wraps an fp32 ``KVCacheTensors.store``: K/V are rounded by a spec before storing.

    Setting `spec` starts a new run: the per-layer position counters and the ``-w`` window
    rows are reset."""

    def __init__(self, kv_cache) -> None:
        self.kv = kv_cache
        self.orig = kv_cache.store
        self._spec = None
        self.captured: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self.mean_k: dict[int, torch.Tensor] = {}  # layer -> mean key [H, D] (``-mk`` specs)
        self.query_moment: dict[int, torch.Tensor] = {}  # layer -> [Hkv, D, D] (``-gk`` specs)
        self.next_pos: dict[int, int] = {}  # layer -> position of the next stored row
        # layer -> still-exact rows (k, v, slot_mapping, positions) of ``-w`` specs
        self.exact_rows: dict[int, list[tuple]] = {}
        kv_cache.store = self

    @property
    def spec(self) -> Spec | None:
        return self._spec

    @spec.setter
    def spec(self, spec: Spec | None) -> None:
        self._spec = spec
        self.next_pos = {}
        self.exact_rows = {}

    def rounded(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """``k``, ``v`` as the spec stores them (rounded K and/or V)."""
        sp = self.spec
        if sp.do_k and sp.gptq_k:
            moment = self.query_moment[layer]
            k = gptq_round_keys(k.float(), moment, sp.layout).to(torch.bfloat16)
        elif sp.do_k:
            rt = rotated_round_trip if sp.rot_k else round_trip
            if sp.mean_k:  # q.(k - mu) shifts a query's logits by one constant
                mu = self.mean_k[layer].to(k.device)
                k = (rt(k.float() - mu, sp.layout).float() + mu).to(k.dtype)
            else:
                k = rt(k, sp.layout)
        if sp.do_v:
            v = (rotated_round_trip if sp.rot_v else round_trip)(v, sp.layout)
        return k, v

    def exact(self, k: torch.Tensor, v: torch.Tensor):
        """``k``, ``v`` as an exact (sink / window) row is stored: bf16 for the components
        the spec rounds, the others unchanged (as the spec leaves them)."""
        sp = self.spec
        return (round_trip(k, None) if sp.do_k else k), (round_trip(v, None) if sp.do_v else v)

    def __call__(self, layer, k, v, slot_mapping, *, check=True):
        if self.captured is not None:
            self.captured.setdefault(layer, []).append((k.detach().clone(), v.detach().clone()))
        sp = self.spec
        if sp is None or not ((sp.layer is None or sp.layer == layer) and layer not in sp.skip):
            return self.orig(layer, k, v, slot_mapping, check=check)
        if sp.sink == 0 and sp.window is None:
            k, v = self.rounded(layer, k, v)
            return self.orig(layer, k, v, slot_mapping, check=check)
        first = self.next_pos.get(layer, 0)
        pos = torch.arange(first, first + k.shape[0])
        self.next_pos[layer] = first + k.shape[0]
        if sp.window is not None:  # rows that left the window: re-store them rounded
            kept = self.exact_rows.get(layer, [])
            keep = []
            for rk, rv, rs, rp in kept:
                stale = rp < first - sp.window
                if bool(stale.any()):
                    qk, qv = self.rounded(layer, rk[stale], rv[stale])
                    self.orig(layer, qk, qv, rs[stale], check=check)
                if not bool(stale.all()):
                    live = ~stale
                    keep.append((rk[live], rv[live], rs[live], rp[live]))
            self.exact_rows[layer] = keep
        sink = pos < sp.sink
        ek, ev = self.exact(k, v)
        if sp.window is not None:  # the whole chunk goes in exact; non-sink rows remembered
            later = ~sink
            if bool(later.any()):
                self.exact_rows.setdefault(layer, []).append(
                    (k[later].clone(), v[later].clone(), slot_mapping[later].clone(), pos[later])
                )
            return self.orig(layer, ek, ev, slot_mapping, check=check)
        if bool(sink.all()):
            return self.orig(layer, ek, ev, slot_mapping, check=check)
        qk, qv = self.rounded(layer, k, v)
        sk = sink.to(k.device)[:, None, None]
        k_out = torch.where(sk, ek.to(torch.float32), qk.to(torch.float32))
        v_out = torch.where(sk, ev.to(torch.float32), qv.to(torch.float32))
        return self.orig(layer, k_out, v_out, slot_mapping, check=check)


def capture_query_moments(model, moments: dict[int, torch.Tensor]):
    """Accumulate, per layer, ``sum q q^T`` over the post-RoPE queries of each KV head's query
    heads into ``moments[layer] [Hkv, D, D]`` while ``model`` runs (``-gk`` specs: the scored
    text's own queries, an upper bound for a calibrated moment). Returns a function that
    restores the wrapped attention forwards."""
    originals = []
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn.attn
        fwd = attn.forward

        def wrapped(q, k, v, metadata, *a, _i=i, _fwd=fwd, _hkv=attn.num_kv_heads, **kw):
            t, h, d = q.shape
            qq = q.detach().double().reshape(t, _hkv, h // _hkv, d)
            m = torch.einsum("thgd,thge->hde", qq, qq)
            moments[_i] = moments.get(_i, 0) + m
            return _fwd(q, k, v, metadata, *a, **kw)

        attn.forward = wrapped
        originals.append((attn, fwd))

    def restore() -> None:
        for attn, fwd in originals:
            attn.forward = fwd

    return restore


def metrics(logits: torch.Tensor, ref: torch.Tensor, ids: list[int]) -> dict:
    a, b = logits.float().cpu(), ref.float().cpu()
    rel = (a - b).norm(dim=-1) / b.norm(dim=-1)
    target = torch.tensor(ids[1:])
    nll = torch.nn.functional.cross_entropy(a[:-1], target)
    kl = torch.nn.functional.kl_div(
        a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="batchmean"
    )
    return {
        "top1": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
        "ppl": math.exp(float(nll)),
        "rel_err_mean": float(rel.mean()),
        "rel_err_max": float(rel.max()),
        "kl_mean": float(kl),
    }


def layer_stats(captured, hd: int) -> list[dict]:
    """Per layer: relative RMS round-trip error of K and V for a few formats, and the
    K/V outlier ratio (max |x| over the RMS of |x|)."""
    specs = ("e4m3-ue8m0-32", "e4m3-e4m3-16", "e4m3-fp32-32")
    rows = []
    for layer in sorted(captured):
        k = torch.cat([c[0] for c in captured[layer]]).float()
        v = torch.cat([c[1] for c in captured[layer]]).float()
        row = {"layer": layer}
        for name, x in (("k", k), ("v", v)):
            row[f"{name}_outlier"] = float(x.abs().max() / x.pow(2).mean().sqrt())
            for spec in specs:
                y = round_trip(x, parse_spec(spec, hd)[0]).float()
                row[f"{name}_{spec}"] = float((y - x).norm() / x.norm())
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=None, help="cut the text to N tokens")
    ap.add_argument("--chunk", type=int, default=64, help="prompt_logits chunk size")
    ap.add_argument("--variants", nargs="*", default=list(DEFAULT_VARIANTS))
    ap.add_argument(
        "--rotation", action="store_true", help="run ROTATION_VARIANTS instead of the defaults"
    )
    ap.add_argument("--per-layer", default=None, help="also fake:SPEC-L<i> for every layer")
    ap.add_argument("--stats", action="store_true", help="per-layer round-trip error table")
    ap.add_argument(
        "--calib-text",
        default=None,
        help="-gk specs: take the query moments from this text (cut to the scored length) "
        "instead of the scored text itself",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None, help="a model LLM() accepts (default: SmolLM2)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (real:... variants only)")
    ap.add_argument(
        "--dtype", default=None, help="model dtype (default: float32 on cpu, bfloat16 on cuda)"
    )
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    # the reference: the model dtype's own cache ("auto")
    ref_format = EngineConfig(device=args.device, dtype=dtype).resolve_kv_format(0)
    if args.device != "cpu" and any(not v.startswith("real:") for v in args.variants):
        raise SystemExit("--device cuda runs real:... variants only (fake: hooks the CPU store)")

    def engine(kv_format: str, kv_rotation: bool = False, kv_exact_window: int = 0) -> LLM:
        return LLM(
            *model,
            device=args.device,
            dtype=dtype,
            kv_format=kv_format,
            kv_rotation=kv_rotation,
            kv_exact_window=kv_exact_window,
            max_model_len=n + 16,
            num_blocks=(n + 16) // 16 + 4,
            enable_prefix_caching=False,
        )

    model = () if args.model is None else (args.model,)
    probe = LLM(*model, device="cpu", max_model_len=64, num_blocks=8)
    ids = probe.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    del probe
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    n = len(ids)
    ref_llm = engine("auto")
    cfg = ref_llm.parts.config
    hd = cfg.num_kv_heads * cfg.head_dim
    hook = FakeQuantStore(ref_llm.parts.kv_cache)
    wants_mean = any(v.startswith("fake:") and "-mk" in v for v in args.variants)
    hook.captured = {} if args.stats or wants_mean else None
    wants_moment = any(v.startswith("fake:") and "-gk" in v for v in args.variants)
    restore = (
        capture_query_moments(ref_llm.parts.model, hook.query_moment) if wants_moment else None
    )
    if restore is not None and args.calib_text:
        calib = ref_llm.tokenizer.encode(
            Path(args.calib_text).read_text(), add_special_tokens=False
        )
        prompt_logits(ref_llm.engine, calib[:n], args.chunk)
        restore()
        restore = None
        print(
            f"query moments from {args.calib_text} ({min(n, len(calib))} tokens)", file=sys.stderr
        )
    t0 = time.perf_counter()
    ref = prompt_logits(ref_llm.engine, ids, args.chunk)
    if restore is not None:
        restore()
    print(f"{n} tokens, fp32 reference in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    hook_captured, hook.captured = hook.captured, None
    if wants_mean:  # the mean post-RoPE key of each layer over this text (an upper bound:
        # a deployed mean would come from other text)
        hook.mean_k = {
            layer: torch.cat([k for k, _ in rows]).float().mean(0)
            for layer, rows in hook_captured.items()
        }

    variants = list(ROTATION_VARIANTS if args.rotation else args.variants)
    if args.per_layer:
        variants += [f"fake:{args.per_layer}-L{i}" for i in range(cfg.num_layers)]
    rows = [{"variant": f"real:{ref_format}", **metrics(ref, ref, ids)}]
    for name in variants:
        t0 = time.perf_counter()
        kind, spec = name.split(":", 1)
        if kind == "real":
            fmt, *tails = spec.split("-")
            window = [int(t[1:]) for t in tails if t[:1] == "w" and t[1:].isdigit()]
            rot = [t for t in tails if t in ("rotk", "norot")]
            if len(window) + len(rot) != len(tails):
                raise SystemExit(f"{name}: unknown suffix in {tails}")
            llm = engine(fmt, kv_rotation=rot == ["rotk"], kv_exact_window=sum(window))
            logits = prompt_logits(llm.engine, ids, args.chunk)
            del llm
        else:
            hook.spec = parse_spec(spec, hd)
            logits = prompt_logits(ref_llm.engine, ids, args.chunk)
            hook.spec = None
        rows.append({"variant": name, **metrics(logits, ref, ids)})
        r = rows[-1]
        print(
            f"{name}: top1 {r['top1']:.4f} ppl {r['ppl']:.3f} ({time.perf_counter() - t0:.1f} s)",
            file=sys.stderr,
        )

    where = "CPU" if args.device == "cpu" else torch.cuda.get_device_name()
    print(f"\n{n} tokens of {TEXT.name}, {args.model or 'SmolLM2-135M-Instruct'} ({dtype} model, "
          f"{where}), vs {ref_format} KV")  # fmt: skip
    print(f"| variant | top-1 vs {ref_format} | perplexity | rel. logit error mean / max | "
          "KL mean |")  # fmt: skip
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {100 * r['top1']:.2f} % | {r['ppl']:.3f} | "
            f"{r['rel_err_mean']:.4f} / {r['rel_err_max']:.4f} | {r['kl_mean']:.2e} |"
        )
    stats = layer_stats(hook_captured, hd) if args.stats and hook_captured else None
    if stats:
        keys = [k for k in stats[0] if k != "layer"]
        print("\n| layer | " + " | ".join(keys) + " |")
        print("|---" * (len(keys) + 1) + "|")
        for s in stats:
            print(f"| {s['layer']} | " + " | ".join(f"{s[k]:.4f}" for k in keys) + " |")
    if args.out:
        out = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": f"cpu ({platform.machine()})" if args.device == "cpu" else where,
            "model_dtype": dtype,
            "reference_kv": ref_format,
            "command": "python " + " ".join(sys.argv),
            "torch": torch.__version__,
            "num_tokens": n,
            "chunk": args.chunk,
            "rows": rows,
            "layer_stats": stats,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
