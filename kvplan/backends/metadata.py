"""``AttentionMetadata``: the contract between the engine and the attention layers.

One object is the only hand-off between the scheduler/engine and the attention layers of one
forward step. Its fields fall in three groups:

* capacity, fixed at construction: ``max_num_requests``, ``max_num_tokens``,
  ``max_num_sequences`` (rows after beam expansion). Every device buffer is allocated once at
  capacity and written in place, so CUDA graphs that recorded its address stay valid.
* per-step shape: ``seq_lens`` (query tokens of each sequence this step; an int32 CPU tensor
  and a device copy written in place), ``seq_lens_kv`` (new K/V tokens, the very ``seq_lens``
  object unless assigned), ``num_contexts`` (context/prefill sequences come first),
  ``beam_width`` (generation requests expand to that many rows). Each setter validates its
  value into a fresh int32 host array and refreshes the derived host counts ``num_seqs``,
  ``num_generations``, ``num_ctx_tokens``, ``num_tokens``, ``num_kv_tokens``, so the forward
  pass never syncs or computes a data-dependent shape.
* the KV ledger: ``kv_cache_manager`` + ``request_ids`` (the keys ``prepare()`` uses to ask
  it for block tables; the metadata never owns a block table between steps),
  ``num_cached_tokens_per_seq`` (tokens in the cache before this step), ``prompt_lens``,
  ``kv_cache`` (a ``KVCacheTensors``) and ``layer_windows``.

Cross attention is encoded by object identity: ``is_cross`` is ``seq_lens is not
seq_lens_kv``. ``seq_lens_kv[b]`` is then the number of encoder tokens written this step (all
of them on a context row, 0 on a generation row); the attended length is always ``kv_lens =
num_cached_tokens_per_seq + seq_lens_kv``. An encoder-decoder step uses two metadata objects.

One step: ``set_step(...)`` (or the setters, in any order), then ``prepare()``: host work only
(no device sync). ``_prepare_common`` does the shared checks and length math, then the
backend's ``_prepare_backend`` builds its kernel format (``paged_metadata.PagedMetadata``
holds what the three backends share). A step whose rows each write one K/V token takes decode
branches (``decode_fast_path``; tests hold them equal to the general path).

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
from kvplan._math import exclusive_cumsum
from kvplan.backends.lengths import MAX, SUM, IntArrayLike, as_lengths
from kvplan.backends.sparse import SparseMetadataParams, SparseRuntimeParams
from kvplan.backends.staging import copy_to, host_empty, use_pinned


class AttentionMetadata:
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
        md.set_step(request_ids=[7, 9], prompt_lens=None, num_cached_tokens_per_seq=[0, 12],
                    seq_lens=[5, 1], num_contexts=1)   # 5 prompt tokens, 1 decode token
        md.prepare()                         # host math + one staged H2D copy
        out = backend.forward(q, k, v, md)   # q: [6, H, D]
    """

    # take the decode branches of prepare() when a step writes one K/V token per row (tests
    # turn this off to hold them equal to the general path)
    decode_fast_path = True

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
        self.sparse_metadata_params = sparse_metadata_params
        self.sparse_runtime_params = SparseRuntimeParams()
        # the KV ledger (plain host values)
        self.request_ids: list[int] = []
        self.prompt_lens: list[int] | None = None
        self.num_cached_tokens_per_seq: IntArrayLike | None = None
        self.beam_width = 1
        # per-step shape (the setters' state)
        self._seq_lens: torch.Tensor | None = None  # made from _seq_lens_np on first read
        self._seq_lens_set = False
        self._seq_lens_np = np.zeros(0, np.int32)
        self._seq_lens_all_ones = False
        self._seq_lens_pending = False  # the device copy is behind the host value
        self._seq_lens_kv: torch.Tensor | None = None
        self._seq_lens_kv_np: np.ndarray | None = None
        self._seq_lens_kv_total, self._seq_lens_kv_all_ones = 0, False
        self._num_contexts = self._num_seqs = self._num_generations = 0
        self._num_ctx_tokens: int | None = 0
        self._num_tokens = self._num_kv_tokens = 0
        # the step's recent-window ring facts (`kvplan.cache.recent_window.RecentStep`), set by
        # the paged family after each step's prepare() when kv_exact_window is on; else None
        self.recent = None
        # set by prepare()
        self.prepared = False
        self.num_requests = self.max_kv_len = self.num_cached_tokens = 0
        self.kv_lens_np, self.cached_np = np.zeros(0, np.int32), np.zeros(0, np.int32)
        # whether this step's rows each hold one query token (cu_seqlens_q is an arange) and
        # write one new K/V token (decode)
        self.one_query_per_row = self.one_kv_token_per_row = False
        # 0, 1, ..., as read-only int32 (cu_seqlens_q of a decode step, row numbers)
        self._arange = np.arange(max(max_num_sequences, max_num_tokens) + 1, dtype=np.int32)
        self._arange.flags.writeable = False
        # device copy of seq_lens, allocated once at capacity and written in place
        # (subclasses replace it by their arena's "seq_lens" field)
        self._seq_lens_gpu = torch.zeros(max_num_sequences, dtype=torch.int32, device=self.device)

    # ---------------------------------------------------------------- one step's fields
    def set_step(
        self,
        request_ids: list[int],
        prompt_lens: list[int] | None,
        num_cached_tokens_per_seq: IntArrayLike | None,
        seq_lens: IntArrayLike,
        num_contexts: int,
    ) -> None:
        """Set one step's per-step fields together (``seq_lens_kv`` and ``beam_width`` keep
        their values); then call ``prepare()``. Same checks as the setters."""
        self._check_num_contexts(num_contexts)
        self.seq_lens = seq_lens  # validated first: a bad value changes nothing else
        self.request_ids = request_ids
        self.prompt_lens = prompt_lens
        self.num_cached_tokens_per_seq = num_cached_tokens_per_seq
        self._num_contexts = int(num_contexts)
        self.on_update()

    @property
    def seq_lens(self) -> torch.Tensor | None:
        """Query tokens of each sequence this step: int32 CPU tensor ``[num_seqs]``."""
        if self._seq_lens is None and self._seq_lens_set:
            # _seq_lens_np is a fresh array (as_lengths copies), never rewritten; the tensor
            # is made on first read only (prepare() works on the numpy array)
            self._seq_lens = torch.from_numpy(self._seq_lens_np)
        return self._seq_lens

    @seq_lens.setter
    def seq_lens(self, value: IntArrayLike) -> None:
        arr, total, all_ones = as_lengths("seq_lens", value)
        if arr.size > self.max_num_sequences:
            raise ValueError(
                f"seq_lens has {arr.size} sequences, more than max_num_sequences="
                f"{self.max_num_sequences}"
            )
        self._seq_lens = None
        self._seq_lens_set = True
        self._seq_lens_np = arr
        # The device copy is written in place (never reallocated: a captured graph keeps
        # reading the same address), but lazily: prepare() stages it with its other fields in
        # one host-to-device copy; reading seq_lens_gpu before that copies it on the spot.
        self._seq_lens_pending = True
        self._seq_lens_all_ones = all_ones
        self._num_tokens = total
        self.on_update()

    @property
    def seq_lens_np(self) -> np.ndarray:
        """Host copy of ``seq_lens``: int32 ``[num_seqs]`` (read-only by convention)."""
        return self._seq_lens_np

    @property
    def seq_lens_gpu(self) -> torch.Tensor:
        """Device copy of ``seq_lens``: int32 ``[num_seqs]`` view of a capacity buffer."""
        if self._seq_lens_pending:
            self._flush_seq_lens()
        return self._seq_lens_gpu[: self._num_seqs]

    # the seed's name for the same tensor
    seq_lens_cuda = seq_lens_gpu

    @property
    def seq_lens_kv(self) -> torch.Tensor | None:
        """KV tokens written this step per sequence; the ``seq_lens`` object itself unless set."""
        return self.seq_lens if self._seq_lens_kv is None else self._seq_lens_kv

    @seq_lens_kv.setter
    def seq_lens_kv(self, value: IntArrayLike | None) -> None:
        if value is None:
            self._seq_lens_kv, self._seq_lens_kv_np = None, None
        else:
            arr, total, all_ones = as_lengths("seq_lens_kv", value)
            self._seq_lens_kv = torch.from_numpy(arr)
            self._seq_lens_kv_np = arr
            self._seq_lens_kv_total, self._seq_lens_kv_all_ones = total, all_ones
        self.on_update()

    @property
    def seq_lens_kv_np(self) -> np.ndarray:
        """Host copy of ``seq_lens_kv``: int32 ``[num_seqs]``."""
        return self._seq_lens_np if self._seq_lens_kv_np is None else self._seq_lens_kv_np

    @property
    def is_cross(self) -> bool:
        """Cross attention iff ``seq_lens_kv`` is a different object from ``seq_lens`` (the
        ``seq_lens_kv`` setter always stores a fresh tensor: exactly "one was assigned")."""
        return self._seq_lens_kv is not None

    @property
    def num_contexts(self) -> int:
        return self._num_contexts

    @num_contexts.setter
    def num_contexts(self, value: int) -> None:
        self._check_num_contexts(value)
        self._num_contexts = int(value)
        self.on_update()

    @staticmethod
    def _check_num_contexts(value: int) -> None:
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"num_contexts must be an int >= 0, got {value!r}")

    def on_update(self) -> None:
        """Recompute the derived counts from host values (called by every shape setter)."""
        self.prepared = False
        nc = self._num_contexts
        self._num_seqs = n = self._seq_lens_np.size
        # (num_contexts may exceed the row count between two setter calls; prepare() checks)
        self._num_ctx_tokens = None if nc else 0  # sum(seq_lens[:nc]), taken when first read
        self._num_generations = max(0, n - nc)
        # _num_tokens = sum(seq_lens) is kept by the seq_lens setter
        kv = self._seq_lens_kv_np
        self._num_kv_tokens = self._num_tokens if kv is None else self._seq_lens_kv_total

    @property
    def num_seqs(self) -> int:
        return self._num_seqs

    @property
    def num_generations(self) -> int:
        """Generation rows (after beam expansion)."""
        return self._num_generations

    @property
    def num_ctx_tokens(self) -> int:
        if self._num_ctx_tokens is None:  # (prepare() reads it off cu_seqlens_q instead)
            self._num_ctx_tokens = int(SUM(self._seq_lens_np[: self._num_contexts]))
        return self._num_ctx_tokens

    @property
    def num_tokens(self) -> int:
        """Query tokens this step (rows of q). Deviation from the seed: never the KV count."""
        return self._num_tokens

    @property
    def num_kv_tokens(self) -> int:
        """New K/V rows this step (rows of k and v); equals ``num_tokens`` unless cross."""
        return self._num_kv_tokens

    # ---------------------------------------------------------------- prepare
    def prepare(self) -> None:
        """Build this step's kernel format: shared host math, then the backend's own part.

        Must run after the last change of a per-step field and before the layers' forward.
        """
        self.prepared = False
        self._kernel_views: dict = {}
        self._prepare_common()
        self._prepare_backend()
        if self._seq_lens_pending:  # backends without an arena copy it on its own
            self._flush_seq_lens()
        self.prepared = True

    def kernel_view(self, pool: int = 0):
        """``paged_view(pool)`` (backends with a page table), built once per `prepare`: a
        step's layers share it. Also rebuilt when ``kv_lens_np`` is replaced after
        `prepare` (the decode graphs' captures set a tier's host bound that way)."""
        views = self.__dict__.setdefault("_kernel_views", {})
        key = (pool, id(getattr(self, "kv_lens_np", None)))
        view = views.get(key)
        if view is None:
            view = views[key] = self.paged_view(pool)
        return view

    def _flush_seq_lens(self) -> None:
        """Copy ``seq_lens`` to its device buffer now, from a private (pinned) snapshot."""
        arr = self._seq_lens_np
        snapshot = host_empty(arr.size, torch.int32, self.pinned)
        snapshot.numpy()[:] = arr
        copy_to(self._seq_lens_gpu[: arr.size], snapshot)
        self._seq_lens_pending = False

    def prepare_encoder_only(self) -> None:
        """Setup for a forward without a KV cache; defaults to the full ``prepare()``."""
        self.prepare()

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
        n, nc = self._num_seqs, self._num_contexts
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
        one_q = self.one_query_per_row = self._seq_lens_all_ones
        if one_q:  # one query token per row: cu_seqlens_q is an arange
            self.cu_seqlens_q_np = self._arange[: n + 1]
        else:
            self.cu_seqlens_q_np = exclusive_cumsum(
                self._seq_lens_np, self._num_tokens, dtype=np.int32
            )
        self._num_ctx_tokens = int(self.cu_seqlens_q_np[nc])
        if self._seq_lens_kv_np is None:
            self.one_kv_token_per_row = one_q
            self.cu_seqlens_kv_np = self.cu_seqlens_q_np
        else:
            self.one_kv_token_per_row = self._seq_lens_kv_all_ones
            self.cu_seqlens_kv_np = exclusive_cumsum(
                self._seq_lens_kv_np, self._num_kv_tokens, dtype=np.int32
            )
