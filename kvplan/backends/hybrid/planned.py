"""``PlannedHybridFamily``: the hybrid family on kvplan's planning and storage layer.

Per step, each :class:`~kvplan.backends.hybrid.api.HybridSeq` becomes a
``kvplan.plan.SequenceMetadata``; ``prepare_prompt`` (a step with any chunk of more than one
row; decode rows ride along as one-row chunks) or ``prepare_decode`` /
``prepare_decode_on_device`` (every row a decode row) builds the ``InputMetadata`` and
``compute_attn_info`` expands it; ``kvplan.plan.compressor_state`` plans the compressor state
of each ``(ratio, overlap)``. :class:`~kvplan.backends.hybrid.planned_step.PlannedStep` then
serves the model's calls with ``store_kv_cache`` / ``load_paged_kv_cache`` and the index ops.

The model's layers map onto one ``MetadataConfig``::

    window_size     = the sliding window W (every layer's; all layers must agree)
    swa_block_size  = ring_size (default W: decode rows carry no drafts)
    dense_ratios    = the ratios of "heavily_compressed_attention" layers
    sparse_ratios   = the ratios of "compressed_sparse_attention" layers
    block_size      = block_size (a multiple of every ratio; one block per block_size raw
                      positions of the block table, block_size // r entries of ratio r)
    max_model_len   = max_model_len
    max_num_blocks  = ceil(max_model_len / block_size)
    num_kv_blocks   = num_blocks;  num_state_slots = num_state_slots

Caches the family owns (all zero-initialised), per layer: the SWA ring
``[num_state_slots, ring_size]`` rows of ``head_dim``; per compressed layer a pool of entries
``[num_blocks, block_size // r]`` for ``"compressor"`` and, for CSA, one of ``index_head_dim``
for ``"indexer"``; per compressed series a fp32 compressor-state ring of ``R = r`` (HCA) or
``2r`` (CSA) rows per state slot holding the projected ``kv`` and ``gate`` rows (plus one
trash row that absorbs skipped writes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvplan.backends.hybrid.api import HybridLayerSpec, HybridSeq
from kvplan.backends.hybrid.planned_step import PlannedStep
from kvplan.backends.hybrid.storage import PagedRows, index_format, main_format
from kvplan.ops._triton_util import new_merge_counters
from kvplan.plan.compressor_state import state_rows
from kvplan.plan.config import MetadataConfig

if TYPE_CHECKING:
    from kvplan.backends.hybrid.snapshots import KeepPoints
    from kvplan.formats import KVCacheFormat

DECODE_BUILDERS = ("auto", "eager", "device")


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def metadata_config(
    layers: Sequence[HybridLayerSpec],
    *,
    block_size: int,
    num_blocks: int,
    num_state_slots: int,
    max_model_len: int,
    ring_size: int | None = None,
    device: str | torch.device = "cpu",
) -> MetadataConfig:
    """The ``MetadataConfig`` of a hybrid model (mapping in the module docstring)."""
    if not layers:
        raise ValueError("layers is empty: a hybrid model needs at least one layer")
    for i, spec in enumerate(layers):
        if not isinstance(spec, HybridLayerSpec):
            raise TypeError(f"layers[{i}] must be a HybridLayerSpec, got {type(spec).__name__}")
    windows = sorted({spec.window for spec in layers})
    if len(windows) != 1:
        raise ValueError(f"layers disagree on the sliding window: {windows} (one window per model)")
    _positive("block_size", block_size)
    _positive("max_model_len", max_model_len)
    window = windows[0]
    ring = window if ring_size is None else _positive("ring_size", ring_size)
    kinds = {"heavily_compressed_attention": set(), "compressed_sparse_attention": set()}
    for spec in layers:
        if spec.kind in kinds:
            kinds[spec.kind].add(spec.ratio)
    return MetadataConfig(
        block_size=block_size,
        dense_ratios=tuple(sorted(kinds["heavily_compressed_attention"])),
        sparse_ratios=tuple(sorted(kinds["compressed_sparse_attention"])),
        window_size=window,
        swa_block_size=ring,
        max_model_len=max_model_len,
        max_num_blocks=-(-max_model_len // block_size),
        device=str(torch.device(device)),
        num_kv_blocks=_positive("num_blocks", num_blocks),
        num_state_slots=_positive("num_state_slots", num_state_slots),
    )


class CacheBytes(NamedTuple):
    """Bytes of a hybrid model's caches (`cache_bytes`): ``per_block`` (every compressed
    layer's ``"compressor"`` / ``"indexer"`` pool rows of one block), ``per_state_slot`` (the
    SWA ring of every layer and the fp32 compressor-state rings of one slot) and
    ``per_snapshot`` (what `kvplan.backends.hybrid.snapshots.StateSnapshots` copies of a slot:
    the rings, and the state rows of the overlapping series)."""

    per_block: int
    per_state_slot: int
    per_snapshot: int

    def total(self, num_blocks: int, num_state_slots: int, num_snapshots: int = 0) -> int:
        return (num_blocks * self.per_block + num_state_slots * self.per_state_slot
                + num_snapshots * self.per_snapshot)  # fmt: skip


def layer_series(
    spec: HybridLayerSpec, kv_format: str, index_kind: str | None, dtype: torch.dtype
) -> list[tuple[str, int, KVCacheFormat, int, int]]:
    """A compressed layer's series (none for a sliding layer), each ``(name, width, pool
    layout, compressor-state rows per slot, state row width)``: ``"compressor"`` in the main
    format, and for CSA ``"indexer"`` in the index format; the state rows hold ``kv`` and
    ``gate`` (CSA: both halves side by side)."""
    if spec.kind == "sliding_attention":
        return []
    fmt = main_format(kv_format, spec.head_dim, dtype)
    rows = state_rows(spec.ratio, spec.overlap)
    k = 2 if spec.overlap else 1
    out = []
    for name in ("compressor", "indexer") if spec.overlap else ("compressor",):
        width = spec.series_width(name)
        layout = index_format(kv_format, index_kind, width, dtype) if name == "indexer" else fmt
        out.append((name, width, layout, rows, k * width))
    return out


def cache_bytes(
    layers: Sequence[HybridLayerSpec],
    *,
    block_size: int,
    kv_format: str = "exact",
    index_format_kind: str | None = None,
    dtype: torch.dtype = torch.float32,
    ring_size: int | None = None,
) -> CacheBytes:
    """What `PlannedHybridFamily` allocates per block, per state slot and per state snapshot
    for these arguments (the family's own; the few bytes of each state ring's trash row are
    not counted), so that an engine can size its pools from a memory budget before
    allocating them."""
    per_block = per_slot = per_snapshot = 0
    for spec in layers:
        fmt = main_format(kv_format, spec.head_dim, dtype)
        ring_rows = spec.window if ring_size is None else ring_size
        per_slot += fmt.block_stride(ring_rows)
        per_snapshot += ring_rows * fmt.bytes_per_token  # the rows, not the block padding
        for _, _, layout, rows, cols in layer_series(spec, kv_format, index_format_kind, dtype):
            per_block += layout.block_stride(block_size // spec.ratio)
            state = 2 * rows * cols * 4  # fp32 kv and gate
            per_slot += state
            if spec.overlap:
                per_snapshot += state
    return CacheBytes(per_block, per_slot, per_snapshot)


class LayerCaches:
    """The caches of one layer (see the module docstring)."""

    def __init__(self, spec: HybridLayerSpec, family: PlannedHybridFamily, index: int) -> None:
        cfg, dev = family.config, family.device
        self.spec = spec
        self.index = index  # the layer's index in the family
        fmt = main_format(family.kv_format, spec.head_dim, family.dtype)
        self.ring = PagedRows(cfg.num_state_slots, cfg.swa_block_size, fmt, spec.head_dim,
                              device=dev, check=family.check)  # fmt: skip
        self.pools: dict[str, PagedRows] = {}
        self.state: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        series = layer_series(spec, family.kv_format, family.index_format, family.dtype)
        for name, width, layout, big_r, cols in series:
            tpb = cfg.block_size // spec.ratio
            self.pools[name] = PagedRows(cfg.num_kv_blocks, tpb, layout, width, device=dev,
                                         check=family.check)  # fmt: skip
            shape = (cfg.num_state_slots * big_r + 1, cols)  # + 1 trash row
            self.state[name] = (
                torch.zeros(shape, dtype=torch.float32, device=dev),
                torch.zeros(shape, dtype=torch.float32, device=dev),
            )


class PlannedHybridFamily:
    """The hybrid family planned by ``kvplan.plan`` (see the module docstring).

    Args:
        layers: one :class:`HybridLayerSpec` per model layer (layer index = list index).
        block_size, num_blocks: geometry of the compressed pools (block 0 is the reserved
            padding block; ``HybridSeq.block_table`` holds ``ceil(seqlen_k / block_size)``
            blocks at least).
        num_state_slots: state slots (``HybridSeq.state_id < num_state_slots``).
        max_model_len: longest sequence.
        kv_format: ``"exact"``, ``"fp8"`` or ``"fp4"`` (``kvplan.backends.hybrid.storage``).
        index_format: indexer key layout for quantized formats (``"mxfp8"``,
            ``"fp8_fp32sf"``, ``"fp4"``; None: the format's default).
        dtype: the model dtype (the exact layout keeps it).
        device: where caches and metadata live.
        ring_size: SWA ring slots per state slot (default: the window).
        decode_builder: ``"eager"`` (``prepare_decode``), ``"device"``
            (``prepare_decode_on_device``) or ``"auto"`` (device on CUDA, eager elsewhere).
        check: let the ops validate slots and load plans (host syncs).
        trace: keep each ``attend``'s row buffer and index table in ``PlannedStep.traces``.
    """

    def __init__(
        self,
        layers: Sequence[HybridLayerSpec],
        *,
        block_size: int,
        num_blocks: int,
        num_state_slots: int,
        max_model_len: int,
        kv_format: str = "exact",
        index_format: str | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        ring_size: int | None = None,
        decode_builder: str = "auto",
        check: bool = False,
        trace: bool = False,
    ) -> None:
        if decode_builder not in DECODE_BUILDERS:
            raise ValueError(
                f"decode_builder must be one of {DECODE_BUILDERS}, got {decode_builder!r}"
            )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.layers = tuple(layers)
        self.config = metadata_config(
            self.layers, block_size=block_size, num_blocks=num_blocks,
            num_state_slots=num_state_slots, max_model_len=max_model_len,
            ring_size=ring_size, device=device,
        )  # fmt: skip
        self.device = self.config.torch_device
        self.kv_format = kv_format
        self.index_format = index_format
        self.dtype = dtype
        self.check = check
        self.trace = trace
        # the split sparse attention's merge counters: this family's own, so that two
        # families (engines) on two streams never share them (`kvplan.ops.sparse_attention`)
        self.merge_counters = new_merge_counters(self.device)
        if decode_builder == "auto":
            decode_builder = "device" if self.device.type == "cuda" else "eager"
        self.decode_builder = decode_builder
        self.caches = [LayerCaches(spec, self, i) for i, spec in enumerate(self.layers)]
        self._cached_len: dict[int, int] = {}  # request_id -> tokens in the caches
        self._owner: dict[int, int] = {}  # state_id -> request_id

    def plan(
        self, seqs: list[HybridSeq], positions: torch.Tensor, keep: KeepPoints | None = None
    ) -> PlannedStep:
        """The context of one step (see ``HybridFamily.plan``); ``keep``: snapshots the step
        completes inside its prompt chunks (prompt steps only).

        Raises ``ValueError`` naming the sequence when a request continues (``q_start > 0``)
        from another length than the one its caches hold, or on a state slot another request
        wrote since; the planning layer's own checks name the field otherwise.
        """
        self.check_continuation(seqs)
        step = PlannedStep(self, seqs, positions, keep)
        self.record(seqs)
        return step

    def check_continuation(self, seqs: list[HybridSeq]) -> None:
        """The checks of `plan` on ``seqs`` (types; a continuing request's cached length and
        state slot owner), before anything is planned or written."""
        if not seqs:
            raise ValueError("seqs is empty: a step needs at least one sequence")
        for i, s in enumerate(seqs):
            if not isinstance(s, HybridSeq):
                raise TypeError(f"seqs[{i}] must be a HybridSeq, got {type(s).__name__}")
            if s.q_start > 0:
                held = self._cached_len.get(s.request_id)
                if held != s.q_start or self._owner.get(s.state_id) != s.request_id:
                    raise ValueError(
                        f"seqs[{i}] (request {s.request_id}): q_start = {s.q_start} but its "
                        f"caches hold {held} tokens in state slot {s.state_id} (owner "
                        f"{self._owner.get(s.state_id)}); restart it with q_start = 0"
                    )

    def record(self, seqs: list[HybridSeq]) -> None:
        """Note that a planned step over ``seqs`` will run (cached lengths, slot owners)."""
        for s in seqs:
            self._cached_len[s.request_id] = s.q_start + s.seqlen_q
            self._owner[s.state_id] = s.request_id

    def holds(self, request_id: int) -> bool:
        """Whether the caches hold tokens of ``request_id`` (a step of it was planned, or it
        was `adopt`-ed, and it was not freed since)."""
        return request_id in self._cached_len

    def adopt(self, request_id: int, state_id: int, num_tokens: int) -> None:
        """Record that ``state_id`` now holds ``request_id``'s state after its first
        ``num_tokens`` tokens (a restored snapshot, `kvplan.backends.hybrid.snapshots`): its
        next step continues with ``q_start = num_tokens``."""
        self._cached_len[request_id] = num_tokens
        self._owner[state_id] = request_id

    def free(self, request_id: int) -> None:
        """Forget a request (its slots go back to the engine's cache manager)."""
        self._cached_len.pop(request_id, None)
        for sid in [k for k, v in self._owner.items() if v == request_id]:
            del self._owner[sid]
