"""The per-step shape of ``AttentionMetadata``: its setters and the counts derived from them.

``seq_lens`` (query tokens per sequence), ``seq_lens_kv`` (new K/V tokens per sequence, the
``seq_lens`` object itself unless assigned) and ``num_contexts`` are validated once, in their
setters, into fresh int32 host arrays; every setter refreshes the derived host counts
(``num_seqs``, ``num_generations``, ``num_ctx_tokens``, ``num_tokens``, ``num_kv_tokens``), so
nothing in a forward pass has to sync or compute a data-dependent shape. See
``kvplan.backends.metadata`` for the whole contract.
"""

from __future__ import annotations

import numpy as np
import torch

from kvplan.backends.host_arrays import SUM, IntArrayLike, as_lengths
from kvplan.backends.staging import copy_to, host_empty


class StepShape:
    """Mixin of ``AttentionMetadata`` (which sets ``max_num_sequences``, ``pinned`` and the
    capacity-sized device buffer ``_seq_lens_gpu``)."""

    def _init_step_shape(self) -> None:
        self._seq_lens: torch.Tensor | None = None  # made from _seq_lens_np on first read
        self._seq_lens_set = False
        self._seq_lens_np = np.zeros(0, np.int32)
        self._seq_lens_all_ones = False
        self._seq_lens_pending = False  # the device copy is behind the host value
        self._seq_lens_kv: torch.Tensor | None = None
        self._seq_lens_kv_np: np.ndarray | None = None
        self._seq_lens_kv_total, self._seq_lens_kv_all_ones = 0, False
        self._num_contexts = 0
        self._num_seqs = 0
        self._num_generations = 0
        self._num_ctx_tokens: int | None = 0
        self._num_tokens = 0
        self._num_kv_tokens = 0

    # ---------------------------------------------------------------- per-step shape
    @property
    def seq_lens(self) -> torch.Tensor | None:
        """Query tokens of each sequence this step: int32 CPU tensor ``[num_seqs]``."""
        if self._seq_lens is None and self._seq_lens_set:
            # arr is a fresh array (as_int32_array copies), so this tensor is never rewritten;
            # made on first read only (prepare() works on the numpy array)
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
    def seq_lens_gpu(self) -> torch.Tensor:
        """Device copy of ``seq_lens``: int32 ``[num_seqs]`` view of a capacity buffer."""
        if self._seq_lens_pending:
            self._flush_seq_lens()
        return self._seq_lens_gpu[: self._num_seqs]

    def _flush_seq_lens(self) -> None:
        """Copy ``seq_lens`` to its device buffer now, from a private (pinned) snapshot."""
        arr = self._seq_lens_np
        snapshot = host_empty(arr.size, torch.int32, self.pinned)
        snapshot.numpy()[:] = arr
        copy_to(self._seq_lens_gpu[: arr.size], snapshot)
        self._seq_lens_pending = False

    def _stage_seq_lens(self, values: dict) -> None:
        """For backends whose ``_seq_lens_gpu`` is the ``"seq_lens"`` field of their
        ``DeviceArena``: add ``seq_lens`` to this step's staged ``values``. Always, not only
        when it changed: the step's copy covers the arena prefix from offset 0, so a field
        left out of the fresh snapshot would overwrite the device copy with whatever the
        snapshot memory held (a second ``prepare()`` of the same step, or ``seq_lens_gpu``
        read before ``prepare()``)."""
        values["seq_lens"] = self._seq_lens_np
        self._seq_lens_pending = False

    def _put_seq_lens(self, host: np.ndarray, at: int) -> None:
        """``_stage_seq_lens`` for a staging in progress: write ``seq_lens`` at offset ``at``
        (the field's) of this step's snapshot ``host``."""
        host[at : at + self._num_seqs] = self._seq_lens_np
        self._seq_lens_pending = False

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
        return self._seq_lens_np if self._seq_lens_kv_np is None else self._seq_lens_kv_np

    @property
    def is_cross(self) -> bool:
        """Cross attention iff ``seq_lens_kv`` is a different object from ``seq_lens``.

        (The ``seq_lens_kv`` setter always stores a fresh tensor, so that is exactly "one was
        assigned"; tested without the two property calls, as prepare() asks often.)"""
        return self._seq_lens_kv is not None

    @property
    def num_contexts(self) -> int:
        return self._num_contexts

    @num_contexts.setter
    def num_contexts(self, value: int) -> None:
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"num_contexts must be an int >= 0, got {value!r}")
        self._num_contexts = int(value)
        self.on_update()

    def on_update(self) -> None:
        """Recompute the derived counts from host values (called by every shape setter)."""
        self.prepared = False
        lens = self._seq_lens_np
        nc = self._num_contexts
        self._num_seqs = n = lens.size
        # (num_contexts may exceed the row count between two setter calls; prepare() checks)
        self._num_ctx_tokens = None if nc else 0  # sum(seq_lens[:nc]), taken when first read
        self._num_generations = max(0, n - nc)
        # _num_tokens = sum(seq_lens) is kept by the seq_lens setter (and sum(seq_lens_kv) by
        # the seq_lens_kv setter)
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
