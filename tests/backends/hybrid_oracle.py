"""An independent per-token oracle of the hybrid family, and a driver that feeds the planned
family and the oracle the same random step inputs.

The oracle keeps every request's full history by absolute position (raw K=V rows, the
compressor projections of every layer and series, the pooled entries) and applies
DESIGN.md's visibility rules row by row: raw keys ``max(p - W + 1, 0) .. p``; HCA entries
``j < (p + 1) // r`` pooling ``[j*r, (j+1)*r)``; CSA entries pooling ``[(j-1)*r, (j+1)*r)``
(the "Ca" half of the previous window, the "Cb" half of this one), of which the indexer's
top-k are seen. Quantized formats: every stored row passes through a scratch cache of the
same layout (``store_kv_cache`` + ``load_paged_kv_cache``).

Tags: channel 0 of every raw row is ``+(rid * 1024 + pos + 1) / 4096`` and of every main
compressed entry ``-(rid * 1024 + j + 1) / 4096``; queries have channel 0 = 0, so tags do not
change the logits, and a traced family's gathered rows name what each query row saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvplan.backends.hybrid.api import HybridLayerSpec, HybridSeq
from kvplan.formats import KVCacheFormat, alloc_kv_cache
from kvplan.ops import load_paged_kv_cache, store_kv_cache

TAG_SCALE = 1.0 / 4096


def tag(rid: int, pos: int) -> float:
    return (rid * 1024 + pos + 1) * TAG_SCALE


def untag(value: float) -> tuple[str, int, int]:
    """``(kind, rid, pos_or_j)`` of a channel-0 tag (kind "raw" / "ca" / "zero")."""
    code = round(abs(value) / TAG_SCALE)
    if code == 0:
        return ("zero", -1, -1)
    rid, pos = divmod(code - 1, 1024)
    return ("raw" if value > 0 else "ca", rid, pos)


def cast_layout(kind: str | None, width: int, index: bool) -> KVCacheFormat | None:
    """A token-interleaved, dequantizing layout with the same element math as the family's
    layout for ``kind`` (``None``: exact rows, no rounding)."""
    if kind is None:
        return None
    dtype, per_sf, sf = {
        "fp8": ("e4m3", 32, "ue8m0"),
        "fp4": ("e2m1", 16, "e4m3"),
        "mxfp8": ("e4m3", 32, "ue8m0"),
        "fp8_fp32sf": ("e4m3", width, "fp32"),
        "fp4_index": ("e2m1", 32, "ue8m0"),
    }[kind if not (index and kind == "fp4") else "fp4_index"]
    return KVCacheFormat(dtype, width, per_sf, 0, True, sf, "oracle", True)


def qdq(rows: torch.Tensor, layout: KVCacheFormat | None) -> torch.Tensor:
    """``rows`` [n, C] after a store into and a load from a scratch cache of ``layout``."""
    if layout is None or rows.shape[0] == 0:
        return rows.float()
    n = rows.shape[0]
    cache = alloc_kv_cache(1, n, layout)
    slots = torch.arange(n, dtype=torch.int32)
    store_kv_cache(rows.to(torch.bfloat16), cache, slots, layout=layout)
    segs = torch.tensor([[0, 0, n, 0]], dtype=torch.int32)
    return load_paged_kv_cache(cache, segs, n, layout=layout).float()


@dataclass
class _Request:
    raw: dict[tuple, torch.Tensor] = field(default_factory=dict)  # (layer, pos) -> [D] (qdq'd)
    proj: dict[tuple, dict[int, tuple]] = field(
        default_factory=dict
    )  # (l, name) -> pos -> kv, gate
    entries: dict[tuple, dict[int, torch.Tensor]] = field(default_factory=dict)  # -> j -> [C]


class HybridOracle:
    """Per-request dense history and per-row visibility (see the module docstring)."""

    def __init__(self, layers, window: int, main_kind: str | None, index_kind: str | None):
        self.layers = layers
        self.window = window
        self.main = {}
        self.index = {}
        for spec in layers:
            self.main[spec.head_dim] = cast_layout(main_kind, spec.head_dim, False)
            if spec.index_head_dim:
                self.index[spec.index_head_dim] = cast_layout(index_kind, spec.index_head_dim, True)
        self.requests: dict[int, _Request] = {}

    def begin_step(self, seqs: list[HybridSeq], kv: dict, proj: dict) -> None:
        """Record the step's raw rows (``kv[layer]`` [T, D]) and projections
        (``proj[(layer, name)] = (kv, gate)``), restarting requests at ``q_start == 0``."""
        t = 0
        for s in seqs:
            if s.q_start == 0:
                self.requests[s.request_id] = _Request()
            req = self.requests[s.request_id]
            for layer, spec in enumerate(self.layers):
                rows = qdq(kv[layer][t : t + s.seqlen_q], self.main[spec.head_dim])
                for k in range(s.seqlen_q):
                    req.raw[(layer, s.q_start + k)] = rows[k]
            for key, (pkv, pgate) in proj.items():
                hist = req.proj.setdefault(key, {})
                for k in range(s.seqlen_q):
                    hist[s.q_start + k] = (pkv[t + k].float(), pgate[t + k].float())
            t += s.seqlen_q

    def windows(self, seqs, layer: int, name: str):
        """Expected ``(kv [E, w, C], gate, positions, entry_index, seq_index)``."""
        spec = self.layers[layer]
        r, width = spec.ratio, spec.series_width(name)
        kvs, gates, pos, js, si = [], [], [], [], []
        for i, s in enumerate(seqs):
            hist = self.requests[s.request_id].proj[(layer, name)]
            for p in range(s.q_start, s.q_start + s.seqlen_q):
                if (p + 1) % r:
                    continue
                j = p // r
                wk, wg = [], []
                if spec.overlap:
                    for x in range((j - 1) * r, j * r):
                        if x < 0:
                            wk.append(torch.zeros(width))
                            wg.append(torch.full((width,), float("-inf")))
                        else:
                            wk.append(hist[x][0][:width])
                            wg.append(hist[x][1][:width])
                for x in range(j * r, (j + 1) * r):
                    lo = width if spec.overlap else 0
                    wk.append(hist[x][0][lo : lo + width])
                    wg.append(hist[x][1][lo : lo + width])
                kvs.append(torch.stack(wk))
                gates.append(torch.stack(wg))
                pos.append(j * r)
                js.append(j)
                si.append(i)
        w = 2 * r if spec.overlap else r
        empty = torch.zeros(0, w, width)
        return (
            torch.stack(kvs) if kvs else empty,
            torch.stack(gates) if gates else empty,
            pos,
            js,
            si,
        )

    def store_entries(self, seqs, layer, name, js, si, entries: torch.Tensor) -> None:
        spec = self.layers[layer]
        width = spec.series_width(name)
        layout = self.index[width] if name == "indexer" else self.main[width]
        rows = qdq(entries, layout)
        for e, (j, i) in enumerate(zip(js, si, strict=True)):
            req = self.requests[seqs[i].request_id]
            req.entries.setdefault((layer, name), {})[j] = rows[e]

    def attend(self, seqs, layer, q, sinks, scale, index_q=None, index_weights=None):
        """``(out [T, H, D] fp32, visible)``; ``visible[t]`` = (raw positions, entries)."""
        spec = self.layers[layer]
        outs, visible = [], []
        t = 0
        for s in seqs:
            req = self.requests[s.request_id]
            for k in range(s.seqlen_q):
                p = s.q_start + k
                raw = list(range(max(p - self.window + 1, 0), p + 1))
                rows = [req.raw[(layer, x)] for x in raw]
                chosen: list[int] = []
                if spec.kind != "sliding_attention":
                    n = (p + 1) // spec.ratio
                    chosen = list(range(n))
                    if spec.overlap and n:
                        keys = torch.stack([req.entries[(layer, "indexer")][j] for j in range(n)])
                        dots = (index_q[t].float() @ keys.T).relu()  # [Hi, n]
                        score = (index_weights[t].float()[:, None] * dots).sum(0)
                        order = sorted(range(n), key=lambda j: -float(score[j]))
                        chosen = sorted(order[: min(spec.top_k, n)])
                    rows += [req.entries[(layer, "compressor")][j] for j in chosen]
                kv = torch.stack(rows)  # [K, D]
                logits = (q[t].float() @ kv.T) * scale  # [H, K]
                full = torch.cat([logits, sinks.float()[:, None]], dim=1)
                prob = torch.softmax(full, dim=1)[:, :-1]
                outs.append(prob @ kv)
                visible.append((set(raw), set(chosen)))
                t += 1
        return torch.stack(outs), visible


def make_layers(kinds: list[str], window: int, ratios: dict, *, head_dim=32, index_dim=16,
                num_heads=2, num_index_heads=8, top_k=3) -> list[HybridLayerSpec]:  # fmt: skip
    out = []
    for kind in kinds:
        csa = kind == "compressed_sparse_attention"
        out.append(
            HybridLayerSpec(
                kind=kind,
                window=window,
                ratio=ratios.get(kind, 0),
                top_k=top_k if csa else 0,
                head_dim=head_dim,
                index_head_dim=index_dim if csa else 0,
                num_heads=num_heads,
                num_index_heads=num_index_heads if csa else 0,
            )
        )
    return out


def rid_rows(seqs: list[HybridSeq]) -> tuple[np.ndarray, np.ndarray]:
    """Per step row: request id and absolute position."""
    rid = np.concatenate([np.full(s.seqlen_q, s.request_id) for s in seqs])
    pos = np.concatenate([np.arange(s.q_start, s.q_start + s.seqlen_q) for s in seqs])
    return rid, pos


def pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The test's pooling: per-channel softmax over the window rows of ``gate`` times ``kv``."""
    return (kv.float() * torch.softmax(gate.float(), dim=1)).sum(dim=1)


