"""``StaticDecodeStep``: a decode step of the planned hybrid family whose every device input
lives in persistent buffers, so that a CUDA graph captured over it replays any later step.

A captured graph replays its kernels on the tensors they read at capture time; every tensor
a decode step reads must therefore keep its address and be rewritten in place.
:class:`StaticDecodeBuffers` (one per family, ``max_rows`` rows) holds them:

* ``out``: the on-device decode metadata buffers of
  ``kvplan.plan.decode_device.make_decode_device_out`` (packed host facts in, per-row
  ``InputMetadata`` fields out);
* ``inputs``: int64 ``[2 + 7 * S, max_rows]``: the model's token ids (row 0) and positions
  (row 1), then for each compressed series ``(ratio, overlap)`` (``S`` of them) one column
  per step row: ``window_facts`` (4 rows, see ``kvplan.plan.compressor_state``), the
  compressor-state ring row written (the trash row when none), the entry's RoPE position
  ``j * r`` and its ``j``.

A :class:`StaticDecodeStep` of ``num_rows = b`` rows (one CUDA-graph bucket) splits a step:

``stage(seqs)`` (host, before each replay)
    validates ``seqs`` (decode rows), writes the packed decode facts
    (``stage_decode_on_device(..., out=)`` of the rows as a ``DecodeBatchArrays``, see
    ``kvplan.backends.hybrid.static_facts``) and ``inputs`` (from one of two pinned staging
    slots on CUDA, one copy queued on the stream, so it lands after a replay of the step
    before that still reads ``inputs``; a slot is rewritten once its last copy is done).
    Rows ``len(seqs) .. b - 1`` are padding: placeholder sequences (position 0, block table
    ``[0]``, state slot 0) that write no SWA row, no compressed entry and no compressor state
    (slot -1; their state rows go to the ring's trash row). They only read, and their outputs
    are discarded.
``begin()`` (device, inside the graph)
    the decode kernels, ``compute_attn_info`` (derived fields rebuilt every time), the
    expansion of the window facts. The model then runs with the step as its context.

Fixed shapes: ``compress_windows`` returns ``E = b`` windows, one per row: the window the row
closes, or, when it closes none, a stand-in over its state ring whose entry is stored at slot
-1 (the planner's ``slot_mapping_store_ca`` of such a row). Compressed layers consider
``max_model_len // r`` entries per row (``-1`` past the row's count) instead of the step's
longest. Values equal an eager :class:`~kvplan.backends.hybrid.planned_step.PlannedStep` of
the same sequences (up to the order of equal index-score ties).

Example::

    buffers = StaticDecodeBuffers(family, max_rows=8)
    step = StaticDecodeStep(family, 4, buffers)
    step.stage(seqs)                       # <= 4 decode HybridSeqs
    step.begin()
    logits = model(step.input_ids, step.positions, step)[: len(seqs)]
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvplan.backends.hybrid.api import HybridSeq
from kvplan.backends.hybrid.planned_step import PlannedStep
from kvplan.backends.hybrid.static_facts import BlockTableCache, decode_rows
from kvplan.plan.compressor_state import (
    expand_window_index,
    plan_decode_compressor_state,
    state_rows,
)
from kvplan.plan.config import ratio_key
from kvplan.plan.decode_device import (
    launch_decode_kernels,
    make_decode_device_out,
    stage_decode_on_device,
)
from kvplan.plan.sequence import SequenceMetadata

if TYPE_CHECKING:
    from kvplan.backends.hybrid.planned import PlannedHybridFamily

SERIES_ROWS = 7  # window_facts (4), state ring row, entry position, entry index
_PADDING = SequenceMetadata(
    seqlen_q=1, seqlen_k=1, block_table=(0,), state_id=0, token_ids=(0,), is_placeholder=True
)


class StaticDecodeBuffers:
    """The persistent buffers of a family's static decode steps (module docstring)."""

    def __init__(self, family: PlannedHybridFamily, max_rows: int) -> None:
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be an int >= 1, got {max_rows!r}")
        self.family = family
        self.max_rows = max_rows
        keys = sorted({(s.ratio, s.overlap) for s in family.layers if s.ratio})
        self.series = {k: 2 + SERIES_ROWS * i for i, k in enumerate(keys)}  # -> first row
        num = 2 + SERIES_ROWS * len(keys)
        dev = family.device
        self.out = make_decode_device_out(family.config, max_rows, max_rows, 1)
        self.inputs = torch.zeros(num, max_rows, dtype=torch.int64, device=dev)
        self.row_ids = torch.arange(max_rows, device=dev)  # read only: each series' seq_index
        # two staging slots used in turn: a step rewrites the slot of the step before last.
        # With async scheduling the step before may still be queued; the one before last
        # has had its tokens read, so its copy is done: the slot's event only confirms it.
        pin = dev.type == "cuda"
        self._staging = torch.zeros(2, num, max_rows, dtype=torch.int64, pin_memory=pin)
        self._copied: list[torch.cuda.Event | None] = [None, None]  # each slot's last upload
        self._slot = 0
        self.tables = BlockTableCache(family.config)  # per state slot, across steps

    def host(self) -> np.ndarray:
        """int64 ``[rows, max_rows]`` numpy view of the staging slot the next upload sends;
        waits (host) until that slot's previous upload has left it (CUDA)."""
        event = self._copied[self._slot]
        if event is not None:
            event.synchronize()
        return self._staging[self._slot].numpy()

    def upload(self) -> None:
        """Copy the staging slot into ``inputs`` on the current stream (one contiguous copy;
        columns past the step's rows are stale and never read) and switch slots. The copy
        is stream-ordered: it lands after every kernel queued before (a replay still reading
        ``inputs``), before every one queued after."""
        slot = self._slot
        self._slot ^= 1
        cuda = self.inputs.is_cuda
        self.inputs.copy_(self._staging[slot], non_blocking=cuda)
        if cuda:
            event = self._copied[slot] or torch.cuda.Event()
            event.record()
            self._copied[slot] = event


