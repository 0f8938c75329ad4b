"""DeepSeek-V4 models in the engine: the hybrid attention family beside the paged one.

A DeepSeek-V4 checkpoint (``config.json`` with ``model_type`` ``"deepseek_v4"``) is served by
`kvplan.models.deepseek_v4` on the hybrid family (`kvplan.backends.hybrid`): every layer's
attention is planned by `kvplan.plan` and stored in kvplan's paged formats
(`PlannedHybridFamily`). The engine side is small:

* `HybridEngineFamily` turns each `StepBatch` row into a `HybridSeq` (lengths from the step,
  block table and state slot from the `KVCacheManager`) and asks the family for the step's
  context;
* `HybridCausalLM` gives the model the engine's calling convention
  (``model(input_ids, positions, {family: plan}, logits_rows)``);
* `build_hybrid` sizes the cache manager (one block per ``block_size`` raw positions, one state
  slot per running request; blocks from ``num_blocks`` or ``kv_cache_memory``:
  `hybrid_num_blocks`) and the family's caches.

Prefix caching (``enable_prefix_caching``, on by default): full blocks of compressed entries
and indexer keys are shared like a dense model's KV blocks, and the per-sequence state a
block does not hold (the sliding-window ring, the overlapping compressors' pending rows) is
kept in snapshots taken at block boundaries (`kvplan.backends.hybrid.snapshots`,
``prefix_state_snapshots`` of them, default 4 x ``max_num_seqs``: each running request keeps
one decode-time snapshot, the rest hold prompts' boundaries), taken after every step whose
row ends at a multiple of ``block_size`` (a prompt chunk or a decode step; a request keeps
only its newest decode-time one) and registered under
the hash of the block that ends there. A prompt lookup then reuses the longest cached run of
blocks that ends at a snapshot, and the request's state slot is restored from it before its
first step. The state of a prompt is kept at its last block boundary below its length
(``Scheduler.resume_block_size``), so a repeated prompt, a preempted request and the next turn
of a conversation (whose prompt holds the last one's output) resume there. A prompt that finds
cached blocks but no snapshot at their end (another question after a shared system prompt)
recomputes them and keeps its state there too (``AllocationResult.num_shared_tokens``): later
prompts sharing that prefix resume at its end. Such a point inside a chunk does not end the
chunk (`KEEP_STATE_IN_CHUNK`): the snapshot is taken before the step and the step writes
the rows up to the point into it (`kvplan.backends.hybrid.snapshots.KeepPoints`).

CUDA graphs (CUDA, ``use_cuda_graph`` on by default there): decode-only steps replay the graph
of the smallest batch-size bucket that holds them (`kvplan.engine.hybrid_graphs`); the
family's ``plan`` then stages the step into the graph's persistent buffers instead of planning
an eager step. Every other step runs eagerly.

Async scheduling (`kvplan.engine.async_steps`; on by default with CUDA): a decode step
scheduled ahead (``StepBatch.ahead``) is planned before its input tokens reach the host. Its
plan needs no token value: lengths, block tables, state slots and the compressor windows
follow from the positions, and the model reads the input tokens (embedding, hash-routed MoE)
from the device tensor the runner hands it. So each row's ``token_ids`` end with a
placeholder for the pending input token (`PendingTokenIds`), and the graph (or the eager
model) reads the device copy of the previous step's sampled tokens instead.

Mapping of the model onto the planning layer (`kvplan.plan.MetadataConfig`): the sliding
window is ``window_size`` and the ring (``swa_block_size``); HCA layers' ratio is a dense
ratio, CSA layers' ratio a sparse ratio with the indexer's ``index_topk``; ``block_size`` is
the engine's, rounded up to a multiple of every ratio.

Speculative decoding (``num_speculative_tokens``, n-gram drafts): a verification row is a
chunk of ``1 + k`` rows at positions ``L .. L + k``. The sliding-window ring gets ``k`` slots
more than the window, and the compressor-state rows the drafts overwrite are copied before the
step and put back for the rejected ones (`kvplan.backends.hybrid.drafts`); ``k`` is at most
the smallest compressor-state ring less one (7 for DeepSeek-V4's CSA ratio 4). With prefix
caching, block boundaries inside a row's drafts are kept like boundaries inside a prompt chunk
(`KeepPoints`), then kept or discarded by what the row accepted (`drafts_verified`); a row
whose drafts were all accepted and that ends at a boundary is snapshotted after the step.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from kvplan.backends.hybrid.api import HybridSeq
from kvplan.backends.hybrid.snapshots import KeepPoints
from kvplan.engine.config import EngineConfig
from kvplan.engine.step import StepBatch
from kvplan.models.weights import read_config_json
from kvplan.ops._dispatch import env_flag

if TYPE_CHECKING:  # imported where used: the planning layer loads with the first hybrid model
    from kvplan.backends.hybrid.drafts import DraftRollback

HYBRID = "hybrid"
HYBRID_MODEL_TYPES = ("deepseek_v4",)
# EngineConfig.kv_format -> the family's kv_format (auto = the model dtype, kept exactly)
_KV_FORMATS = {"auto": "exact", "fp8": "fp8", "fp4": "fp4"}
_EXACT_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


KEEP_STATE_IN_CHUNK = env_flag("KVPLAN_KEEP_STATE_IN_CHUNK", True)
"""With prefix caching, a prompt's state at the block boundaries a later request may resume
from is kept inside its chunk (True, the default: `Scheduler`'s ``keep_state_in_chunk``; a
snapshot taken before the step, the rows before the boundary written into it during the step:
`kvplan.backends.hybrid.snapshots.KeepPoints`), instead of ending the chunk there and taking
the snapshot after it (``KVPLAN_KEEP_STATE_IN_CHUNK=0`` at import: one more step a prompt)."""

PENDING_TOKEN = 0  # stand-in for an input token still on the device (never read as a value)


class TailTokenIds(Sequence[int]):
    """A request's token ids (an O(1) view) followed by a few more entries (``tail``): the
    drafts a verification row feeds after its newest token, or `PendingTokenIds`'
    placeholder.

    Indexing, ``len`` and prefix slices cost O(1) (a prefix that ends before the tail is the
    base view's own slice); any other slice is a list.
    """

    __slots__ = ("_base", "_n", "_tail")

    def __init__(self, base: Sequence[int], tail: Sequence[int]) -> None:
        self._base = base
        self._n = len(base)
        self._tail = tuple(tail)

    def __len__(self) -> int:
        return self._n + len(self._tail)

    def __getitem__(self, index):  # type: ignore[override]
        size = self._n + len(self._tail)
        if isinstance(index, slice):
            start, stop, step = index.indices(size)
            if start == 0 and step == 1 and stop == size:
                return self
            if start == 0 and step == 1 and stop <= self._n:
                return self._base[:stop]
            return [self[i] for i in range(start, stop, step)]
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError(f"token index {index} outside [0, {size})")
        return self._base[index] if index < self._n else self._tail[index - self._n]


class PendingTokenIds(TailTokenIds):
    """A request's token ids (an O(1) view) plus one trailing entry, the input token of a
    step scheduled ahead, not yet on the host: it reads as ``PENDING_TOKEN``."""

    __slots__ = ()

    def __init__(self, base: Sequence[int]) -> None:
        super().__init__(base, (PENDING_TOKEN,))


class HybridEngineFamily:
    """The engine's face of a `PlannedHybridFamily` (the `AttentionFamily` protocol).

    With ``snapshots`` (a `kvplan.backends.hybrid.snapshots.StateSnapshots`) it is also the
    manager's `kvplan.cache.prefix_cache.PrefixState` (prefix caching, module docstring)."""

    name = HYBRID

    def __init__(
        self, family: Any, manager: Any, device: torch.device, snapshots: Any = None
    ) -> None:
        self.family = family
        self.manager = manager
        self.device = device
        self.graphs: Any = None  # a HybridDecodeGraphs when decode steps replay CUDA graphs
        # the planned step's verification rows and their saved state (speculative decoding)
        self._rollback: _Verification | None = None
        self.snapshots = snapshots
        self.block_size = family.config.block_size
        if snapshots is not None:
            manager.prefix_cache.state = self

    # ---- PrefixState --------------------------------------------------------------------
    def can_end(self, block_hash: bytes) -> bool:
        return self.snapshots.lookup(block_hash) is not None

    def blocks_hashed(self, request_id: Any, first_block: int, hashes: list[bytes]) -> None:
        self.snapshots.register(request_id, first_block, hashes)

    def reset(self) -> None:
        self.snapshots.clear()

    # ---- steps --------------------------------------------------------------------------
    def _restore(self, step: StepBatch) -> None:
        """Rows that start on a reused prefix (first step of a request whose first
        ``num_cached_tokens`` came from the prefix cache): their state slot gets the
        snapshot registered under the hash of the prefix's last block."""
        fam, m, bs = self.family, self.manager, self.block_size
        for rid, cached in zip(step.request_ids, step.num_cached_tokens.tolist()):
            if cached and not fam.holds(rid):
                req = m.requests.get(rid)
                self.snapshots.restore(req.hashes[cached // bs - 1], req.state_slot)
                fam.adopt(rid, req.state_slot, cached)

    def after_step(self, step: StepBatch) -> None:
        """Queue the snapshots of rows that end this step at a block boundary (right after
        the step's launches, before any later step rewrites their rings)."""
        if self.snapshots is None:
            return
        bs, m = self.block_size, self.manager
        ends = step.num_cached_tokens + step.num_query_tokens
        rows = (ends % bs == 0).nonzero()[0]
        if not rows.size:
            return
        entries = []
        for i in rows.tolist():
            if step.seqs[i].drafts:
                continue  # a verification row: after its drafts are checked (drafts_verified)
            rid = step.request_ids[i]
            req = m.requests.get(rid)
            if req.cacheable:
                decode = not step.seqs[i].is_prefill
                entries.append((rid, int(ends[i]) // bs - 1, req.state_slot, decode))
        if entries:
            self.snapshots.take(entries)

    def seqs(self, step: StepBatch) -> list[HybridSeq]:
        """One `HybridSeq` per row of ``step``, in step order. A step scheduled ahead
        (``step.ahead``: each row one position past its request's known tokens) gets
        `PendingTokenIds` (module docstring)."""
        m = self.manager
        view = _pending_view if step.ahead else _token_view
        return [
            HybridSeq(
                rid,
                cached,
                query,
                TailTokenIds(s.request.token_view, s.drafts) if s.drafts else view(s.request),
                m.get_block_ids_view(rid),
                m.get_state_slot(rid),
            )
            for s, rid, cached, query in zip(
                step.seqs,
                step.request_ids,
                step.num_cached_tokens.tolist(),
                step.num_query_tokens.tolist(),
            )
        ]

    def plan(self, step: StepBatch) -> Any:
        """The step's `HybridStepContext`: an eager planned step, or, for a step that replays
        a CUDA graph (``graphs.can_run``), the graph's staged static step."""
        if self.snapshots is not None and step.num_contexts:
            self._restore(step)
        if self.graphs is not None and self.graphs.can_run(step):
            return self.graphs.stage(self.seqs(step), step.ahead)
        positions = torch.from_numpy(step.positions).to(self.device)
        seqs = self.seqs(step)
        self._rollback = None
        verify = [i for i, s in enumerate(step.seqs) if s.drafts] if step.num_contexts else []
        keep, draft_points = self._kept_snapshots(step, verify)
        if verify:
            self._rollback = _Verification(verify, self._save_draft_state(step, verify),
                                           draft_points)  # fmt: skip
        return self.family.plan(seqs, positions, keep=keep)

    def _save_draft_state(self, step: StepBatch, rows: list[int]) -> DraftRollback:
        """The copies of the compressor-state rows that the drafts of ``step``'s verification
        rows ``rows`` overwrite (`kvplan.backends.hybrid.drafts`)."""
        from kvplan.backends.hybrid.drafts import DraftRollback

        m = self.manager
        facts = [
            (m.get_state_slot(step.request_ids[i]), int(step.num_cached_tokens[i]),
             len(step.seqs[i].drafts))
            for i in rows
        ]  # fmt: skip
        return DraftRollback(self.family, facts)

    def drafts_verified(self, step: StepBatch, accepted: dict[int, int]) -> None:
        """``step``'s verification rows were checked: row ``i`` accepted its first
        ``accepted[i]`` drafts. Puts back the compressor-state rows of the rejected drafts,
        sets each request's cached length to what it accepted, and, with prefix caching,
        discards the snapshot points inside drafts that were rejected and snapshots a row
        whose drafts were all accepted and that ends at a block boundary (all before the
        engine commits the tokens, which registers the snapshots)."""
        saved, self._rollback = self._rollback, None
        if saved is None:
            raise RuntimeError("drafts_verified: the step planned no verification rows")
        rows = saved.rows
        if sorted(accepted) != rows:
            raise ValueError(f"accepted names rows {sorted(accepted)}, the step verified {rows}")
        saved.rollback.restore([accepted[i] for i in rows])
        m, bs, entries = self.manager, self.block_size, []
        ends = {i: int(step.num_cached_tokens[i]) + 1 + accepted[i] for i in rows}
        for i, h in saved.points:  # boundaries inside the drafts: kept only where accepted
            if ends[i] < h:
                self.snapshots.discard(step.request_ids[i], h // bs - 1)
        for i in rows:
            rid = step.request_ids[i]
            req = m.requests.get(rid)
            self.family.adopt(rid, req.state_slot, ends[i])
            every = accepted[i] == len(step.seqs[i].drafts)  # (else a point covers the end)
            if self.snapshots is not None and every and ends[i] % bs == 0 and req.cacheable:
                entries.append((rid, ends[i] // bs - 1, req.state_slot, True))
        if entries:
            self.snapshots.take(entries)

    def _kept_snapshots(
        self, step: StepBatch, verify: list[int]
    ) -> tuple[KeepPoints | None, list[tuple[int, int]]]:
        """The snapshots of the step's ``keep_state_at`` points and of the block boundaries
        inside its verification rows' drafts (rows ``verify``): taken now (copies of the
        state slots before the step) and completed by the step (`KeepPoints`), or None; and
        the ``(row, boundary)`` of the drafts' points (`drafts_verified` keeps those its
        accepted tokens reach)."""
        if self.snapshots is None:
            return None, []
        bs, m = self.block_size, self.manager
        entries, where = [], []
        for i, seq in enumerate(step.seqs):
            if not seq.keep_state_at:
                continue
            rid = step.request_ids[i]
            req = m.requests.get(rid)
            if not req.cacheable:
                continue
            for h in seq.keep_state_at:
                entries.append((rid, h // bs - 1, req.state_slot, False))
                where.append((i, h))
        first_draft = len(where)
        for i in verify:  # boundaries h with L < h <= L + k: the state after draft h - L - 1
            rid = step.request_ids[i]
            req = m.requests.get(rid)
            if not req.cacheable:
                continue
            start = int(step.num_cached_tokens[i])
            for h in range((start // bs + 1) * bs, start + len(step.seqs[i].drafts) + 1, bs):
                entries.append((rid, h // bs - 1, req.state_slot, True))
                where.append((i, h))
        if not entries:
            return None, []
        slots = self.snapshots.take_early(entries)
        points = [(i, h, slot) for (i, h), slot in zip(where, slots) if slot is not None]
        drafts = [
            w for w, slot in zip(where[first_draft:], slots[first_draft:]) if slot is not None
        ]
        return (KeepPoints(self.snapshots, points) if points else None), drafts

    def free(self, request_id: Any) -> None:
        self.family.free(request_id)
        if self.snapshots is not None:
            self.snapshots.drop_pending(request_id)


class _Verification(NamedTuple):
    """A planned step's verification rows (step row indices), the copies that roll back
    their rejected drafts, and the ``(row, boundary)`` snapshot points inside their drafts."""

    rows: list[int]
    rollback: DraftRollback
    points: list[tuple[int, int]]


def _token_view(request: Any) -> Sequence[int]:
    return request.token_view


def _pending_view(request: Any) -> Sequence[int]:
    return PendingTokenIds(request.token_view)


class HybridCausalLM(nn.Module):
    """A DeepSeek-V4 model called the engine's way; every layer is served by ``"hybrid"``.
    Wrapping sets the model's ``float_logits`` False (logits in its dtype, as the engine's
    sampling reads them)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.layer_families = (HYBRID,) * model.config.num_layers
        model.float_logits = False  # logits in the model's dtype, as `build_model`'s

    @property
    def float_logits(self) -> bool:
        """The wrapped model's ``float_logits`` (fp32 logits, or the model's dtype)."""
        return self.model.float_logits

    @float_logits.setter
    def float_logits(self, value: bool) -> None:
        self.model.float_logits = value

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: dict[str, Any],
        logits_indices: torch.Tensor | None = None,
        *,
        argmax_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The wrapped model's step on the hybrid family's context (``argmax_out``: the greedy
        tokens, as `kvplan.models.deepseek_v4.DeepseekV4ForCausalLM.forward` fills them)."""
        return self.model(
            input_ids, positions, attention[HYBRID], logits_indices, argmax_out=argmax_out
        )


@dataclass(frozen=True)
class HybridSource:
    """A DeepSeek-V4 folder: its raw ``config.json`` and the parsed model config."""

    folder: Path
    raw: dict[str, Any]
    config: Any  # kvplan.models.deepseek_v4.DeepseekV4Config

    @property
    def max_position_embeddings(self) -> int:
        return int(self.raw.get("max_position_embeddings") or 4096)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.raw.get("eos_token_id")
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def hybrid_source(folder: Path) -> HybridSource | None:
    """The folder as a hybrid model, or None when its ``model_type`` is not a hybrid one."""
    if not (folder / "config.json").is_file():
        return None
    raw = read_config_json(folder)
    if raw.get("model_type") not in HYBRID_MODEL_TYPES:
        return None
    from kvplan.models.deepseek_v4 import DeepseekV4Config

    return HybridSource(folder, raw, DeepseekV4Config.from_hf(raw))


@dataclass
class HybridParts:
    model: HybridCausalLM
    family: HybridEngineFamily
    manager: Any
    block_size: int
    num_blocks: int
    max_model_len: int
    kv_format: str

    @property
    def resume_block_size(self) -> int:
        """`Scheduler.resume_block_size`: the block size with prefix caching (chunks end
        where snapshots can be taken), else 0."""
        return self.block_size if self.family.snapshots is not None else 0


def hybrid_block_size(block_size: int, ratios: list[int]) -> int:
    """``block_size`` rounded up to a multiple of every compression ratio."""
    step = math.lcm(*ratios) if ratios else 1
    return -(-block_size // step) * step


def hybrid_num_blocks(
    config: EngineConfig,
    specs: list,
    kv_format: str,
    block_size: int,
    max_blocks_per_seq: int,
    num_snapshots: int,
    ring_size: int | None = None,
) -> int:
    """Blocks of the compressed pools: ``num_blocks``, or what ``kv_cache_memory`` (default:
    `EngineConfig.resolve_kv_cache_memory`, measured after the weights are loaded) holds
    once the state slots (one per ``max_num_seqs``: rings and compressor state) and the
    prefix-cache snapshots are paid for, capped at what ``max_num_seqs`` sequences of
    ``max_model_len`` need; ValueError naming the setting when that is not one such sequence
    plus the padding block 0 (as the dense engine's pools)."""
    from kvplan.backends.hybrid.planned import cache_bytes

    need = max_blocks_per_seq + 1
    what = f"one sequence of max_model_len ({max_blocks_per_seq} blocks of {block_size} positions + the padding block 0)"
    if config.num_blocks is not None:
        if config.num_blocks < need:
            raise ValueError(f"num_blocks={config.num_blocks} cannot hold {what}")
        return config.num_blocks
    size = cache_bytes(specs, block_size=block_size, kv_format=kv_format,
                       dtype=config.torch_dtype, ring_size=ring_size)  # fmt: skip
    memory = config.resolve_kv_cache_memory()
    fixed = size.total(0, config.max_num_seqs, num_snapshots)
    num_blocks = min(
        (memory - fixed) // size.per_block, config.max_num_seqs * max_blocks_per_seq + 1
    )
    if num_blocks < need:
        raise ValueError(
            f"kv_cache_memory={memory} bytes cannot hold {what}: it needs "
            f"{size.total(need, config.max_num_seqs, num_snapshots)} bytes ({size.per_block} a "
            f"block, {size.per_state_slot} a state slot x max_num_seqs={config.max_num_seqs}, "
            f"{size.per_snapshot} a prefix state snapshot x {num_snapshots}); raise "
            "kv_cache_memory or lower max_model_len, max_num_seqs or prefix_state_snapshots"
        )
    return num_blocks


def build_hybrid(source: HybridSource, config: EngineConfig) -> HybridParts:
    """Model, cache manager and hybrid family for a DeepSeek-V4 folder (module docstring)."""
    from kvplan.backends.hybrid.drafts import max_drafts
    from kvplan.backends.hybrid.planned import PlannedHybridFamily
    from kvplan.cache import KVCacheManager
    from kvplan.models.deepseek_v4 import load_deepseek_v4

    drafts = config.num_speculative_tokens
    dev, dtype = config.torch_device, config.torch_dtype
    kv_format = _KV_FORMATS.get(config.kv_format)
    if config.kv_format in _EXACT_NAMES and _EXACT_NAMES[config.kv_format] == dtype:
        kv_format = "exact"
    if kv_format is None:
        raise ValueError(
            f"kv_format={config.kv_format!r} is not supported for DeepSeek-V4 models; use one "
            f"of {tuple(_KV_FORMATS)} or the model dtype's name"
        )
    cfg = source.config
    specs = cfg.layer_specs()
    cap = max_drafts(specs)
    if drafts and cap is not None and drafts > cap:
        raise ValueError(
            f"num_speculative_tokens={drafts}: this model's smallest compressor-state ring "
            f"holds {cap + 1} positions, so a verification row carries at most {cap} drafts"
        )
    # the sliding-window ring gets one slot per draft more (kvplan.backends.hybrid.drafts)
    ring_size = cfg.sliding_window + drafts if drafts else None
    ratios = sorted({s.ratio for s in specs if s.ratio})
    block_size = hybrid_block_size(config.block_size, ratios)
    max_model_len = config.model_max_len(source.max_position_embeddings)
    max_blocks_per_seq = -(-max_model_len // block_size)
    num_snapshots = 0
    if config.enable_prefix_caching:
        num_snapshots = config.prefix_state_snapshots or 4 * config.max_num_seqs
    model = load_deepseek_v4(source.folder, dtype=dtype, device=dev).eval()
    num_blocks = hybrid_num_blocks(
        config, specs, kv_format, block_size, max_blocks_per_seq, num_snapshots, ring_size
    )
    manager = KVCacheManager(
        num_blocks,
        block_size,
        max_blocks_per_seq=max_blocks_per_seq,
        num_state_slots=config.max_num_seqs,
        enable_prefix_caching=config.enable_prefix_caching,
    )
    family = PlannedHybridFamily(
        specs,
        block_size=block_size,
        num_blocks=num_blocks,
        num_state_slots=config.max_num_seqs,
        max_model_len=max_model_len,
        kv_format=kv_format,
        dtype=dtype,
        device=dev,
        ring_size=ring_size,
    )
    snapshots = None
    if num_snapshots:
        from kvplan.backends.hybrid.snapshots import StateSnapshots

        snapshots = StateSnapshots(family, num_snapshots)
    print(
        f"kvplan: DeepSeek-V4 hybrid attention, kv_format={kv_format}, block_size={block_size}, "
        f"{num_blocks} blocks, {config.max_num_seqs} state slots"
        + (
            ""
            if snapshots is None
            else f", {snapshots.capacity} prefix state snapshots of "
            f"{snapshots.nbytes_per_snapshot / 2**20:.2f} MiB"
        ),
        file=sys.stderr,
    )
    return HybridParts(
        HybridCausalLM(model),
        HybridEngineFamily(family, manager, dev, snapshots),
        manager,
        block_size,
        num_blocks,
        max_model_len,
        kv_format,
    )
