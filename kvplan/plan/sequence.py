"""``SequenceMetadata``: the scheduler's per-sequence state for one step (the raw material).

Four kinds of facts: lengths (``seqlen_q``, ``seqlen_k``), a block table, a state slot, and
flags. Every tensor of :class:`kvplan.plan.InputMetadata` is derived from these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class SequenceMetadata:
    """One sequence of a step, as the scheduler hands it to the planning layer.

    Attributes:
        seqlen_q: query rows this step (prompt: the chunk length; decode: ``1 + len(draft)``).
        seqlen_k: keys after this step, including its queries. The query rows sit at absolute
            positions ``seqlen_k - seqlen_q .. seqlen_k - 1`` (``q_start = seqlen_k - seqlen_q``).
        block_table: logical -> physical KV block ids, counted at the smallest compression
            ratio (``MetadataConfig.num_blocks_for(seqlen_k)`` entries are read; extra entries
            are ignored). Block 0 is the reserved padding block.
        state_id: this sequence's slot in the state cache (SWA ring of ``swa_block_size`` slots
            and compression state).
        token_ids: the confirmed token ids, position ``i`` at index ``i``.
            Prompt: at least ``seqlen_k`` entries (the chunk is ``token_ids[q_start:seqlen_k]``).
            Decode: exactly ``seqlen_k - seqlen_q + 1`` entries; the last one is the input of
            the first query row, the draft tokens are not in ``token_ids`` yet.
        is_placeholder: a filler sequence of an idle data-parallel rank: its rows get
            ``valid_token_mask = False`` and ``query_indices = 998244353`` and write no KV.
        swa_valid_start: SWA keys below this absolute position are invalid (zero-state replay):
            they are zero-filled in the load plan and never visible (``0 <= swa_valid_start <=
            q_start``: a replayed chunk starts at or after it).
        draft_tokens: speculative draft tokens (decode only): query rows ``1 ..`` of the step.
        compressed_token_ids: Engram compressed history; entry ``s`` is the compressed id of
            raw position ``s`` (``L = len(compressed_token_ids)`` positions are known).
        lookup_table: raw token id -> compressed id (int array), used for positions ``>= L``.
        image_positions: absolute positions holding image tokens (n-gram windows stop there).
    """

    seqlen_q: int
    seqlen_k: int
    block_table: Sequence[int] | np.ndarray
    state_id: int
    token_ids: Sequence[int] | np.ndarray
    is_placeholder: bool = False
    swa_valid_start: int = 0
    draft_tokens: Sequence[int] = ()
    compressed_token_ids: Sequence[int] | np.ndarray = ()
    lookup_table: Sequence[int] | np.ndarray | None = None
    image_positions: Sequence[int] = ()

    @property
    def q_start(self) -> int:
        """Absolute position of the first query row (``seqlen_k - seqlen_q``)."""
        return self.seqlen_k - self.seqlen_q

    def token_at(self, pos: int) -> int:
        """Raw token at absolute position ``pos``: confirmed tokens first, then drafts."""
        n = len(self.token_ids)
        if pos < n:
            return int(self.token_ids[pos])
        return int(self.draft_tokens[pos - n])