class StaticDecodeStep(PlannedStep):
    """A decode step of ``num_rows`` rows over persistent buffers (module docstring).

    ``max_seqlen_k`` (default: the family's ``max_model_len``) bounds the context of every
    row the step takes (``q_start + 1``) and sets the widths a captured step keeps: each
    compressed series' candidate lists are ``max_seqlen_k // ratio`` wide, and the indexer's
    top-k searches rows that wide. A shorter bound suits shorter contexts only (decode graphs
    by context tier, `kvplan.engine.hybrid_graphs`).

    Attributes:
        input_ids, positions: int64 ``[num_rows]`` views of ``buffers.inputs`` (the model's
            inputs; ``positions`` is also this context's ``positions``).
    """

    def __init__(
        self, family: PlannedHybridFamily, num_rows: int, buffers: StaticDecodeBuffers,
        max_seqlen_k: int | None = None,
    ) -> None:  # fmt: skip
        # no PlannedStep.__init__: nothing is planned before stage()
        if buffers.family is not family:
            raise ValueError("buffers were made for another family")
        if isinstance(num_rows, bool) or not isinstance(num_rows, int):
            raise TypeError(f"num_rows must be an int, got {num_rows!r}")
        if not 1 <= num_rows <= buffers.max_rows:
            raise ValueError(f"num_rows = {num_rows} outside [1, {buffers.max_rows}]")
        self.family = family
        self.buffers = buffers
        self.num_rows = num_rows
        self.is_prompt = False
        self.input_ids = buffers.inputs[0, :num_rows]
        self.positions = buffers.inputs[1, :num_rows]
        max_len = family.config.max_model_len
        if max_seqlen_k is None:
            max_seqlen_k = max_len
        if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int):
            raise TypeError(f"max_seqlen_k must be an int, got {max_seqlen_k!r}")
        if not 1 <= max_seqlen_k <= max_len:
            raise ValueError(
                f"max_seqlen_k = {max_seqlen_k} outside [1, max_model_len = {max_len}]"
            )
        self.max_seqlen_k = max_seqlen_k  # widths fixed for any step
        self.seqs: list[HybridSeq] = []
        self.meta = None
        self.traces: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._staged = None
        self._states: dict[tuple[int, bool], SimpleNamespace] = {}
        self._windows_done: set[tuple[int, str]] = set()
        self._stored: set[tuple[int, str]] = set()
        self._cand_slots: dict[int, torch.Tensor] = {}

    # ---- host -------------------------------------------------------------------------
    def stage(self, seqs: list[HybridSeq]) -> None:
        """Write the host facts of a decode step over ``seqs`` (at most ``num_rows`` decode
        rows; the rest is padding) into the persistent buffers. Raises ``ValueError`` /
        ``TypeError`` naming the sequence before anything is written.

        Host work: O(rows) Python and numpy calls, whatever the context length
        (`kvplan.backends.hybrid.static_facts.decode_rows`; block tables are converted once
        per state slot and table, ``buffers.tables``). A batch that fails a fast check goes
        through ``SequenceMetadata`` and the planning layer's checks, which name the error.

        Token values: only ``token_ids[q_start]`` (row i's input token, into ``input_ids``)
        is read; nothing else staged depends on a token. A step scheduled ahead stages a
        placeholder there, and its caller copies the real tokens over ``input_ids`` on the
        device before the step runs."""
        b = self.num_rows
        if len(seqs) > b:
            raise ValueError(f"{len(seqs)} sequences do not fit a step of {b} rows")
        rows = decode_rows(seqs, b, self.family.config, self.buffers.tables)
        if rows is None:  # a check fails (or a fact is unusual): the exact path names it
            rows = self._exact_rows(seqs)
        n, max_len = len(seqs), self.family.config.max_model_len
        if n and self.max_seqlen_k < max_len:  # a tier's step (past max_model_len: the
            longest = int(rows.q_start[:n].max()) + 1  # planning names the row)
            if self.max_seqlen_k < longest <= max_len:
                i = int(np.argmax(rows.q_start[:n]))
                raise ValueError(
                    f"seqs[{i}] reads {longest} tokens of context; this step holds rows up to "
                    f"max_seqlen_k = {self.max_seqlen_k}"
                )
        staged = stage_decode_on_device(rows.batch, self.family.config, out=self.buffers.out)
        self._write_inputs(rows)
        self._staged = staged
        self.seqs = list(seqs)

    def _exact_rows(self, seqs: list[HybridSeq]) -> SimpleNamespace:
        """The rows of ``seqs`` as ``SequenceMetadata`` (``batch``), whose staging runs the
        planning layer's checks: errors name the sequence, field and value."""
        b = self.num_rows
        for i, s in enumerate(seqs):
            if not isinstance(s, HybridSeq):
                raise TypeError(f"seqs[{i}] must be a HybridSeq, got {type(s).__name__}")
            if s.seqlen_q != 1:
                raise ValueError(f"seqs[{i}].seqlen_q = {s.seqlen_q}: decode rows only (1)")
            if len(s.token_ids) <= s.q_start:
                raise ValueError(
                    f"seqs[{i}].token_ids has {len(s.token_ids)} entries; needs "
                    f"q_start + 1 = {s.q_start + 1}"
                )
        metas = [
            SequenceMetadata(seqlen_q=1, seqlen_k=s.q_start + 1, block_table=s.block_table,
                             state_id=s.state_id, token_ids=s.token_ids[: s.q_start + 1])
            for s in seqs
        ] + [_PADDING] * (b - len(seqs))  # fmt: skip
        n = len(seqs)
        ph = np.zeros(b, dtype=bool)
        ph[n:] = True
        return SimpleNamespace(
            batch=metas,
            q_start=np.array([m.seqlen_k - 1 for m in metas], dtype=np.int64),
            state_id=np.array([m.state_id for m in metas], dtype=np.int64),
            is_placeholder=ph,
            input_ids=[s.token_ids[s.q_start] for s in seqs],
        )

    def _write_inputs(self, rows) -> None:
        """Token ids, positions and each series' compressor-state facts into a staging slot,
        then its upload (see the module docstring)."""
        b, cfg = self.num_rows, self.family.config
        host = self.buffers.host()
        n = len(rows.q_start) - int(rows.is_placeholder.sum())
        host[0, :b] = 0
        host[1, :b] = 0
        host[0, :n] = rows.input_ids[:n]
        host[1, :n] = rows.q_start[:n]
        sid = rows.state_id
        for (ratio, overlap), row in self.buffers.series.items():
            plan = plan_decode_compressor_state(
                rows.q_start, rows.state_id, rows.is_placeholder, ratio, overlap
            )
            big_r = plan.state_rows
            blk = host[row : row + SERIES_ROWS, :b]
            blk[0], blk[1], blk[2], blk[3] = sid * big_r, 0, big_r, 0  # stand-in: the ring
            blk[4:] = 0
            ents = plan.entry_seq  # decode: row t closes at most one entry, of sequence t
            blk[0:4, ents] = plan.window_facts.T
            blk[5, ents] = plan.positions
            blk[6, ents] = plan.entry_index
            store = plan.slot_mapping_store_state
            blk[4] = np.where(store >= 0, store, cfg.num_state_slots * big_r)
        self.buffers.upload()

    # ---- device -----------------------------------------------------------------------
    def begin(self) -> None:
        """The device half of the step (captured with the model): decode kernels, derived
        metadata, window expansion; resets the per-step call order checks."""
        if self._staged is None:
            raise RuntimeError("stage() must precede begin()")
        fam, cfg = self.family, self.family.config
        launch_decode_kernels(self._staged)
        meta = self._staged.meta
        meta.clean()  # derived fields are rebuilt on every run (inside a captured graph)
        self.meta = meta.compute_attn_info(cfg, check=fam.check)
        inputs, b = self.buffers.inputs, self.num_rows
        self._states = {}
        for (ratio, overlap), row in self.buffers.series.items():
            big_r = state_rows(ratio, overlap)
            ring_rows = cfg.num_state_slots * big_r
            facts = inputs[row : row + 4, :b].t()  # [b, 4]
            self._states[(ratio, overlap)] = SimpleNamespace(
                plan=SimpleNamespace(num_entries=b),
                ring_rows=ring_rows,
                window_index=expand_window_index(facts, big_r, ring_rows, torch.int64),
                store_rows=inputs[row + 4, :b],
                positions=inputs[row + 5, :b],
                entry_index=inputs[row + 6, :b],
                seq_index=self.buffers.row_ids[:b],
                slots=self.meta.slot_mapping_store_ca[ratio_key(ratio)],
            )
        self._windows_done = set()
        self._stored = set()
        self._cand_slots = {}
        self.traces = {}

    def _state(self, ratio: int, overlap: bool) -> SimpleNamespace:
        return self._states[(ratio, overlap)]
