"""Rolling back the per-sequence state that rejected speculative drafts wrote.

A verification row of a step feeds a request's newest token and ``k`` draft tokens (positions
``L .. L + k``); after the step the engine accepts the first ``a`` drafts, so the request
holds ``N = L + a + 1`` tokens and the rows of positions ``N .. L + k`` must leave no trace.
Of what a hybrid layer writes (kvplan.backends.hybrid.planned):

* compressed entries and indexer keys (paged pools): an entry the rejected rows closed lies
  past ``N``; no query reads it before the real token at its position closes it again and
  rewrites it;
* the sliding-window ring: the engine gives it ``W + k`` slots (``ring_size``), so the rows
  a step writes at ``L + 1 .. L + k`` replace only positions ``<= L - W``, which no later query
  sees (a query at ``q >= N`` reads ``q - W + 1 .. q``);
* the compressor-state rings (``R = r`` rows per slot, ``2r`` for overlapping series): a row
  written at ``p`` replaces position ``p - R``, which the windows still to close may read.
  :class:`DraftRollback` copies those rows before the step and puts back the rows of the
  rejected positions after it.

The state ring of a series must hold a verification row's ``k + 1`` positions at once
(``k + 1 <= R``): with more, the step would keep only its last ``R`` rows, losing accepted
ones. `max_drafts` gives the bound for a family's layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvplan._math import exclusive_cumsum
from kvplan.backends.hybrid.api import HybridLayerSpec
from kvplan.plan.compressor_state import state_rows

if TYPE_CHECKING:
    from kvplan.backends.hybrid.planned import PlannedHybridFamily


def max_drafts(layers: Sequence[HybridLayerSpec]) -> int | None:
    """The most drafts a verification row may carry: one less than the smallest compressor
    state ring (``R``) of ``layers``; None when no layer compresses."""
    rows = [state_rows(sp.ratio, sp.overlap) for sp in layers if sp.kind != "sliding_attention"]
    return min(rows) - 1 if rows else None


class DraftRollback:
    """Copies of the compressor-state rows that a step's verification rows will overwrite,
    taken before the step (stream-ordered device copies), and their restoration once the
    engine knows how many drafts each row accepted (module docstring).

    Args:
        family: the family whose state rings the step writes.
        rows: ``(state_id, q_start, num_drafts)`` of each verification row, ``q_start`` the
            position of its newest token (``L``): the drafts sit at ``L + 1 .. L + k``.
    """

    def __init__(self, family: PlannedHybridFamily, rows: Sequence[tuple[int, int, int]]) -> None:
        cap = max_drafts(family.layers)
        for i, (_, _, k) in enumerate(rows):
            if k < 1 or (cap is not None and k > cap):
                raise ValueError(
                    f"rows[{i}]: num_drafts = {k}, need 1 <= num_drafts <= {cap} (the smallest "
                    f"compressor-state ring holds {None if cap is None else cap + 1} rows)"
                )
        self.num_rows = len(rows)
        counts = np.array([k for _, _, k in rows], dtype=np.int64)
        self._offsets = exclusive_cumsum(counts)  # [rows + 1]
        state = np.repeat(np.array([s for s, _, _ in rows], dtype=np.int64), counts)
        first = np.repeat(np.array([q + 1 for _, q, _ in rows], dtype=np.int64), counts)
        pos = first + np.arange(counts.sum()) - np.repeat(self._offsets[:-1], counts)
        dev = self._device = family.device
        self._index: dict[int, torch.Tensor] = {}  # R -> ring rows of every draft position
        self._saved: list[tuple[torch.Tensor, int, torch.Tensor]] = []  # (live, R, copy)
        for layer in family.caches:
            big_r = state_rows(layer.spec.ratio, layer.spec.overlap)
            for pair in layer.state.values():
                for live in pair:  # [slots * R + 1 trash row, width]
                    if big_r not in self._index:
                        rows_r = torch.from_numpy(state * big_r + pos % big_r)
                        self._index[big_r] = rows_r.to(dev)
                    self._saved.append((live, big_r, live.index_select(0, self._index[big_r])))
        self.num_restored = 0  # draft positions put back by `restore`

    def restore(self, accepted: Sequence[int]) -> None:
        """Put back the state rows of every rejected draft: ``accepted[i]`` (``0 ..
        num_drafts``) drafts of row ``i`` were accepted."""
        if len(accepted) != self.num_rows:
            raise ValueError(f"accepted has {len(accepted)} entries, need {self.num_rows}")
        lo, hi = self._offsets[:-1], self._offsets[1:]
        a = np.asarray(accepted, dtype=np.int64)
        if ((a < 0) | (a > hi - lo)).any():
            raise ValueError(f"accepted = {list(accepted)}: each must lie in 0 .. num_drafts")
        keep = lo + a  # the first rejected entry of each row
        sel = np.concatenate([np.arange(s, e) for s, e in zip(keep, hi)] or [np.zeros(0, int)])
        if not sel.size or not self._saved:
            return
        sel_t = torch.from_numpy(sel.astype(np.int64)).to(self._device)
        rows = {r: idx.index_select(0, sel_t) for r, idx in self._index.items()}
        for live, big_r, saved in self._saved:
            live.index_copy_(0, rows[big_r], saved.index_select(0, sel_t))
        self.num_restored += int(sel.size)