class Driver:
    """Runs step schedules on a planned family and the oracle with the same random inputs
    and compares every ``compress_windows`` and ``attend`` result (and, when the family
    traces, every query row's visible set)."""

    def __init__(self, family, oracle: HybridOracle, *, seed: int, atol: float, rtol: float):
        self.family, self.oracle = family, oracle
        self.layers = oracle.layers
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.atol, self.rtol = atol, rtol
        cfg = family.config
        self.free_blocks = list(self.rng.permutation(np.arange(1, cfg.num_kv_blocks)))
        self.free_slots = list(self.rng.permutation(cfg.num_state_slots))
        self.tables: dict[int, list[int]] = {}
        self.slots: dict[int, int] = {}
        self.width = cfg.max_num_blocks
        self.sinks = [torch.randn(s.num_heads, generator=self.gen) for s in self.layers]
        self.rows_checked = 0

    def _randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def seq(self, rid: int, q_start: int, seqlen_q: int, new_slot: bool = False) -> HybridSeq:
        if rid not in self.slots or new_slot:
            if rid in self.slots:
                self.free_slots.append(self.slots[rid])
                self.family.free(rid)
            self.slots[rid] = self.free_slots.pop(0)
            self.tables.setdefault(rid, [int(self.free_blocks.pop()) for _ in range(self.width)])
        n = q_start + seqlen_q
        return HybridSeq(rid, q_start, seqlen_q, [0] * n, self.tables[rid], self.slots[rid])

    def step(self, seqs: list[HybridSeq]) -> None:
        fam, oracle = self.family, self.oracle
        rid, pos = rid_rows(seqs)
        num = len(pos)
        tags = torch.tensor([tag(int(a), int(b)) for a, b in zip(rid, pos, strict=True)])
        dev = fam.device
        ctx = fam.plan(seqs, torch.from_numpy(pos).long().to(dev))
        kv = {}
        proj = {}
        for layer, spec in enumerate(self.layers):
            kv[layer] = self._randn(num, spec.head_dim)
            kv[layer][:, 0] = tags
            if spec.kind != "sliding_attention":
                k = 2 if spec.overlap else 1
                for name in ("compressor", "indexer")[:k]:
                    w = k * spec.series_width(name)
                    proj[(layer, name)] = (self._randn(num, w), self._randn(num, w))
        oracle.begin_step(seqs, kv, proj)
        for layer, spec in enumerate(self.layers):
            index_q = index_w = None
            if spec.kind != "sliding_attention":
                names = ("compressor", "indexer") if spec.overlap else ("compressor",)
                for name in names:
                    pkv, pgate = proj[(layer, name)]
                    got = ctx.compress_windows(layer, name, pkv.to(dev), pgate.to(dev))
                    got = type(got)(*(x.cpu() for x in got))
                    wkv, wgate, wpos, js, si = oracle.windows(seqs, layer, name)
                    torch.testing.assert_close(got.kv, wkv, atol=0, rtol=0)
                    torch.testing.assert_close(got.gate, wgate, atol=0, rtol=0)
                    assert got.positions.tolist() == wpos
                    assert got.entry_index.tolist() == js
                    assert got.seq_index.tolist() == si
                    entries = pool(wkv, wgate)
                    if name == "compressor":
                        for e, (j, i) in enumerate(zip(js, si, strict=True)):
                            entries[e, 0] = -tag(seqs[i].request_id, j)
                    ctx.store_entries(layer, name, entries.to(dev))
                    oracle.store_entries(seqs, layer, name, js, si, entries)
                if spec.overlap:
                    index_q = self._randn(num, spec.num_index_heads, spec.index_head_dim)
                    index_w = self._randn(num, spec.num_index_heads)
            q = self._randn(num, spec.num_heads, spec.head_dim)
            q[..., 0] = 0.0
            scale = spec.head_dim**-0.5
            sinks = self.sinks[layer]
            iq, iw = (None, None) if index_q is None else (index_q.to(dev), index_w.to(dev))
            out = ctx.attend(layer, q.to(dev), kv[layer].to(dev), sinks.to(dev), scale,
                             index_q=iq, index_weights=iw).cpu()  # fmt: skip
            ref, visible = oracle.attend(seqs, layer, q, sinks, scale, index_q, index_w)
            assert out.dtype == q.dtype and out.shape == q.shape
            torch.testing.assert_close(out, ref, atol=self.atol, rtol=self.rtol)
            if fam.trace:
                rows, index = ctx.traces[layer]
                self._check_visible((rows.cpu(), index.cpu()), rid, visible, layer)

    def _check_visible(self, trace, rid, visible, layer) -> None:
        rows, index = trace
        for t in range(index.shape[0]):
            ids = index[t][index[t] >= 0].long()
            raw, ca = set(), set()
            for v in rows[ids, 0].tolist():
                kind, r, x = untag(v)
                assert kind != "zero" and r == rid[t], (layer, t, kind, r, x)
                target = raw if kind == "raw" else ca
                assert x not in target, f"layer {layer} row {t}: {kind} {x} twice"
                target.add(x)
            assert (raw, ca) == visible[t], (layer, t, raw, ca, visible[t])
            self.rows_checked += 1
