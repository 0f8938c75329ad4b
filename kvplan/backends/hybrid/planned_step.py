"""``PlannedStep``: one step of the planned hybrid family (``HybridStepContext``).

How each call maps onto the plan (``meta`` = the step's ``InputMetadata``, ``r`` a ratio,
``key = str(r)``):

``compress_windows(layer, name, kv, gate)``
    ``kvplan.plan.compressor_state`` for ``(r, overlap)``: ``expand_window_index`` turns its
    O(entries) ``window_facts`` into ``[E, R]`` sources in ``[state ring | step rows]``; the
    windows are gathered from the layer's fp32 state ring and the step's rows (CSA: the
    first ``r`` rows take the "Ca" half, the last ``r`` the "Cb" half), then the step's rows
    are written into the ring at ``slot_mapping_store_state`` (read before write).
``compress_store(layer, name, kv, gate, weights, gate_bias)``
    ``compress_windows``, the pooling and ``store_entries`` fused into one launch per series
    (``kvplan.ops.compress_store``; the model calls it where ``fused_compress_enabled``, CUDA
    by default), the raw gate biased in the kernel; decode steps write the ring in the same
    launch, prefill after it.
``store_entries(layer, name, entries)``
    ``store_kv_cache`` into the layer's pool of ``name`` at ``slot_mapping_store_ca[key]`` of
    the entries' plan rows (prompt: ``cu_compressed_seqlens_q[key][i] + j - q_start // r``;
    decode: the query row that closes the window). ``positions_c[key]`` of those rows is
    ``j * r`` (``check=True`` verifies it).
``attend(layer, q, kv, sinks, scale, ...)``
    prompt: ``load_paged_kv_cache`` of the ring through ``load_segments_swa`` (``total_k_swa``
    rows), THEN ``store_kv_cache`` of ``kv`` at ``slot_mapping_store_swa``; the buffer is
    ``[history | this chunk]`` and ``kv_swa_full_index`` (``expand_swa_index`` of the pivots)
    indexes it. Compressed layers load their pool through ``load_segments_ca[key]``
    (``total_k_compressed[key]`` rows); HCA reads ``kv_ca_index[key]`` (``expand_kv_ca_index``
    of ``kv_ca_index_offset_len``); CSA loads the indexer pool through the same segments,
    scores the candidates ``[ks, ke)`` and keeps the top-k rows. ``kv_index_cat`` appends the
    compressed index behind the SWA one (``base`` = rows of the SWA buffer).
    decode: ``store_kv_cache`` first; ``kv_swa_index`` (``expand_swa_index_decode``) are ring
    slots; HCA ``kv_ca_index[key]`` (``expand_kv_ca_index_decode`` through ``block_tables``)
    are pool slots; CSA candidates ``0 .. klen - 1`` become pool slots through
    ``convert_kv_index`` and the chosen top-k are looked up among them. Slots are read with
    ``load_paged_kv_cache`` (one segment per slot, built on the device) and joined with
    ``kv_index_cat``.
    Attention: ``sparse_attention.sink_attention`` over the joined buffer and index.
    CUDA (``kvplan.ops.sparse_attention``, when not tracing): decode reads the ring and the
    compressor pool in place through the slot tables (no gathered copy of the main rows);
    prefill hands the kernel the SWA buffer and the compressed buffer (rows in the model's
    dtype: BF16 for a BF16 model; each quantized entry dequantized once, as many prompt rows
    read it) or, for an exact pool, the pool itself in place through slot tables (the rows'
    visible entries mapped through their sequences' block tables), as two sources (no join).
    By default a prompt goes through ``kvplan.ops.sparse_ranges`` instead
    (`_attend_prompt_ranges`: the window and the compressed prefix as row ranges, blocks of
    neighbouring rows sharing key tiles; CSA rows past the top-k on the index path with a
    row list; ``KVPLAN_PROMPT_RANGES=0``: the index tables for every row). CUDA CSA layers
    score candidates with ``kvplan.ops.sparse_attention.index_scores`` (the index keys read
    in place) and keep their top-k with ``kvplan.ops.topk`` (column order, mapped straight
    to the candidates' pool slots by its ``gather``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvplan._checks import check_range
from kvplan._math import exclusive_cumsum
from kvplan.backends.hybrid.api import (
    SERIES_NAMES,
    CompressWindows,
    HybridSeq,
    check_attend_inputs,
    unrotate,
)
from kvplan.backends.hybrid.sparse_attention import indexer_topk, sink_attention
from kvplan.backends.staging.arena import to_device
from kvplan.ops import convert_kv_index, kv_index_cat
from kvplan.ops._dispatch import use_triton
from kvplan.ops.compress_store import (
    GateBias,
    PoolWeights,
    biased_gate,
    compress_store_triton,
    fused_supported,
    gather_windows,
    pool_windows,
)
from kvplan.ops.index_scores import index_scores_by_sequence
from kvplan.ops.sparse_attention import KeySource, index_scores, sparse_attention, topk_columns
from kvplan.ops.sparse_ranges import RangeSource, range_tiling, sparse_attention_ranges
from kvplan.plan.common import num_new_compressed
from kvplan.plan.compressor_state import expand_window_index, plan_compressor_state
from kvplan.plan.config import ratio_key
from kvplan.plan.sequence import SequenceMetadata

if TYPE_CHECKING:
    from kvplan.backends.hybrid.planned import PlannedHybridFamily
    from kvplan.backends.hybrid.snapshots import KeepPoints


class _StateStep:
    """Device tensors of one ``(ratio, overlap)`` compressor-state plan."""

    def __init__(self, step: PlannedStep, ratio: int, overlap: bool) -> None:
        fam, dev = step.family, step.family.device
        plan = plan_compressor_state(step.seq_meta, ratio, overlap)
        self.plan = plan
        self.ring_rows = fam.config.num_state_slots * plan.state_rows
        facts = to_device(plan.window_facts, dev, None)
        self.window_index = expand_window_index(facts, plan.state_rows, self.ring_rows, torch.int64)
        store = plan.slot_mapping_store_state
        self.store_rows = to_device(
            np.where(store >= 0, store, self.ring_rows).astype(np.int64), dev, None
        )
        self.positions = to_device(plan.positions, dev, None)
        self.entry_index = to_device(plan.entry_index, dev, None)
        self.seq_index = to_device(plan.entry_seq, dev, None)
        rows = step.entry_plan_rows(ratio, plan.entry_seq, plan.entry_index)
        key = ratio_key(ratio)
        self.slots = step.meta.slot_mapping_store_ca[key][to_device(rows, dev, None)]
        if fam.check:
            step.check_entry_rows(ratio, rows, plan.positions)


class PlannedStep:
    """One step of :class:`~kvplan.backends.hybrid.planned.PlannedHybridFamily` (see the
    module docstring). ``meta`` is the step's ``InputMetadata``; ``traces[layer]`` holds
    ``(rows, index)`` of the last ``attend`` when the family traces; ``keep``: snapshots the
    step completes inside its prompt chunks (`KeepPoints`), None for decode steps."""

    keep: KeepPoints | None = None  # also for subclasses that plan decode steps otherwise

    def __init__(
        self, family: PlannedHybridFamily, seqs: list[HybridSeq], positions,
        keep: KeepPoints | None = None,
    ) -> None:  # fmt: skip
        from kvplan.plan import prepare_decode, prepare_decode_on_device, prepare_prompt

        self.family = family
        cfg = family.config
        self.seqs = seqs
        self.q_start = np.array([s.q_start for s in seqs], dtype=np.int64)
        self.seqlen_q = np.array([s.seqlen_q for s in seqs], dtype=np.int64)
        self.cu_q = exclusive_cumsum(self.seqlen_q)
        self.num_rows = int(self.cu_q[-1])
        if not isinstance(positions, torch.Tensor) or tuple(positions.shape) != (self.num_rows,):
            got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else positions
            raise ValueError(f"positions must be a tensor of shape ({self.num_rows},), got {got}")
        self.positions = positions
        self.is_prompt = bool((self.seqlen_q > 1).any())
        if keep is not None and not self.is_prompt:
            raise ValueError("keep: state is kept inside prompt chunks only (a decode step got it)")
        self.keep = keep
        self.seq_meta = [
            SequenceMetadata(
                seqlen_q=s.seqlen_q,
                seqlen_k=s.q_start + s.seqlen_q,
                block_table=s.block_table,
                state_id=s.state_id,
                token_ids=s.token_ids if self.is_prompt else s.token_ids[: s.q_start + 1],
            )
            for s in seqs
        ]
        if self.is_prompt:
            meta = prepare_prompt(self.seq_meta, cfg)
        elif family.decode_builder == "device":
            meta = prepare_decode_on_device(self.seq_meta, cfg)
        else:
            meta = prepare_decode(self.seq_meta, cfg)
        self.meta = meta.compute_attn_info(cfg, check=family.check)
        self.max_seqlen_k = int((self.q_start + self.seqlen_q).max())
        self.traces: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._states: dict[tuple[int, bool], _StateStep] = {}
        self._windows_done: set[tuple[int, str]] = set()
        self._stored: set[tuple[int, str]] = set()
        self._cand_slots: dict[int, torch.Tensor] = {}  # ratio -> `_candidate_slots`
        self._ranges: dict = {}  # the range path's row blocks, hard rows, prefix ranges
        self._seq_slots: dict[int, torch.Tensor] = {}  # ratio -> `_prompt_index_scores`' table
        # the compressor-state plans of every (ratio, overlap) the layers use, before the
        # step's first kernel: planned on a layer's first use they put the host's numpy work
        # between two layers' launches
        for ratio, overlap in sorted(
            {(sp.ratio, sp.overlap) for sp in family.layers if sp.kind != "sliding_attention"}
        ):
            self._state(ratio, overlap)

    # ---- host facts ---------------------------------------------------------------------
    def entry_plan_rows(self, ratio: int, entry_seq: np.ndarray, entry_index: np.ndarray):
        """Row of each closing entry in ``positions_c[key]`` / ``slot_mapping_store_ca[key]``
        (int64 ``[E]``; see the module docstring)."""
        qs = self.q_start[entry_seq]
        if self.is_prompt:
            sk = self.q_start + self.seqlen_q
            _, rows = num_new_compressed(self.seqlen_q, sk, ratio)
            return exclusive_cumsum(rows)[entry_seq] + entry_index - qs // ratio
        return self.cu_q[entry_seq] + (entry_index + 1) * ratio - 1 - qs

    def check_entry_rows(self, ratio: int, rows: np.ndarray, positions: np.ndarray) -> None:
        """The plan stores exactly the closing entries, at ``positions_c = j * r``."""
        key = ratio_key(ratio)
        pos_c = self.meta.positions_c[key].cpu().numpy()
        slots = self.meta.slot_mapping_store_ca[key].cpu().numpy()
        written = np.flatnonzero(slots != -1)
        if not np.array_equal(written, np.sort(rows)) or not np.array_equal(pos_c[rows], positions):
            raise AssertionError(
                f"ratio {ratio}: plan stores rows {written.tolist()} at {pos_c[written].tolist()}"
                f", closing entries are rows {rows.tolist()} at {positions.tolist()}"
            )

    def _state(self, ratio: int, overlap: bool) -> _StateStep:
        key = (ratio, overlap)
        if key not in self._states:
            self._states[key] = _StateStep(self, ratio, overlap)
        return self._states[key]

    def _spec(self, layer_idx: int, name: str | None = None):
        layers = self.family.layers
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise TypeError(f"layer_idx must be an int, got {layer_idx!r}")
        if not 0 <= layer_idx < len(layers):
            raise ValueError(f"layer_idx = {layer_idx} outside [0, {len(layers)})")
        spec = layers[layer_idx]
        if name is not None:
            if spec.kind == "sliding_attention":
                raise ValueError(f"layer {layer_idx} is a sliding layer: it has no {name!r}")
            allowed = SERIES_NAMES if spec.overlap else SERIES_NAMES[:1]
            if name not in allowed:
                raise ValueError(f"layer {layer_idx} ({spec.kind}) series must be in {allowed}")
        return spec

    def _rows(self, label: str, t: torch.Tensor, width: int) -> None:
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (self.num_rows, width):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{label} must have shape ({self.num_rows}, {width}), got {got}")

    # ---- HybridStepContext ----------------------------------------------------------------
    def compress_windows(
        self, layer_idx: int, name: str, kv: torch.Tensor, gate: torch.Tensor
    ) -> CompressWindows:
        spec = self._spec(layer_idx, name)
        width, r = spec.series_width(name), spec.ratio
        k = 2 if spec.overlap else 1
        self._rows("kv", kv, k * width)
        self._rows("gate", gate, k * width)
        if (layer_idx, name) in self._windows_done:
            raise ValueError(f"compress_windows({layer_idx}, {name!r}) called twice in a step")
        self._windows_done.add((layer_idx, name))
        st = self._state(r, spec.overlap)
        kv_ring, gate_ring = self.family.caches[layer_idx].state[name]
        wkv, wgate = gather_windows(kv, gate, kv_ring, gate_ring, st.window_index, r, spec.overlap)
        # read before write: this step's rows replace older ones in the ring
        kv_ring.index_copy_(0, st.store_rows, kv.float())
        gate_ring.index_copy_(0, st.store_rows, gate.float())
        self._keep_state(layer_idx, name, spec, kv, gate)
        return CompressWindows(
            kv=wkv,
            gate=wgate,
            positions=st.positions,
            entry_index=st.entry_index,
            seq_index=st.seq_index,
        )

    def compress_store(self, layer_idx: int, name: str, kv: torch.Tensor, gate: torch.Tensor,
                       weights: PoolWeights, gate_bias: GateBias | None = None) -> None:  # fmt: skip
        """``compress_windows``, the pooling of ``weights`` and ``store_entries`` in one call:
        ``kvplan.ops.compress_store``'s fused kernel where it covers the series (one launch
        per series in decode steps, the ring write joined to it; prefill writes the ring in a
        second launch, after every window is read), the three calls otherwise. ``gate``: the
        biased fp32 gate, or the raw projection with ``gate_bias`` (``GateBias``)."""
        spec = self._spec(layer_idx, name)
        pool = self.family.caches[layer_idx].pools[name]
        if not fused_supported(kv, pool.layout, weights):
            windows = self.compress_windows(layer_idx, name, kv, biased_gate(gate, gate_bias))
            if windows.kv.shape[0] == 0:
                entries = kv.new_zeros((0, spec.series_width(name)))
            else:
                entries = pool_windows(windows.kv, windows.gate, windows.positions, weights)
            self.store_entries(layer_idx, name, entries)
            return
        k = 2 if spec.overlap else 1
        self._rows("kv", kv, k * spec.series_width(name))
        self._rows("gate", gate, k * spec.series_width(name))
        if (layer_idx, name) in self._windows_done:
            raise ValueError(f"compress_store({layer_idx}, {name!r}) called twice in a step")
        self._windows_done.add((layer_idx, name))
        st = self._state(spec.ratio, spec.overlap)
        cache = pool.cache
        if self.family.check and not (cache.is_cuda and torch.cuda.is_current_stream_capturing()):
            check_range("slots", st.slots, -1, pool.cache.shape[0] * pool.cache.shape[1])
        kv_ring, gate_ring = self.family.caches[layer_idx].state[name]
        compress_store_triton(
            kv, gate, kv_ring, gate_ring, st.window_index, st.positions, st.slots,
            st.store_rows, weights, pool.cache, pool.layout, ratio=spec.ratio,
            overlap=spec.overlap, state_in_launch=not self.is_prompt, gate_bias=gate_bias,
        )  # fmt: skip
        self._stored.add((layer_idx, name))
        self._keep_state(layer_idx, name, spec, kv, gate, gate_bias)

    def store_entries(self, layer_idx: int, name: str, entries: torch.Tensor) -> None:
        spec = self._spec(layer_idx, name)
        st = self._state(spec.ratio, spec.overlap)
        width = spec.series_width(name)
        if not isinstance(entries, torch.Tensor) or tuple(entries.shape) != (
            st.plan.num_entries,
            width,
        ):
            got = tuple(entries.shape) if isinstance(entries, torch.Tensor) else entries
            raise ValueError(
                f"entries must have shape ({st.plan.num_entries}, {width}) (the windows "
                f"compress_windows returned), got {got}"
            )
        self.family.caches[layer_idx].pools[name].store(entries, st.slots)
        self._stored.add((layer_idx, name))

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
        compressed = spec.kind != "sliding_attention"
        if compressed:
            needed = SERIES_NAMES if spec.overlap else SERIES_NAMES[:1]
            missing = [n for n in needed if (layer_idx, n) not in self._stored]
            if missing:
                raise ValueError(f"layer {layer_idx}: store_entries({missing}) must precede attend")
        check_attend_inputs(spec, self.num_rows, q, kv, sinks, index_q, index_weights)
        caches = self.family.caches[layer_idx]
        if in_place(q) and not self.family.trace:
            args = (spec, caches, q, kv, sinks, scale, index_q, index_weights, out_rope)
            return self._attend_in_place(*args)
        meta = self.meta
        if self.is_prompt:
            rows = self._prompt_window(caches, kv)
            index = meta.kv_swa_full_index
        else:
            caches.ring.store(kv, meta.slot_mapping_store_swa)  # decode rows see themselves
            rows = caches.ring.load_slots(meta.kv_swa_index)
            index = _slot_rows(meta.kv_swa_index)
        if compressed:
            part = self._prompt_compressed if self.is_prompt else self._decode_compressed
            c_rows, c_index = part(spec, caches, index_q, index_weights)
            index = kv_index_cat(index, c_index, rows.shape[0], check=self.family.check)
            rows = torch.cat([rows, c_rows])
        if self.family.trace:
            self.traces[layer_idx] = (rows, index)
        if in_place(q):  # traced CUDA step: the kernel over the joined buffer
            return sparse_attention(q.contiguous(), [KeySource(rows, index)], sinks, scale,
                                    out_rope=out_rope, check=self.family.check,
                                    counters=self.family.merge_counters)  # fmt: skip
        return unrotate(sink_attention(q, rows, index, sinks, scale), out_rope)

    def _attend_in_place(
        self, spec, caches, q, kv, sinks, scale, index_q, index_weights, out_rope=None
    ):
        """``attend`` through ``kvplan.ops.sparse_attention`` (see the module docstring)."""
        meta, compressed = self.meta, spec.kind != "sliding_attention"
        if self.is_prompt and os.environ.get("KVPLAN_PROMPT_RANGES", "1") != "0":
            return self._attend_prompt_ranges(spec, caches, q, kv, sinks, scale, index_q,
                                              index_weights, out_rope)  # fmt: skip
        if self.is_prompt:
            # Rows in the model's dtype (bf16 rows: half the bytes of fp32, the same values).
            # A quantized pool's entries are dequantized once into rows (many prompt rows
            # read each entry); an exact pool is read in place.
            dtype = q.dtype if q.dtype == torch.bfloat16 else torch.float32
            rows = self._prompt_window(caches, kv, dtype)
            sources = [KeySource(rows, meta.kv_swa_full_index)]
            pool = caches.pools["compressor"] if compressed else None
            if compressed and pool.layout.is_quantized:
                c_rows, c_index = self._prompt_compressed(
                    spec, caches, index_q, index_weights, dtype=dtype
                )
                sources.append(KeySource(c_rows, c_index))
            elif compressed:
                sources.append(pool.key_source(self._prompt_slots(spec, caches, index_q,
                                                                  index_weights)))  # fmt: skip
        else:
            caches.ring.store(kv, meta.slot_mapping_store_swa)  # decode rows see themselves
            sources = [caches.ring.key_source(meta.kv_swa_index)]
            if compressed:
                slots = self._decode_slots(spec, caches, index_q, index_weights)
                sources.append(caches.pools["compressor"].key_source(slots))
        q = q if q.stride(2) == 1 else q.contiguous()
        return sparse_attention(q, sources, sinks, scale, out_rope=out_rope,
                                check=self.family.check,
                                counters=self.family.merge_counters)  # fmt: skip

    def _prompt_window(self, caches, kv, dtype=torch.float32) -> torch.Tensor:
        """A prompt step's SWA buffer ``[history | this chunk]`` in ``dtype``: the ring's
        history through ``load_segments_swa``, THEN the chunk's rows stored into the ring
        (the store may overwrite slots the load reads) and appended as the ring rounds them.
        Snapshots kept inside the chunk (``keep``) get their ring rows stored too."""
        meta = self.meta
        hist = caches.ring.load(meta.load_segments_swa, meta.total_k_swa, dtype=dtype)
        caches.ring.store(kv, meta.slot_mapping_store_swa)
        if self.keep is not None:
            ring = caches.ring
            src, dst = self.keep.rows(self.q_start, self.cu_q, ring.block_size, kv.device,
                                      torch.int32)  # fmt: skip
            ring.store_into(self.keep.store.rings[caches.index], kv[src], dst)
        return torch.cat([hist, caches.ring.roundtrip(kv, dtype=dtype)])

    def _keep_state(self, layer_idx: int, name: str, spec, kv, gate, gate_bias=None) -> None:
        """Snapshots kept inside the chunk (``keep``): their compressor-state rows of an
        overlapping series, fp32 ``kv`` and the biased ``gate`` as the ring holds them (the
        raw ``gate`` biased here, on those rows only, when ``gate_bias`` is given)."""
        if self.keep is None or not spec.overlap:
            return
        kv_copy, gate_copy = self.keep.store.states[(layer_idx, name)]
        src, dst = self.keep.rows(self.q_start, self.cu_q, kv_copy.shape[1], kv.device)
        g = gate[src]
        if gate_bias is not None:
            g = biased_gate(g, GateBias(gate_bias.table, gate_bias.positions[src]))
        kv_copy.view(-1, kv_copy.shape[2]).index_copy_(0, dst, kv[src].float())
        gate_copy.view(-1, gate_copy.shape[2]).index_copy_(0, dst, g.float())

    def _attend_prompt_ranges(
        self, spec, caches, q, kv, sinks, scale, index_q, index_weights, out_rope
    ) -> torch.Tensor:
        """Prompt ``attend`` through ``kvplan.ops.sparse_ranges`` (the default on CUDA;
        ``KVPLAN_PROMPT_RANGES=0``: `_attend_in_place`'s index tables). A row sees two ranges
        of the SWA buffer (the pivots) and, on a compressed layer, the prefix ``[ks, ks +
        len)`` of the compressed buffer: every closed entry on HCA layers; on CSA layers while
        ``len <= top_k``, where the indexer's top-k is all of them. Blocks of neighbouring
        rows of one sequence share their key tiles. CSA rows past that point (``len >
        top_k``) take ``sparse_attention`` over their top-k, in the same output."""
        meta, check = self.meta, self.family.check
        dtype = q.dtype if q.dtype == torch.bfloat16 else torch.float32
        rows = self._prompt_window(caches, kv, dtype)
        q = q if q.stride(2) == 1 else q.contiguous()
        tile_t = range_tiling(q.dtype)["tile_t"]
        window = RangeSource(rows, meta.kv_swa_full_index_pivots)
        if spec.kind == "sliding_attention":
            return sparse_attention_ranges(q, [window], sinks, scale, out_rope=out_rope,
                                           blocks=self._row_blocks(tile_t), check=check)  # fmt: skip
        key = ratio_key(spec.ratio)
        easy = self._easy_rows(spec) if spec.overlap else self.seqlen_q
        hard = self._hard_rows(spec, easy) if spec.overlap else None
        if hard is None:
            c_rows = caches.pools["compressor"].load(meta.load_segments_ca[key],
                                                      meta.total_k_compressed[key], dtype=dtype)  # fmt: skip
        else:
            c_rows, c_index = self._prompt_compressed(spec, caches, index_q, index_weights,
                                                      dtype=dtype)  # fmt: skip
        prefix = RangeSource(c_rows, self._prefix_ranges(spec))
        out = torch.empty_like(q)
        sparse_attention_ranges(q, [window, prefix], sinks, scale, out=out, out_rope=out_rope,
                                blocks=self._row_blocks(tile_t, easy), check=check)  # fmt: skip
        if hard is not None:
            sources = [KeySource(rows, meta.kv_swa_full_index), KeySource(c_rows, c_index)]
            sparse_attention(q, sources, sinks, scale, out=out, out_rope=out_rope, check=check,
                             rows=hard)  # fmt: skip
        return out

    def _easy_rows(self, spec) -> np.ndarray:
        """Per sequence, how many of its leading prompt rows see at most ``top_k`` closed
        entries of ``spec.ratio`` (``(p + 1) // r <= top_k``, i.e. ``p <= (top_k + 1) r -
        2``): the rows whose top-k is their whole prefix."""
        last = (spec.top_k + 1) * spec.ratio - 2
        return np.clip(last + 1 - self.q_start, 0, self.seqlen_q)

    def _row_blocks(self, tile_t: int, counts: np.ndarray | None = None):
        """``(start, end)`` int32 device tensors: blocks of up to ``tile_t`` consecutive rows
        of one sequence over each sequence's first ``counts[i]`` rows (None: all), cached
        for the step."""
        counts = self.seqlen_q if counts is None else counts
        key = ("blocks", tile_t, counts.tobytes())
        if key not in self._ranges:
            starts, ends = [], []
            for base, n in zip(self.cu_q[:-1].tolist(), counts.tolist(), strict=True):
                b = np.arange(base, base + n, tile_t, dtype=np.int32)
                starts.append(b)
                ends.append(np.minimum(b + tile_t, base + n).astype(np.int32))
            n = sum(len(b) for b in starts)
            # rows padded to 16 bytes: ``end`` is as aligned as ``start`` for every count, so
            # the kernel keeps one specialization (Triton specializes on pointer alignment)
            both = np.zeros((2, -(-n // 4) * 4), dtype=np.int32)
            both[0, :n], both[1, :n] = np.concatenate(starts), np.concatenate(ends)
            dev = to_device(both, self.positions.device, None)
            self._ranges[key] = (dev[0, :n], dev[1, :n])
        return self._ranges[key]

    def _hard_rows(self, spec, easy: np.ndarray) -> torch.Tensor | None:
        """int32 device rows past each sequence's `_easy_rows` (None when there are none),
        cached for the step."""
        if (easy == self.seqlen_q).all():
            return None
        key = ("hard", spec.ratio, spec.top_k)
        if key not in self._ranges:
            parts = [np.arange(b + e, b + n, dtype=np.int32) for b, e, n in
                     zip(self.cu_q[:-1].tolist(), easy.tolist(), self.seqlen_q.tolist(),
                         strict=True)]  # fmt: skip
            self._ranges[key] = to_device(np.concatenate(parts), self.positions.device, None)
        return self._ranges[key]

    def _prefix_ranges(self, spec) -> torch.Tensor:
        """int32 ``[T, 2]`` ``(start, length)`` of every prompt row's closed entries in the
        compressed buffer (HCA: ``kv_ca_index_offset_len``; CSA: ``ks``, ``klen``)."""
        key, meta = ratio_key(spec.ratio), self.meta
        if not spec.overlap:
            return meta.kv_ca_index_offset_len[key]
        cache_key = ("prefix", spec.ratio)
        if cache_key not in self._ranges:
            both = torch.stack([meta.ks[key].to(torch.int32), meta.klen[key].to(torch.int32)], 1)
            self._ranges[cache_key] = both.contiguous()
        return self._ranges[cache_key]

    # ---- compressed parts ---------------------------------------------------------------
    def _prompt_compressed(self, spec, caches, index_q, index_weights, dtype=torch.float32):
        key, meta = ratio_key(spec.ratio), self.meta
        segs, total = meta.load_segments_ca[key], meta.total_k_compressed[key]
        rows = caches.pools["compressor"].load(segs, total, dtype=dtype)
        width = self.max_seqlen_k // spec.ratio  # most entries any row of the step sees
        if not spec.overlap:
            return rows, meta.kv_ca_index[key][:, :width]
        ks, klen = meta.ks[key].long(), meta.klen[key]
        if in_place(index_q):  # CUDA: the index keys read in place from their pool
            slots = self._candidate_slots(spec.ratio, width)
            scores = self._prompt_index_scores(spec, caches, index_q, index_weights, slots)
            local = topk_columns(scores, klen, spec.top_k, check=self.family.check)
        else:
            keys_buf = caches.pools["indexer"].load(segs, total)
            col = torch.arange(width, device=ks.device)[None, :]
            cand = torch.where(col < klen.long()[:, None], ks[:, None] + col, 0)
            local = indexer_topk(index_q, index_weights, keys_buf[cand], klen, spec.top_k)
        index = torch.where(local >= 0, ks[:, None] + local, -1).to(torch.int32)
        return rows, index

    def _prompt_slots(self, spec, caches, index_q, index_weights) -> torch.Tensor:
        """int32 ``[T, K]`` pool slots a prompt row sees, ``-1`` padded (the in-place form of
        :meth:`_prompt_compressed`'s buffer rows): HCA every closed entry ``0 .. len - 1`` of
        its sequence, CSA the indexer's top-k of them mapped to their slots by the top-k's
        ``gather``. The chunk's own entries are in the pool: ``store_entries`` came first."""
        width = self.max_seqlen_k // spec.ratio
        slots = self._candidate_slots(spec.ratio, width)
        if not spec.overlap:
            return slots
        klen, check = self.meta.klen[ratio_key(spec.ratio)], self.family.check
        scores = self._prompt_index_scores(spec, caches, index_q, index_weights, slots)
        return topk_columns(scores, klen, spec.top_k, gather=slots, check=check)

    def _prompt_index_scores(self, spec, caches, index_q, index_weights, slots):
        """The indexer's fp32 ``[T, K]`` scores of a prompt step's candidates ``slots``
        (`_candidate_slots`). The rows of one sequence share its candidates (row ``t`` sees
        the first ``klen[t]``, the sequence's last row the most), so by default the keys are
        scored per sequence (`index_scores_by_sequence`: a key tile loaded once for several
        rows); ``KVPLAN_INDEX_BY_SEQUENCE=0`` scores every row's own table."""
        pool, check = caches.pools["indexer"], self.family.check
        if os.environ.get("KVPLAN_INDEX_BY_SEQUENCE", "1") == "0":
            return index_scores(index_q, index_weights, pool.key_source(slots), check=check)
        seq_slots = self._seq_slots.get(spec.ratio)
        if seq_slots is None:  # each sequence's last row sees all of its candidates
            last = to_device(self.cu_q[1:] - 1, slots.device, None)
            seq_slots = self._seq_slots[spec.ratio] = slots[last]
        return index_scores_by_sequence(
            index_q, index_weights, pool.key_source(seq_slots), self.cu_q,
            self.meta.klen[ratio_key(spec.ratio)], check=check,
        )  # fmt: skip

    def _candidate_slots(self, ratio: int, width: int) -> torch.Tensor:
        """int32 ``[T, width]`` pool slots of each row's visible entries ``0 .. len[t] - 1``
        (``-1`` after them; ``len`` is ``klen`` of a sparse ratio, the ``kv_ca_index_len`` of
        a dense one) through its sequence's block table: the same for every layer of
        ``ratio``, so computed once per step."""
        if ratio not in self._cand_slots:
            meta = self.meta
            tpb = self.family.config.tokens_per_block(ratio)
            key = ratio_key(ratio)
            klen = meta.klen[key] if key in meta.klen else meta.kv_ca_index_len[key]
            dev = klen.device
            if self.is_prompt:  # a row per token: its sequence's table, columns it reaches
                blocks = max(-(-width // tpb), 1)
                table = np.zeros((len(self.seqs), blocks), dtype=np.int32)
                for i, s in enumerate(self.seqs):
                    row = np.asarray(s.block_table[:blocks], dtype=np.int32)
                    table[i, : row.shape[0]] = row
                row_seq = np.repeat(np.arange(len(self.seqs)), self.seqlen_q)
                tables = to_device(table, dev, None)[to_device(row_seq, dev, None)]
            else:
                tables = meta.block_tables
            col = torch.arange(width, dtype=torch.int32, device=dev)[None, :]
            cand = torch.where(col < klen[:, None], col, -1).to(torch.int32).contiguous()
            self._cand_slots[ratio] = convert_kv_index(
                cand, tables, klen, tpb, out=torch.empty_like(cand), check=self.family.check
            )
        return self._cand_slots[ratio]

    def _decode_compressed(self, spec, caches, index_q, index_weights):
        slots = self._decode_slots(spec, caches, index_q, index_weights)
        return caches.pools["compressor"].load_slots(slots), _slot_rows(slots)

    def _decode_slots(self, spec, caches, index_q, index_weights):
        """int32 ``[T, K]`` pool slots a decode row sees (HCA: every closed entry; CSA: the
        indexer's top-k), ``-1`` padded."""
        key, meta = ratio_key(spec.ratio), self.meta
        width = self.max_seqlen_k // spec.ratio
        if not spec.overlap:
            return meta.kv_ca_index[key][:, :width]
        klen, check = meta.klen[key], self.family.check
        slots = self._candidate_slots(spec.ratio, width)
        if in_place(index_q):  # CUDA: score the index keys in place, top-k straight to slots
            src = caches.pools["indexer"].key_source(slots)
            scores = index_scores(index_q, index_weights, src, check=check)
            return topk_columns(scores, klen, spec.top_k, gather=slots, check=check)
        tpb = self.family.config.tokens_per_block(spec.ratio)
        keys = (
            caches.pools["indexer"]
            .load_slots(slots)
            .view(self.num_rows, width, spec.index_head_dim)
        )
        chosen = indexer_topk(index_q, index_weights, keys, klen, spec.top_k)  # entries j
        return convert_kv_index(chosen, meta.block_tables, klen, tpb, check=check)


def in_place(q: torch.Tensor) -> bool:
    """Whether ``attend`` reads the caches in place through the sparse attention kernel:
    the ops' dispatch rule (CUDA tensors)."""
    return use_triton(q)


def _slot_rows(slots: torch.Tensor) -> torch.Tensor:
    """Index of ``load_slots(slots)``'s rows: ``t * K + k`` where ``slots[t, k] != -1``."""
    num, width = slots.shape
    rows = torch.arange(num * width, dtype=torch.int32, device=slots.device).view(num, width)
    return torch.where(slots >= 0, rows, -1).to(torch.int32)
