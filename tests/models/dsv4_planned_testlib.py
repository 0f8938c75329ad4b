"""Drivers for DeepSeek-V4 on the planned hybrid family, and Hugging Face with quantized KV rows.

* `PlannedRunner(model, ...)` -- a `PlannedHybridFamily` for the model's layers plus the
  bookkeeping an engine would do: block tables from a pool of blocks (block 0 reserved), state
  slots, preemption (``preempt`` gives both back, so the next request reuses them); ``step``
  runs one flat step and, when tracing, names what each query row attended;
* `qdq(rows, layout)` -- rows after a store into and a load from a scratch cache of ``layout``;
* `quantized_hf(hf, kv_format, index_format)` -- a context in which HF's full forward sees
  exactly the rows the family stores, quantized: raw K=V rows (the keys handed to the
  attention function), compressed entries (the compressors' outputs) and the indexer's keys
  (the scorer's input).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import transformers as tf
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_dsv4

from kvplan.backends.hybrid.api import HybridSeq
from kvplan.backends.hybrid.planned import PlannedHybridFamily
from kvplan.backends.hybrid.storage import index_format, main_format
from kvplan.formats import KVCacheFormat, alloc_kv_cache
from kvplan.ops import load_paged_kv_cache, store_kv_cache


def qdq(rows: torch.Tensor, layout: KVCacheFormat) -> torch.Tensor:
    """fp32 ``[n, C]``: ``rows`` rounded to BF16, stored into a scratch cache of ``layout``'s
    element math (made dequantizing on load) and loaded back."""
    shape = rows.shape
    flat = rows.reshape(-1, shape[-1])
    n = flat.shape[0]
    if n == 0:
        return rows.float()
    cast = dataclasses.replace(layout, do_cast=True, token_interleaved=True)
    cache = alloc_kv_cache(1, n, cast)
    store_kv_cache(flat.to(torch.bfloat16), cache, torch.arange(n, dtype=torch.int32), layout=cast)
    segs = torch.tensor([[0, 0, n, 0]], dtype=torch.int32)
    return load_paged_kv_cache(cache, segs, n, layout=cast).float().reshape(shape)


@contextlib.contextmanager
def quantized_hf(hf: tf.DeepseekV4ForCausalLM, kv_format: str, index_kind: str | None,
                 rows=None):  # fmt: skip
    """HF's model whose stored rows pass through `qdq` with the family's layouts.

    ``rows(layer, series)`` (optional; series ``"raw"``, ``"compressor"``, ``"indexer"``):
    the rows the kvplan model handed the family for this sequence, ``[n, C]`` in position /
    entry order. Each hook then checks that HF's own rows equal them within fp32 noise
    (1e-5) and quantizes the family's rows instead of its own: a rounding boundary (BF16,
    or an e4m3 scale of FP4) can otherwise flip on that noise and move a whole scale group.
    """
    cfg = hf.config
    main = main_format(kv_format, cfg.head_dim, torch.float32)
    index = index_format(kv_format, index_kind, cfg.index_head_dim, torch.float32)

    def same_rows(own: torch.Tensor, layer: int, series: str) -> torch.Tensor:
        if rows is None:
            return own
        theirs = rows(layer, series).reshape(own.shape).to(own.dtype)
        torch.testing.assert_close(own, theirs, atol=1e-5, rtol=1e-5, msg=f"{layer} {series}")
        return theirs

    def attention(module, query, key, value, mask, **kw):
        # key = [raw rows of this forward | compressed entries]; only the raw rows are new here
        n = query.shape[2]
        raw = same_rows(key[:, :, :n], module.layer_idx, "raw")
        key = torch.cat([qdq(raw, main).to(key.dtype), key[:, :, n:]], dim=2)
        return hf_dsv4.eager_attention_forward(module, query, key, key, mask, **kw)

    def entries(layer: int):
        def hook(mod, args, out):
            own = same_rows(out[0], layer, "compressor")
            return (qdq(own, main).to(out[0].dtype), *out[1:])

        return hook

    def index_keys(layer: int):
        def hook(mod, args):
            q, keys, hidden = args
            return q, qdq(same_rows(keys, layer, "indexer"), index).to(keys.dtype), hidden

        return hook

    name = "kvplan_qdq_test"
    tf.AttentionInterface.register(name, attention)
    tf.masking_utils.AttentionMaskInterface.register(name, tf.masking_utils.eager_mask)
    handles = []
    for i, layer in enumerate(hf.model.layers):
        comp = layer.self_attn.compressor
        if comp is not None:
            handles.append(comp.register_forward_hook(entries(i)))
            if hasattr(comp, "indexer"):
                handles.append(comp.indexer.scorer.register_forward_pre_hook(index_keys(i)))
    old = cfg._attn_implementation
    cfg._attn_implementation = name
    try:
        yield hf
    finally:
        cfg._attn_implementation = old
        for h in handles:
            h.remove()


class PlannedRunner:
    """The model on a `PlannedHybridFamily`, with an engine's block and slot bookkeeping
    (``decode_builder``: ``"eager"`` = ``prepare_decode``, ``"device"`` =
    ``prepare_decode_on_device``, its torch path on the CPU).

    ``trace=True`` (exact format only) records every raw row and compressed entry the model
    hands the family, keyed by its fp32 bytes, and `step` then returns, per layer, each query
    row's attended set as ``("raw", position)`` / ``("compressed", j)`` pairs, named from the
    rows the family gathered (a row the family made up would fail the lookup).
    """

    def __init__(self, model, *, kv_format: str = "exact", index_format: str | None = None,
                 block_size: int = 16, max_model_len: int = 96, num_state_slots: int = 4,
                 trace: bool = False, decode_builder: str = "eager") -> None:  # fmt: skip
        self.model = model
        self.max_blocks = -(-max_model_len // block_size)
        num_blocks = 1 + num_state_slots * self.max_blocks
        self.family = PlannedHybridFamily(
            model.config.layer_specs(), block_size=block_size, num_blocks=num_blocks,
            num_state_slots=num_state_slots, max_model_len=max_model_len, kv_format=kv_format,
            index_format=index_format, check=True, trace=trace, decode_builder=decode_builder,
        )  # fmt: skip
        self.trace = trace
        self.free_blocks = list(range(num_blocks - 1, 0, -1))  # block 0 is reserved
        self.free_slots = list(range(num_state_slots - 1, -1, -1))
        self.tables: dict[int, list[int]] = {}
        self.slots: dict[int, int] = {}
        self.book: dict[tuple[int, int], dict[bytes, tuple[str, int]]] = {}  # (rid, layer)
        self.rows: dict[tuple[int, int, str], dict[int, torch.Tensor]] = {}  # (rid, layer, series)

    def admit(self, rid: int) -> None:
        if rid not in self.slots:
            self.slots[rid] = self.free_slots.pop()
            self.tables[rid] = [self.free_blocks.pop() for _ in range(self.max_blocks)]

    def preempt(self, rid: int) -> None:
        """Drop the request's caches; its slot and blocks go first to the next admission."""
        self.family.free(rid)
        self.free_slots.append(self.slots.pop(rid))
        self.free_blocks += self.tables.pop(rid)[::-1]

    @torch.no_grad()
    def step(self, rows: list[tuple[int, list[int], int, int]]):
        """One flat step over ``(request_id, token_ids, q_start, seqlen_q)``; returns each
        sequence's logits ``[seqlen_q, V]`` and (tracing) ``visible[layer][t]``."""
        seqs, ids, pos = [], [], []
        for rid, tokens, q_start, n in rows:
            self.admit(rid)
            seqs.append(HybridSeq(rid, q_start, n, tokens, self.tables[rid], self.slots[rid]))
            ids += tokens[q_start : q_start + n]
            pos += range(q_start, q_start + n)
        positions = torch.tensor(pos, dtype=torch.int64)
        ctx = self.family.plan(seqs, positions)
        visible = self._record(ctx, seqs)
        logits = self.model(torch.tensor(ids, dtype=torch.int64), positions, ctx)
        return list(logits.split([n for *_, n in rows])), visible

    def stored(self, rid: int, layer: int, series: str) -> torch.Tensor:
        """``[n, C]``: the rows of ``series`` (``"raw"``, ``"compressor"``, ``"indexer"``)
        the model handed the family for request ``rid`` since its last start, by position."""
        got = self.rows.get((rid, layer, series), {})
        assert sorted(got) == list(range(len(got))), f"{series} rows {sorted(got)}"
        return torch.stack([got[i] for i in range(len(got))])

    def _record(self, ctx, seqs: list[HybridSeq]) -> dict[int, list[frozenset]] | None:
        """Wrap ``ctx``'s calls to keep every row the model hands the family and, when
        tracing, name each query row's visible set."""
        rids = [s.request_id for s in seqs for _ in range(s.seqlen_q)]
        where = [s.q_start + k for s in seqs for k in range(s.seqlen_q)]
        for s in seqs:
            if s.q_start == 0:
                for book in (self.book, self.rows):
                    for key in [k for k in book if k[0] == s.request_id]:
                        del book[key]
        visible: dict[int, list[frozenset]] = {}
        windows: dict[tuple[int, str], object] = {}
        calls = ctx.compress_windows, ctx.store_entries, ctx.attend

        def compress_windows(layer, name, kv, gate):
            out = calls[0](layer, name, kv, gate)
            windows[(layer, name)] = out
            return out

        def store_entries(layer, name, entries):
            w = windows[(layer, name)]
            for e in range(entries.shape[0]):
                rid, j = seqs[int(w.seq_index[e])].request_id, int(w.entry_index[e])
                self.rows.setdefault((rid, layer, name), {})[j] = entries[e].detach().clone()
                if name == "compressor":
                    self.book.setdefault((rid, layer), {})[_key(entries[e])] = ("compressed", j)
            return calls[1](layer, name, entries)

        def attend(layer, q, kv, *args, **kw):
            for t in range(kv.shape[0]):
                self.rows.setdefault((rids[t], layer, "raw"), {})[where[t]] = kv[t].detach().clone()
                self.book.setdefault((rids[t], layer), {})[_key(kv[t])] = ("raw", where[t])
            out = calls[2](layer, q, kv, *args, **kw)
            if not self.trace:
                return out
            rows, index = ctx.traces[layer]
            sets = []
            for t in range(index.shape[0]):
                book = self.book[(rids[t], layer)]
                picked = [book[_key(rows[i])] for i in index[t].tolist() if i >= 0]
                assert len(set(picked)) == len(picked), f"layer {layer} row {t}: {picked}"
                sets.append(frozenset(picked))
            visible[layer] = sets
            return out

        ctx.compress_windows, ctx.store_entries, ctx.attend = (
            compress_windows,
            store_entries,
            attend,
        )
        return visible if self.trace else None


def _key(row: torch.Tensor) -> bytes:
    return row.detach().float().contiguous().numpy().tobytes()
