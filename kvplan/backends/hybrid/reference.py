"""The reference hybrid family: dense per-request history, explicit visible sets (the oracle).

`ReferenceHybridFamily(specs)` implements `kvplan.backends.hybrid.api.HybridFamily` with the
most direct code there is, slow on purpose. Per request it keeps, as plain tensors:

* per layer, every raw K=V row (``[n, D]``, position ``i`` at row ``i``);
* per compressed layer and series, every token's projections ``kv`` / ``gate`` (``[n, k*C]``)
  and every pooled entry (entry ``j`` at index ``j``).

A query row at position ``p`` of layer ``spec`` sees (`visible_rows`)::

    raw rows     max(p - W + 1, 0) .. p
    HCA entries  j < (p + 1) // r                       (every closed entry)
    CSA entries  the top min(top_k, (p+1)//r) closed entries by the indexer score
                 sum_h index_weights[h] * relu(index_q[h] . key_j)

and the attention is ``softmax([q.K^T * scale, sink_h])`` with the sink column dropped
afterwards (it only enlarges the denominator), times ``K`` (= ``V``). Each context records, per
layer, the visible set of every row (`ReferenceStepContext.visible`) as pairs ``("raw", p)`` /
``("compressed", j)``, for visibility tests.

A sequence with ``q_start == 0`` starts its request afresh; otherwise ``q_start`` must equal
the number of tokens the request already holds. Everything is computed in fp32 on the inputs'
device; results are returned in ``q``'s dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvplan._checks import check_tensor
from kvplan.backends.hybrid.api import (
    CompressWindows,
    HybridLayerSpec,
    HybridSeq,
    check_attend_inputs,
    unrotate,
)

Visible = frozenset[tuple[str, int]]


def series_names(spec: HybridLayerSpec) -> tuple[str, ...]:
    """The compressed series of a layer: none, ``("compressor",)`` or both (CSA)."""
    if spec.kind == "sliding_attention":
        return ()
    return ("compressor", "indexer") if spec.overlap else ("compressor",)


def visible_rows(
    spec: HybridLayerSpec, p: int, index_scores: torch.Tensor | None = None
) -> tuple[range, list[int]]:
    """(raw positions, compressed entry indices) that a query at position ``p`` sees.

    ``index_scores``: the indexer score of entries ``0 .. (p+1)//r - 1`` (at least that
    many; CSA only). Entries come back in increasing order.
    """
    raw = range(max(p - spec.window + 1, 0), p + 1)
    if spec.kind == "sliding_attention":
        return raw, []
    closed = (p + 1) // spec.ratio
    if spec.kind == "heavily_compressed_attention" or closed == 0:
        return raw, list(range(closed))
    if index_scores is None or index_scores.shape[0] < closed:
        raise ValueError(f"CSA visibility at position {p} needs {closed} index scores")
    top = index_scores[:closed].topk(min(spec.top_k, closed)).indices
    return raw, sorted(top.tolist())


@dataclass
class _History:
    """Everything one request has stored, per layer (and series)."""

    raw: dict[int, torch.Tensor] = field(default_factory=dict)
    rows: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    entries: dict[tuple[int, str], list[torch.Tensor]] = field(default_factory=dict)


class ReferenceStepContext:
    """One step of `ReferenceHybridFamily` (see `kvplan.backends.hybrid.api.HybridStepContext`)."""

    def __init__(
        self,
        specs: list[HybridLayerSpec],
        seqs: list[HybridSeq],
        histories: list[_History],
        positions: torch.Tensor,
    ) -> None:
        self.positions = positions
        self._specs, self._seqs, self._histories = specs, seqs, histories
        starts = [0]
        for s in seqs:
            starts.append(starts[-1] + s.seqlen_q)
        self._starts = starts
        self._pending: dict[tuple[int, str], list[tuple[int, int]]] = {}
        self._visible: dict[int, list[Visible]] = {}

    def visible(self, layer_idx: int) -> list[Visible]:
        """Per flat row of this step, what it attended in layer ``layer_idx``: pairs
        ``("raw", position)`` and ``("compressed", entry j)``. Filled by `attend`."""
        if layer_idx not in self._visible:
            raise ValueError(f"layer {layer_idx} has not attended in this step")
        return self._visible[layer_idx]

    def _spec(self, layer_idx: int) -> HybridLayerSpec:
        if not 0 <= layer_idx < len(self._specs):
            raise ValueError(f"layer_idx must be in [0, {len(self._specs)}), got {layer_idx}")
        return self._specs[layer_idx]

    def compress_windows(
        self, layer_idx: int, name: str, kv: torch.Tensor, gate: torch.Tensor
    ) -> CompressWindows:
        spec = self._spec(layer_idx)
        if name not in series_names(spec):
            raise ValueError(f"layer {layer_idx} ({spec.kind}) has no series {name!r}")
        width, r = spec.series_width(name), spec.ratio
        k = 2 if spec.overlap else 1
        num_rows = self._starts[-1]
        check_tensor("kv", kv, ndim=2, shape=(num_rows, k * width))
        check_tensor("gate", gate, ndim=2, shape=(num_rows, k * width))
        out_kv, out_gate, pos, idx, seq_idx, pending = [], [], [], [], [], []
        for i, (seq, hist) in enumerate(zip(self._seqs, self._histories)):
            t0, t1 = self._starts[i], self._starts[i + 1]
            empty = kv.new_zeros((0, k * width)), gate.new_zeros((0, k * width))
            old_kv, old_gate = hist.rows.get((layer_idx, name), empty)
            if old_kv.shape[0] != seq.q_start:
                raise ValueError(
                    f"request {seq.request_id}: layer {layer_idx} {name} holds "
                    f"{old_kv.shape[0]} rows, q_start is {seq.q_start}"
                )
            all_kv, all_gate = torch.cat((old_kv, kv[t0:t1])), torch.cat((old_gate, gate[t0:t1]))
            hist.rows[(layer_idx, name)] = (all_kv, all_gate)
            for j in range(seq.q_start // r, (seq.q_start + seq.seqlen_q) // r):
                cur = slice(j * r, (j + 1) * r)
                if not spec.overlap:
                    wkv, wgate = all_kv[cur], all_gate[cur]
                else:
                    if j == 0:
                        prev_kv = kv.new_zeros((r, width))
                        prev_gate = gate.new_full((r, width), float("-inf"))
                    else:
                        prev = slice((j - 1) * r, j * r)
                        prev_kv, prev_gate = all_kv[prev, :width], all_gate[prev, :width]
                    wkv = torch.cat((prev_kv, all_kv[cur, width:]))
                    wgate = torch.cat((prev_gate, all_gate[cur, width:]))
                out_kv.append(wkv)
                out_gate.append(wgate)
                pos.append(j * r)
                idx.append(j)
                seq_idx.append(i)
                pending.append((i, j))
        self._pending[(layer_idx, name)] = pending
        w = k * r
        dev = self.positions.device
        return CompressWindows(
            kv=torch.stack(out_kv) if out_kv else kv.new_zeros((0, w, width)),
            gate=torch.stack(out_gate) if out_gate else gate.new_zeros((0, w, width)),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            entry_index=torch.tensor(idx, dtype=torch.int64, device=dev),
            seq_index=torch.tensor(seq_idx, dtype=torch.int64, device=dev),
        )

    def store_entries(self, layer_idx: int, name: str, entries: torch.Tensor) -> None:
        spec = self._spec(layer_idx)
        if (layer_idx, name) not in self._pending:
            raise ValueError(f"store_entries({layer_idx}, {name!r}) before compress_windows")
        pending = self._pending.pop((layer_idx, name))
        check_tensor("entries", entries, ndim=2, shape=(len(pending), spec.series_width(name)))
        for e, (i, j) in enumerate(pending):
            stored = self._histories[i].entries.setdefault((layer_idx, name), [])
            assert len(stored) == j, f"entry {j} of layer {layer_idx} {name} stored out of order"
            stored.append(entries[e])

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        kv: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
        *,
        index_q: torch.Tensor | None = None,
        index_weights: torch.Tensor | None = None,
        out_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        spec = self._spec(layer_idx)
        num_rows = self._starts[-1]
        check_attend_inputs(spec, num_rows, q, kv, sinks, index_q, index_weights)
        csa = spec.kind == "compressed_sparse_attention"
        for name in series_names(spec):
            if (layer_idx, name) in self._pending:
                raise ValueError(f"attend({layer_idx}) before store_entries(.., {name!r})")
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        visible: list[Visible] = []
        for i, (seq, hist) in enumerate(zip(self._seqs, self._histories)):
            t0, t1 = self._starts[i], self._starts[i + 1]
            old = hist.raw.get(layer_idx, kv.new_zeros((0, spec.head_dim)))
            if old.shape[0] != seq.q_start:
                raise ValueError(
                    f"request {seq.request_id}: layer {layer_idx} holds {old.shape[0]} raw rows, "
                    f"q_start is {seq.q_start}"
                )
            raw = hist.raw[layer_idx] = torch.cat((old, kv[t0:t1]))
            entries = hist.entries.get((layer_idx, "compressor"), [])
            keys_idx = hist.entries.get((layer_idx, "indexer"), [])
            for t in range(t0, t1):
                p = seq.q_start + (t - t0)
                scores = None
                if csa and keys_idx:
                    keys = torch.stack(keys_idx).float()  # [E, Ci]
                    dots = torch.relu(index_q[t].float() @ keys.T)  # [Hi, E]
                    scores = (index_weights[t].float()[:, None] * dots).sum(0)  # [E]
                raw_pos, chosen = visible_rows(spec, p, scores)
                if chosen and chosen[-1] >= len(entries):
                    raise ValueError(f"layer {layer_idx}: entry {chosen[-1]} was never stored")
                rows = [raw[raw_pos.start : raw_pos.stop]] + [entries[j][None] for j in chosen]
                keys_t = torch.cat(rows).float()  # [n, D]
                logits = q[t].float() @ keys_t.T * scale  # [H, n]
                probs = torch.cat((logits, sinks.float()[:, None]), dim=1).softmax(dim=1)
                out[t] = probs[:, :-1] @ keys_t
                visible.append(
                    frozenset([("raw", x) for x in raw_pos] + [("compressed", j) for j in chosen])
                )
        self._visible[layer_idx] = visible
        return unrotate(out.to(q.dtype), out_rope)


class ReferenceHybridFamily:
    """`HybridFamily` over dense per-request histories (see the module docstring)."""

    def __init__(self, specs: Sequence[HybridLayerSpec]) -> None:
        self.specs = list(specs)
        for i, s in enumerate(self.specs):
            if not isinstance(s, HybridLayerSpec):
                raise TypeError(f"specs[{i}] must be a HybridLayerSpec, got {type(s).__name__}")
        self._requests: dict[int, _History] = {}

    def num_tokens(self, request_id: int) -> int:
        """Tokens the request holds (raw rows of the last layer; 0 if unknown)."""
        hist = self._requests.get(request_id)
        if hist is None or not self.specs:
            return 0
        raw = hist.raw.get(len(self.specs) - 1)
        return 0 if raw is None else raw.shape[0]

    def plan(self, seqs: list[HybridSeq], positions: torch.Tensor) -> ReferenceStepContext:
        check_tensor("positions", positions, dtype=torch.int64, ndim=1)
        total = sum(s.seqlen_q for s in seqs)
        if positions.shape[0] != total:
            raise ValueError(f"positions has {positions.shape[0]} rows, seqs hold {total}")
        ids = [s.request_id for s in seqs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a request appears twice in one step: {ids}")
        pos_cpu = positions.cpu().tolist()
        histories, t = [], 0
        for s in seqs:
            if s.seqlen_q < 1 or s.q_start < 0:
                raise ValueError(
                    f"request {s.request_id}: bad q_start {s.q_start} / seqlen_q {s.seqlen_q}"
                )
            want = list(range(s.q_start, s.q_start + s.seqlen_q))
            if pos_cpu[t : t + s.seqlen_q] != want:
                raise ValueError(f"request {s.request_id}: positions must be {want[0]}..{want[-1]}")
            t += s.seqlen_q
            if s.q_start == 0:
                self._requests[s.request_id] = _History()
            elif self.num_tokens(s.request_id) != s.q_start:
                raise ValueError(
                    f"request {s.request_id}: q_start {s.q_start} but the family holds "
                    f"{self.num_tokens(s.request_id)} tokens"
                )
            histories.append(self._requests[s.request_id])
        return ReferenceStepContext(self.specs, list(seqs), histories, positions)

    def free(self, request_id: int) -> None:
        self._requests.pop(request_id, None)
