"""The scheduler's description of one step: `StepBatch`, made of `ScheduledSeq` rows.

A `StepBatch` is what every consumer of a step reads: the runner (token ids, positions,
logits rows), each attention family's planner (lengths, request ids as the keys of the
cache manager's block tables), and the engine core (what to commit and sample). It is
frozen: the facts are taken when the scheduler decides the step and nothing rewrites them.

Row order: context rows first (prefill chunks, then speculative-verification rows, which
carry several query tokens), then plain decode rows (one query token each)::

    seqs              = [ prefill r3 (5 tok) | verify r1 (1 + 2 drafts) | decode r0 | decode r2 ]
    num_contexts      = 2
    num_query_tokens  = [5, 3, 1, 1]                                       int32 [num_seqs]
    num_cached_tokens = [0, 17, 9, 30]   K/V already in the cache          int32 [num_seqs]
    positions         = [0..4, 17..19, 9, 30]                              int64 [num_tokens]

Decode-only steps of an unchanged running list (`DecodeBatch`) share their request-id and
prompt-length lists across steps (read them, never mutate them), so such a step costs one
pass over its requests (`StepBatch.decode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvplan._math import exclusive_cumsum
from kvplan.engine.request import Request


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One row of a step: ``num_query_tokens`` tokens of ``request`` starting at
    ``request.num_computed_tokens`` (for a decode row: its newest token, then ``drafts``).
    ``keep_state_at``: token counts strictly inside a prefill chunk (block boundaries) at
    which the attention family keeps the sequence's state as if a chunk ended there
    (`kvplan.engine.scheduler.Scheduler`'s ``resume_block_size``)."""

    request: Request
    num_query_tokens: int
    is_prefill: bool
    drafts: tuple[int, ...] = ()
    keep_state_at: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """Whether this row produces a token (a prefill row only on its last chunk)."""
        r = self.request
        return not self.is_prefill or (
            r.num_computed_tokens + self.num_query_tokens >= r.num_prefill_tokens
        )


@dataclass(frozen=True)
class DecodeBatch:
    """Rows of a step in which every running request decodes one token (no drafts).

    Valid, unchanged, for every following step with the same running list; the lists are
    shared by those steps (read them, never mutate them).
    """

    seqs: list[ScheduledSeq]
    requests: list[Request]  # requests[i] is seqs[i].request
    request_ids: list[int]
    prompt_lens: list[int]  # num_prefill_tokens (fixed while decoding)
    all_greedy: bool  # every request samples greedily
    any_logprobs: bool = False  # some request asks for logprobs

    @classmethod
    def from_seqs(cls, seqs: list[ScheduledSeq]) -> DecodeBatch:
        reqs = [s.request for s in seqs]
        return cls(
            seqs,
            reqs,
            [r.request_id for r in reqs],
            [r.num_prefill_tokens for r in reqs],
            all(r.params.greedy for r in reqs),
            any(r.params.logprobs is not None for r in reqs),
        )


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One scheduled step (module docstring); build it with `general` or `decode`.

    Attributes:
        seqs: the rows, context rows first.
        num_contexts: rows that are prefill chunks or verification rows (the first ones).
        request_ids: ``[num_seqs]`` request ids (the cache manager's keys).
        prompt_lens: ``[num_seqs]`` tokens each request prefills since its admission.
        num_cached_tokens: int32 ``[num_seqs]``, tokens with K/V in the cache before the step.
        num_query_tokens: int32 ``[num_seqs]``, tokens each row computes this step.
        positions: int64 ``[num_tokens]``, the absolute position of every query token, rows
            back to back (row i: ``num_cached_tokens[i] .. + num_query_tokens[i] - 1``).
        preempted: requests preempted (by recompute) while scheduling this step.
        decode_batch: set when every row is a plain decode row of the running list
            (``seqs is decode_batch.seqs``).
        ahead: a decode step scheduled before the previous step's tokens are processed
            (async scheduling): each row is one position past ``num_computed_tokens``.
    """

    seqs: Sequence[ScheduledSeq]
    num_contexts: int
    request_ids: list[int]
    prompt_lens: list[int]
    num_cached_tokens: np.ndarray
    num_query_tokens: np.ndarray
    positions: np.ndarray
    preempted: list[Request] = field(default_factory=list)
    decode_batch: DecodeBatch | None = None
    ahead: bool = False

    @classmethod
    def general(
        cls, seqs: list[ScheduledSeq], num_contexts: int, preempted: list[Request] | None = None
    ) -> StepBatch:
        """Any step: the facts of each row, read off its request."""
        reqs = [s.request for s in seqs]
        cached = np.array([r.num_computed_tokens for r in reqs], dtype=np.int32)
        query = np.array([s.num_query_tokens for s in seqs], dtype=np.int32)
        return cls(
            seqs,
            num_contexts,
            [r.request_id for r in reqs],
            [r.num_prefill_tokens for r in reqs],
            cached,
            query,
            token_positions(cached, query),
            preempted or [],
        )

    @classmethod
    def decode(
        cls, batch: DecodeBatch, *, ahead: bool = False, preempted: list[Request] | None = None
    ) -> StepBatch:
        """A decode-only step of ``batch`` (``ahead``: see the class docstring)."""
        n = len(batch.requests)
        cached = np.array([r.num_computed_tokens + ahead for r in batch.requests], np.int32)
        return cls(
            batch.seqs,
            0,
            batch.request_ids,
            batch.prompt_lens,
            cached,
            np.ones(n, dtype=np.int32),
            cached.astype(np.int64),  # one query token per row, at its cached length
            preempted or [],
            decode_batch=batch,
            ahead=ahead,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        """Query tokens of the step (rows of the model's flat batch)."""
        return int(self.num_query_tokens.sum())

    @property
    def requests(self) -> list[Request]:
        batch = self.decode_batch
        return batch.requests if batch is not None else [s.request for s in self.seqs]


def token_positions(num_cached_tokens: np.ndarray, num_query_tokens: np.ndarray) -> np.ndarray:
    """Positions of a step's query tokens, rows back to back: int64 ``[sum(num_query_tokens)]``.

    >>> token_positions(np.array([0, 17, 9]), np.array([2, 3, 1])).tolist()
    [0, 1, 17, 18, 19, 9]
    """
    q = num_query_tokens.astype(np.int64)
    starts = exclusive_cumsum(q)[:-1]  # flat index of each row's first token
    offsets = num_cached_tokens.astype(np.int64) - starts
    return np.repeat(offsets, q) + np.arange(int(q.sum()), dtype=np.int64)
