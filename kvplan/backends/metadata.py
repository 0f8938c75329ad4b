"""The attention-metadata contract shared by every backend (seed 001, "AttentionMetadata").

One ``AttentionMetadata`` object is the only hand-off between the scheduler/engine and the
attention layers of one forward step. Its fields fall in three groups:

* capacity, fixed at construction: ``max_num_requests``, ``max_num_tokens``,
  ``max_num_sequences`` (rows after beam expansion). Every device buffer is allocated once at
  capacity and written in place, so CUDA graphs that recorded its address stay valid.
* per-step shape: ``seq_lens`` (query tokens of each sequence this step; a CPU tensor and a
  device copy written in place), ``num_contexts`` (context/prefill sequences come first),
  ``beam_width`` (generation requests expand to that many rows). The derived counts
  ``num_seqs``, ``num_generations``, ``num_ctx_tokens``, ``num_tokens`` are computed in the
  setters (host values only), so the forward pass never has to sync or compute a
  data-dependent shape.
* the KV ledger: ``kv_cache_manager`` + ``request_ids`` (the keys to ask it for blocks; the
  metadata never owns a block table between steps), ``num_cached_tokens_per_seq`` (tokens
  already in the cache before this step), ``prompt_lens``, ``kv_cache`` (a ``KVCacheTensors``)
  and ``layer_windows``.

Cross attention is encoded by object identity: ``seq_lens_kv`` returns the very ``seq_lens``
object unless a separate tensor was assigned, and ``is_cross`` is ``seq_lens is not
seq_lens_kv``. For cross attention ``seq_lens_kv[b]`` is the number of encoder tokens written
this step (all of them on a context row, 0 on a generation row); the attended length is always
``kv_lens = num_cached_tokens_per_seq + seq_lens_kv``, for self and cross attention alike.

An encoder-decoder step therefore uses two metadata objects: the self-attention one, and a
cross one with the same ``seq_lens`` values and ``seq_lens_kv`` assigned.

``prepare()`` is host work only (no device sync): the shared length math and checks
(``_prepare_common``), then the backend gathers its kernel format from the manager's tables
(``_step_rows``, ``KVCacheManager.batch_tables``) straight into the step's staging buffer and
sends every field in ONE async copy (``DeviceArena``). A step whose rows each write one K/V
token takes decode branches (``decode_fast_path``; tests hold them equal to the general path).

Row layout of a batch with ``num_contexts = 2``, two generation requests and ``beam_width = 2``::

    request_ids  = [r0, r1, r2, r3]
    rows (seqs)  =  r0  r1  r2.b0  r2.b1  r3.b0  r3.b1      num_seqs = 2 + 2 * 2 = 6
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvplan._checks import INT32_MAX
from kvplan.backends.device_expand import DeviceExpander, expand_on_device_default
from kvplan.backends.host_arrays import (
    MAX,
    IntArrayLike,
    as_lengths,
    exclusive_cumsum,
)
from kvplan.backends.ledger import (
    StepRows,
    block_column,
    decode_last_blocks,
    last_needed_blocks,
    logical_num_blocks,
    new_token_positions,
    pool_rows,
)
from kvplan.backends.sparse import SparseMetadataParams, SparseRuntimeParams
from kvplan.backends.staging import use_pinned
from kvplan.backends.step_shape import StepShape


class AttentionMetadata(StepShape):
    """Per-step attention metadata; subclasses' ``prepare()`` build their kernel formats.

    Args:
        max_num_requests: most requests in one batch (rows of request-indexed buffers).
        max_num_tokens: most query tokens in one step.
        max_num_sequences: most sequences (rows after beam expansion); default
            ``max_num_requests``.
        kv_cache_manager: a ``kvplan.cache.KVCacheManager`` (or ``None``: context-only batches
            without a cache, e.g. an encoder).
        kv_cache: a ``kvplan.cache.KVCacheTensors`` the layers store into and read from.
        layer_windows: per-layer sliding window (``None`` = full attention), used when the
            backend object has no window of its own.
        device: where the device copies live (default: ``kv_cache``'s device, else CPU).
        is_cuda_graph: this object feeds a captured CUDA graph (buffers must never move).
        sparse_metadata_params: ``None`` for dense attention (see ``kvplan.backends.sparse``).

    Example::

        md = VanillaAttentionMetadata(max_num_requests=8, max_num_tokens=256,
                                      kv_cache_manager=mgr, kv_cache=kv)
        md.request_ids = [7, 9]
        md.num_contexts = 1
        md.seq_lens = [5, 1]                 # 5 prompt tokens, 1 decode token
        md.num_cached_tokens_per_seq = [0, 12]
        md.prepare()                         # host math + staged H2D copies
        out = backend.forward(q, k, v, md)   # q: [6, H, D]
    """

    # take the decode branches of prepare() when a step writes one K/V token per row (tests
    # turn this off to hold them equal to the general path)
    decode_fast_path = True

    # expand a step's per-token slots (and the ragged page list) on the device from per-row
    # facts (``kvplan.backends.device_expand``); default: on when ``device`` is a GPU. False
    # keeps every field on the host path (numpy), e.g. for A/B runs; tests hold both equal.
    expand_on_device: bool

    def __init__(
        self,
        *,
        max_num_requests: int,
        max_num_tokens: int,
        max_num_sequences: int | None = None,
        kv_cache_manager: Any = None,
        kv_cache: Any = None,
        layer_windows: Sequence[int | None] | None = None,
        device: torch.device | str | None = None,
        is_cuda_graph: bool = False,
        sparse_metadata_params: SparseMetadataParams | None = None,
    ) -> None:
        if max_num_sequences is None:
            max_num_sequences = max_num_requests
        for name, val in (
            ("max_num_requests", max_num_requests),
            ("max_num_tokens", max_num_tokens),
            ("max_num_sequences", max_num_sequences),
        ):
            if not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if max_num_sequences < max_num_requests:
            raise ValueError(
                f"max_num_sequences ({max_num_sequences}) must be >= max_num_requests "
                f"({max_num_requests})"
            )
        self.max_num_requests = max_num_requests
        self.max_num_tokens = max_num_tokens
        self.max_num_sequences = max_num_sequences
        self.kv_cache_manager = kv_cache_manager
        self.kv_cache = kv_cache
        self.layer_windows = None if layer_windows is None else tuple(layer_windows)
        if device is None:
            device = getattr(kv_cache, "device", None) or "cpu"
        self.device = torch.device(device)
        self.is_cuda_graph = is_cuda_graph
        self.pinned = use_pinned(self.device)
        self.expand_on_device = expand_on_device_default(self.device)
        self._expander: DeviceExpander | None = None
        self._expand_args: dict[Any, tuple] = {}  # _bind_expansion's key -> kernel arguments
        self.sparse_metadata_params = sparse_metadata_params
        self.sparse_runtime_params = SparseRuntimeParams()

        # per-step ledger (plain host values)
        self.request_ids: list[int] = []
        self.prompt_lens: list[int] | None = None
        self.num_cached_tokens_per_seq: IntArrayLike | None = None
        self.beam_width = 1
        self._init_step_shape()  # seq_lens, seq_lens_kv, num_contexts and derived counts
        self.prepared = False
        self.kv_lens_np = np.zeros(0, np.int32)
        self.max_kv_len = 0
        self.cached_np = np.zeros(0, np.int32)
        # whether this step's rows each hold one query token (cu_seqlens_q is an arange) and
        # write one new K/V token (decode), set by _prepare_common()
        self.one_query_per_row = False
        self.one_kv_token_per_row = False
        # 0, 1, ..., as read-only int32 (cu_seqlens_q of a decode step, row numbers)
        self._arange = np.arange(max(max_num_sequences, max_num_tokens) + 1, dtype=np.int32)
        self._arange.flags.writeable = False
        mgr = kv_cache_manager
        self._block_size = 0 if mgr is None else int(mgr.block_size)
        self._max_blocks_per_seq = 0 if mgr is None else int(mgr.max_blocks_per_seq)
        self._num_pools = 1 if mgr is None else int(mgr.num_pools)
        # each pool's table as TableRows (row b at rows[b] * max_blocks_per_seq), per batch
        self._pools: list = []
        self._pools_rows = self._pools_tables = None
        self._row_last = np.zeros(0, np.int64)  # row_start - 1, per batch
        # device copy of seq_lens, allocated once at capacity and written in place
        self._seq_lens_gpu = torch.zeros(max_num_sequences, dtype=torch.int32, device=self.device)

    # ---------------------------------------------------------------- prepare
    def prepare(self) -> None:
        """Build this step's kernel format: shared host math, then the backend's own part.

        Must run after the last change of a per-step field and before the layers' forward.
        """
        self.prepared = False
        self._prepare_common()
        self._prepare_backend()
        if self._seq_lens_pending:  # backends without an arena copy it on its own
            self._flush_seq_lens()
        self.prepared = True

    def _prepare_backend(self) -> None:
        """The backend-specific part of ``prepare()`` (subclasses override)."""

    def slot_mapping(self, pool: int = 0) -> torch.Tensor:
        """Cache slots of this step's new K/V tokens in ``pool``: int64 ``[num_kv_tokens]``."""
        raise NotImplementedError(f"{type(self).__name__} has no slot mapping")

    def _prepare_common(self) -> None:
        """Validate the step and do the host length math every backend shares.

        Sets (host numpy int32) ``cached_np`` and ``kv_lens_np`` ``[num_seqs]``,
        ``cu_seqlens_q_np`` and ``cu_seqlens_kv_np`` ``[num_seqs + 1]`` (read-only: an arange
        view on a one-token-per-row step), ``max_kv_len`` and ``num_cached_tokens`` (sum of
        ``cached_np``; host ints), ``num_requests``, and the two decode flags
        ``one_query_per_row`` / ``one_kv_token_per_row``.
        """
        n = self._num_seqs
        nc = self._num_contexts
        if not self._seq_lens_set:
            raise ValueError("seq_lens must be set before prepare()")
        if nc > n:
            raise ValueError(f"num_contexts={nc} exceeds the number of sequences {n}")
        if self.is_cuda_graph and nc:
            raise ValueError(
                f"a CUDA-graph metadata object runs decode-only batches, got num_contexts={nc} "
                "(mixed prefill/decode shapes change every step and cannot be captured)"
            )
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an int >= 1, got {self.beam_width!r}")
        kv_np = self._seq_lens_np if self._seq_lens_kv_np is None else self._seq_lens_kv_np
        if kv_np.size != n:
            raise ValueError(f"seq_lens_kv has {kv_np.size} entries, expected {n}")
        if self._num_tokens > self.max_num_tokens:
            raise ValueError(
                f"this step has {self._num_tokens} tokens, more than max_num_tokens="
                f"{self.max_num_tokens}"
            )
        num_gen_requests, rem = divmod(n - nc, self.beam_width)
        if rem:
            raise ValueError(
                f"{n - nc} generation rows are not a multiple of beam_width={self.beam_width}"
            )
        num_requests = nc + num_gen_requests
        if (self.kv_cache_manager is not None or self.request_ids) and len(
            self.request_ids
        ) != num_requests:
            raise ValueError(
                f"request_ids has {len(self.request_ids)} entries, expected num_contexts + "
                f"generation rows / beam_width = {num_requests}"
            )
        if num_requests > self.max_num_requests:
            raise ValueError(
                f"{num_requests} requests exceed max_num_requests={self.max_num_requests}"
            )
        if self.num_cached_tokens_per_seq is None:
            cached, self.num_cached_tokens = np.zeros(n, np.int32), 0
        else:
            cached, self.num_cached_tokens, _ = as_lengths(
                "num_cached_tokens_per_seq", self.num_cached_tokens_per_seq
            )
            if cached.size != n:
                raise ValueError(
                    f"num_cached_tokens_per_seq has {cached.size} entries, expected {n}"
                )
        if self.kv_cache_manager is None and cached.any():
            raise ValueError("num_cached_tokens_per_seq must be 0 without a kv_cache_manager")
        if self.num_cached_tokens + self._num_kv_tokens > INT32_MAX:  # bounds every kv_len
            big = cached.astype(np.int64) + kv_np
            if int(MAX(big)) > INT32_MAX:
                b = int(np.argmax(big))
                raise ValueError(
                    f"num_cached_tokens_per_seq[{b}] + seq_lens_kv[{b}] = {int(big[b])} "
                    "overflows int32"
                )
        self.num_requests = num_requests
        self.cached_np = cached
        self._kv_np = kv_np  # = seq_lens_kv_np, for the backends' prepare (no property call)
        self.kv_lens_np = kv_lens = cached + kv_np
        self.max_kv_len = int(MAX(kv_lens)) if n else 0
        # one query token per row: cu_seqlens_q is an arange
        one_q = self.one_query_per_row = self._seq_lens_all_ones
        if one_q:
            self.cu_seqlens_q_np = self._arange[: n + 1]
        else:
            self.cu_seqlens_q_np = exclusive_cumsum(self._seq_lens_np, self._num_tokens)
        self._num_ctx_tokens = int(self.cu_seqlens_q_np[nc])
        if self._seq_lens_kv_np is None:
            self.one_kv_token_per_row = one_q
            self.cu_seqlens_kv_np = self.cu_seqlens_q_np
        else:
            self.one_kv_token_per_row = self._seq_lens_kv_all_ones
            self.cu_seqlens_kv_np = exclusive_cumsum(self._seq_lens_kv_np, self._num_kv_tokens)

    # what a backend's expansion writes besides the slots (``DeviceExpander`` flags)
    _expand_slots64 = False
    _expand_token_rows = False

    def _expand_on_device(self, key: Any = None) -> None:
        """Launch this step's device expansion over rows ``[0, num_seqs)``, after the
        arena's copy. The kernel arguments come from ``_bind_expansion(expander, key)``, made
        once per ``key`` (what they depend on beyond the fixed arena offsets)."""
        args = self._expand_args.get(key)
        if args is None:
            if self._expander is None:
                self._expander = DeviceExpander(
                    self.arena.buffer, num_pools=self._num_pools,
                    slots64=self._expand_slots64, token_rows=self._expand_token_rows,
                )  # fmt: skip
            args = self._expand_args[key] = self._bind_expansion(self._expander, key)
        self._expander.launch(self._num_seqs, args)

    def _bind_expansion(self, expander: DeviceExpander, key: Any) -> tuple:
        """``expander.bind(...)`` of this backend's expansion (subclasses that expand)."""
        raise NotImplementedError(f"{type(self).__name__} expands nothing on the device")

    def _expands_tokens(self, decode: bool) -> bool:
        """Whether the device expands this step's per-token slots: a general step (a decode
        step's slots are O(rows) on the host) that is not cross attention (its K/V tokens
        are not the queries' rows)."""
        return self.expand_on_device and not decode and self._seq_lens_kv is None

    def _step_rows(
        self, *, decode: bool, extra_tokens: int = 0, per_token: bool = True
    ) -> StepRows:
        """The batch's block-table rows in every pool, checked, and where each new K/V token
        goes (backends with a ``kv_cache_manager``; call after ``_prepare_common``).

        Every row must own the blocks of its first ``kv_lens + extra_tokens`` tokens. On a
        ``decode`` step (one new K/V token per row at position ``cached``; needs
        ``extra_tokens == 0``) that is the block of the new token, gathered once per pool
        (the slots follow from it); otherwise the last needed block of each row is checked
        and the new tokens' positions and block indices are derived per token, unless
        ``per_token`` is False (the device expands them; ``index``, ``in_block`` and
        ``positions`` are then None).
        """
        bs, cached, n = self._block_size, self.cached_np, self._num_seqs
        bt = self.kv_cache_manager.batch_tables(
            self.request_ids, self.beam_width, self._num_contexts,
            cross=self._seq_lens_kv is not None,
        )  # fmt: skip
        pools = self._pools
        if bt.rows is not self._pools_rows or bt.tables is not self._pools_tables:
            # per batch: the manager hands out the same arrays while the batch stays
            start = bt.rows * self._max_blocks_per_seq  # int64 [n]
            pools = self._pools = [pool_rows(bt, p, start) for p in range(self._num_pools)]
            self._pools_rows, self._pools_tables = bt.rows, bt.tables
            self._row_last = start - 1  # + blocks needed = flat index of a row's last block
        if decode:
            assert not extra_tokens, "a decode step's new token is each row's last"
            column, in_block = block_column(cached, bs)
            index = pools[0].row_start[:n] + column
            max_column = (self.max_kv_len - 1) // bs
            last = [decode_last_blocks(t, column, max_column, index=index) for t in pools]
            column += 1  # blocks each row owns
            return StepRows(bt, pools, column, index, in_block, cached, last)
        lens = self.kv_lens_np + np.int32(extra_tokens) if extra_tokens else self.kv_lens_np
        needed = logical_num_blocks(lens, bs)
        what = "kv_lens (incl. num_extra_kv_tokens)" if extra_tokens else "kv_lens"
        max_needed = -(-(self.max_kv_len + extra_tokens) // bs)
        index = self._row_last[:n] + needed  # each row's last needed block, in every pool
        for t in pools:
            last_needed_blocks(t, needed, what, max_needed=max_needed, check_only=True, index=index)
        if not per_token:
            return StepRows(bt, pools, needed, None, None, None, None)
        new_lens = self._kv_np
        positions = new_token_positions(cached, self.cu_seqlens_kv_np, new_lens, self._arange)
        column, in_block = block_column(positions, bs)
        index = pools[0].row_start[:n].repeat(new_lens)
        index += column
        return StepRows(bt, pools, needed, index, in_block, positions, None)

    def prepare_encoder_only(self) -> None:
        """Setup for a forward without a KV cache; defaults to the full ``prepare()``."""
        self.prepare()
