"""Continuous batching: which requests run this step, with how many tokens each.

Every step (``schedule``) spends a token budget ``max_num_batched_tokens``:

1. running requests first, in arrival order: a prefilling request gets its next chunk, a
   decoding request gets 1 token (plus its n-gram drafts, if any fit). A decoding request
   grows its logical length by one token (``KVCacheManager.extend``) and reserves blocks for
   its drafts (``reserve``: reserved, not logical, until verification accepts them). When no
   block is left, the most recently admitted running request is *preempted by recompute*: its
   blocks are freed and it goes back to the front of the waiting queue, keeping its generated
   tokens, which the next admission prefills together with the prompt. No request is lost.
2. then waiting requests, first come first served, while budget and ``max_num_seqs`` allow:
   ``add_request`` allocates blocks for everything the request has and reports the prefix
   reused from the cache (those tokens are skipped); the rest is prefilled in chunks of at
   most the remaining budget (``enable_chunked_prefill``) or whole (sliding-window pools
   allocate per chunk: ``add_request(max_new_tokens=...)``, then ``prepare_chunk``; running
   out there preempts as for decode). Without chunked prefill,
   a preempted request whose prompt plus generated tokens exceed ``max_num_batched_tokens``
   could never be admitted whole: it is prefilled in chunks.
   Shared prefixes (``wait_for_shared_prefix``, with prefix caching): a waiting prompt whose
   next uncached blocks are ones an admitted request is computing right now (the same
   system prompt sent by several requests at once) waits until they are committed instead
   of computing them a second time (``add_request(wait_for_pending=True)`` answers
   ``"pending_prefix"``); later waiting requests may be admitted past it. With
   ``resume_block_size`` the owner's chunks also end where the shared run ends (or, with
   ``keep_state_in_chunk``, name it in ``keep_state_at``), so the family keeps its
   per-sequence state there and the waiting prompt resumes from it.

The batch is ordered for the attention metadata: context rows (prefill chunks, then
speculative-verification rows, which carry several query tokens) before plain decode rows.

Decode fast path: when a step scheduled every running request as a plain decode row (no
drafts), its rows are remembered as a `DecodeBatch`. The next step reuses them as long as the
running list is the same (same requests, same order: nothing was preempted or admitted; a
finished or aborted request leaves the batch), no waiting request could be admitted, and the
budget holds the batch: one ``KVCacheManager.extend_many`` grows every request, instead of one
``extend`` each. If that runs out of blocks, the requests it did extend are rewound (their new
blocks stay as reserved blocks, exactly where the per-request loop puts them) and the general
loop below decides who is preempted, so both paths schedule the same rows and allocate the
same blocks.

Async scheduling (`kvplan.engine.async_steps`) asks for the step after a launched decode step
before that step's tokens are processed: ``schedule_ahead`` gives the same rows again, or None
(changing nothing) when the answer could depend on what processing the step changes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvplan.engine.request import Request, RequestStatus
from kvplan.engine.step import DecodeBatch, ScheduledSeq, StepBatch


class Scheduler:
    """FCFS continuous-batching scheduler over a `KVCacheManager`.

    Args:
        manager: the block ledger (``kvplan.cache.KVCacheManager``).
        max_num_batched_tokens: token budget of one step.
        max_num_seqs: most requests in one step.
        enable_chunked_prefill: split prompts longer than the remaining budget.
        propose_drafts: ``f(request) -> list[int]`` draft tokens for a greedy decoding request
            (speculative decoding), or None.
        on_free: ``f(request_id)`` called after the manager freed a finished or preempted
            request's blocks (the attention families drop their per-request state), or None.
        num_draft_tokens: the most drafts ``propose_drafts`` returns (0 without it).
        resume_block_size: when > 0, a prompt's chunks end at its last multiple of this
            size below its length (``h = (len - 1) // size * size``) and at the end of the
            cached blocks its admission could not resume from (``num_shared_tokens`` of
            ``add_request``: a prefix shared with an earlier prompt) if a chunk would cross
            them: a family that keeps per-sequence state only at chunk ends that are block
            boundaries (`kvplan.backends.hybrid.snapshots`) can then resume there for a later
            request (the same prompt, or another one sharing that prefix). 0: no cut.
        keep_state_in_chunk: with ``resume_block_size``, chunks are not cut there: each
            prefill row names those points inside its chunk (``ScheduledSeq.keep_state_at``)
            and the family keeps the state at them within the step (a prompt runs in one
            step instead of two).
        wait_for_shared_prefix: a waiting prompt whose next blocks another request is
            computing waits for them (module docstring); needs a manager with prefix
            caching (otherwise nothing waits).
    """

    def __init__(
        self,
        manager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_chunked_prefill: bool = True,
        propose_drafts: Callable[[Request], list[int]] | None = None,
        on_free: Callable[[int], None] | None = None,
        num_draft_tokens: int = 0,
        resume_block_size: int = 0,
        wait_for_shared_prefix: bool = True,
        keep_state_in_chunk: bool = False,
    ) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.manager = manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.propose_drafts = propose_drafts
        self.num_draft_tokens = num_draft_tokens  # the most drafts propose_drafts returns
        self.on_free = on_free
        self.resume_block_size = resume_block_size
        self.wait_for_shared_prefix = wait_for_shared_prefix
        self.keep_state_in_chunk = keep_state_in_chunk and resume_block_size > 0
        self.num_prefix_waits = 0  # admissions put off (per step) for a prefix being computed
        self.num_waiting_for_prefix = 0  # requests the last step put off that way
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # the rows of the last all-decode step (its requests are the running list then)
        self._decode: DecodeBatch | None = None

    # ------------------------------------------------------------------ queue management
    def add(self, request: Request) -> None:
        if (
            not self.enable_chunked_prefill
            and len(request.prompt_token_ids) > self.max_num_batched_tokens
        ):
            raise ValueError(
                f"prompt of {len(request.prompt_token_ids)} tokens exceeds "
                f"max_num_batched_tokens={self.max_num_batched_tokens} and chunked prefill is off"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Mark ``request`` finished and release its blocks (also used for abort)."""
        if request.status is RequestStatus.RUNNING:
            self._free(request.request_id)
            self.running.remove(request)
            self._drop_from_decode_batch(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _drop_from_decode_batch(self, request: Request) -> None:
        """A finished request leaves the remembered decode batch: the others still decode,
        in the same order, so the next step can take the fast path (a new, smaller batch;
        the current step's batch object is not changed)."""
        batch = self._decode
        if batch is None or not any(r is request for r in batch.requests):
            return
        seqs = [s for s in batch.seqs if s.request is not request]
        self._decode = DecodeBatch.from_seqs(seqs) if seqs else None

    def _free(self, request_id: int) -> None:
        self.manager.free(request_id)
        if self.on_free is not None:
            self.on_free(request_id)

    def _preempt(self, request: Request) -> None:
        self._free(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.shared_ends.clear()
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> StepBatch:
        out = self._schedule_decode_batch()
        if out is not None:
            return out
        seqs, num_contexts, preempted = self._schedule_general()
        self._decode = None
        if (
            num_contexts == 0
            and seqs
            and len(seqs) == len(self.running)
            and self.propose_drafts is None
        ):
            # its decode rows are the running requests, in order
            self._decode = DecodeBatch.from_seqs(seqs)
            return StepBatch.decode(self._decode, preempted=preempted)
        return StepBatch.general(seqs, num_contexts, preempted)

    def _remembered_batch(self) -> DecodeBatch | None:
        """The remembered decode batch when the next step may repeat it: the running list is
        still its requests (same order), no drafts, and the budget holds one token a row."""
        batch = self._decode
        if (
            batch is None
            or self.propose_drafts is not None
            or len(batch.requests) > self.max_num_batched_tokens
            or batch.requests != self.running
        ):
            return None
        return batch

    def _schedule_decode_batch(self) -> StepBatch | None:
        """The last step's decode rows again, if nothing changed (module docstring)."""
        batch = self._remembered_batch()
        if batch is None or (self.waiting and len(self.running) < self.max_num_seqs):
            return None
        result = self.manager.extend_many(batch.request_ids, 1)
        if not result.ok:  # out of blocks: undo, let the general loop pick the victims
            for rid in batch.request_ids[: result.num_extended]:
                self.manager.rewind(rid, 1)
            return None
        return StepBatch.decode(batch)

    def schedule_ahead(self, batch: DecodeBatch) -> StepBatch | None:
        """The next decode step of ``batch`` scheduled before the current step's tokens are
        processed (async scheduling), or None (changing nothing) when that step might differ
        from what `schedule` gives once they are: ``batch`` is no longer the remembered one
        (a finish, abort or preemption happened), a request waits (a finish in the pending
        step could let it in), drafts are on, the budget is too small, or some pool could
        have to evict a cached block or run out.

        Block check: each row needs at most one new block per pool, so with
        ``rows`` free blocks in every pool ``extend_many`` succeeds. The allocation comes
        before the pending step's finishes free their blocks, so it may take (evict) a cached
        free block that the synchronous order would have left for a later prefix hit, and
        block ids may differ; tokens, finish reasons and leaks are tested equal.
        """
        if self.waiting or self._remembered_batch() is not batch:
            return None
        n = len(batch.request_ids)
        if any(pool.num_free_blocks < n for pool in self.manager.pools):
            return None
        result = self.manager.extend_many(batch.request_ids, 1)
        assert result.ok, "extend_many failed with a free block per row and pool"
        return StepBatch.decode(batch, ahead=True)

    def _schedule_general(self) -> tuple[list[ScheduledSeq], int, list[Request]]:
        """The rows of a step by the per-request loop: (rows, number of context rows,
        requests preempted on the way)."""
        budget = self.max_num_batched_tokens
        prefill: list[ScheduledSeq] = []
        verify: list[ScheduledSeq] = []
        decode: list[ScheduledSeq] = []
        preempted: list[Request] = []
        scheduled: set[int] = set()

        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if req.is_prefilling:
                n = self._chunk(req, budget)
                if not self._prepare_chunk(req, req.num_computed_tokens + n, scheduled, preempted):
                    continue
                prefill.append(self._prefill_row(req, n))
                budget -= n
                scheduled.add(req.request_id)
                continue
            # decoding: one new logical token, drafts only into reserved blocks
            while not self.manager.extend(req.request_id, 1).ok:
                victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            scheduled.add(req.request_id)
            if self.propose_drafts is None:  # no speculation: one query token, no draft call
                decode.append(ScheduledSeq(req, 1, False))
                budget -= 1
                continue
            drafts = self._drafts(req, budget - 1)
            seq = ScheduledSeq(req, 1 + len(drafts), False, tuple(drafts))
            (verify if drafts else decode).append(seq)
            budget -= seq.num_query_tokens

        waits = 0  # waiting requests passed over: they wait for a shared prefix
        while len(self.waiting) > waits and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            req = self.waiting[waits]
            tokens = req.all_token_ids
            if (
                not self.enable_chunked_prefill
                and len(tokens) > budget
                and len(tokens) <= self.max_num_batched_tokens
            ):
                break  # fits a later step whole; one that never can is chunked below
            result = self.manager.add_request(
                req.request_id,
                tokens,
                reuse_prefix=not req.needs_prompt_logprobs,
                max_new_tokens=budget,
                wait_for_pending=self.wait_for_shared_prefix,
            )
            if result.reason == "pending_prefix":
                budget += self._end_owner_chunk(result, prefill)
                self.num_prefix_waits += 1
                waits += 1
                continue
            if not result.ok:
                break
            del self.waiting[waits]
            req.status = RequestStatus.RUNNING
            req.num_prefill_tokens = len(tokens)
            req.num_computed_tokens = result.num_cached_tokens
            req.num_cached_prefix_tokens = result.num_cached_tokens
            req.resume_at = result.num_shared_tokens if self.resume_block_size else 0
            self.running.append(req)
            n = self._chunk(req, budget)
            prefill.append(self._prefill_row(req, n))
            budget -= n

        self.num_waiting_for_prefix = waits
        if (
            self.resume_block_size
            and self.wait_for_shared_prefix
            and prefill
            and len(self.waiting) > waits
            and not preempted
        ):
            self._mark_shared_end(self.waiting[waits], prefill)
        return prefill + verify + decode, len(prefill) + len(verify), preempted

    def _mark_shared_end(self, req: Request, prefill: list[ScheduledSeq]) -> None:
        """The next waiting request, which this step did not reach (the budget or
        ``max_num_seqs`` ran out), may share a prefix that a prompt of this step is
        computing: end that owner's chunks where the shared run ends, so the state the
        request will resume from is kept there (`_end_owner_chunk`). At most one lookup a
        prefill step (none while nothing is pending: `KVCacheManager.pending_prefix`)."""
        if req.needs_prompt_logprobs:
            return
        result = self.manager.pending_prefix(req.all_token_ids)
        if result.reason == "pending_prefix":
            self._end_owner_chunk(result, prefill)

    def _keep_points(self, req: Request) -> tuple[int, ...]:
        """Where ``req``'s prompt state is kept (``resume_block_size``): its resume boundary,
        its last block boundary below its length, and the ends of prefixes that waiting
        prompts share."""
        size = self.resume_block_size
        if not size:
            return ()
        return (req.resume_at, (req.num_prefill_tokens - 1) // size * size, *req.shared_ends)

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens of ``req``'s next prefill chunk: the rest of its prompt within ``budget``;
        without ``keep_state_in_chunk``, ended at the first of `_keep_points` it would
        cross."""
        start = req.num_computed_tokens
        n = min(req.num_prefill_tokens - start, budget)
        if not self.keep_state_in_chunk:
            for h in self._keep_points(req):
                if start < h < start + n:
                    n = h - start
        return n

    def _prefill_row(self, req: Request, n: int) -> ScheduledSeq:
        """The prefill row of ``req``'s next ``n`` tokens; with ``keep_state_in_chunk`` it
        names the points of `_keep_points` strictly inside the chunk (``keep_state_at``)."""
        if not self.keep_state_in_chunk:
            return ScheduledSeq(req, n, True)
        start = req.num_computed_tokens
        inside = {h for h in self._keep_points(req) if start < h < start + n}
        return ScheduledSeq(req, n, True, keep_state_at=tuple(sorted(inside)))

    def _end_owner_chunk(self, result, prefill: list[ScheduledSeq]) -> int:
        """A waiting prompt waits for the shared run ``[0, result.num_shared_tokens)`` that
        ``result.pending_owner`` computes: with ``resume_block_size``, make the owner's
        chunks end there (this step's chunk too, if scheduled and crossing it; with
        ``keep_state_in_chunk`` the chunk keeps its length and names the end in
        ``keep_state_at``). Returns the budget tokens that freed."""
        end = result.num_shared_tokens
        if not self.resume_block_size:
            return 0
        owner = next((r for r in self.running if r.request_id == result.pending_owner), None)
        if owner is None or end <= owner.num_computed_tokens:
            return 0
        if end not in owner.shared_ends:
            owner.shared_ends.append(end)
        for i, seq in enumerate(prefill):
            if seq.request is owner:
                start = owner.num_computed_tokens
                if start + seq.num_query_tokens > end:
                    if self.keep_state_in_chunk:  # the state is kept inside the chunk
                        prefill[i] = self._prefill_row(owner, seq.num_query_tokens)
                        return 0
                    prefill[i] = ScheduledSeq(owner, end - start, True)
                    return start + seq.num_query_tokens - end
                break
        return 0

    def _prepare_chunk(
        self, req: Request, end: int, scheduled: set[int], preempted: list[Request]
    ) -> bool:
        """Window-pool blocks for a prefill chunk ending at ``end`` (the manager allocates
        them chunk by chunk), preempting like a decoding request when none is left; False
        when ``req`` itself was preempted."""
        while not self.manager.prepare_chunk(req.request_id, end).ok:
            victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _drafts(self, req: Request, room: int) -> list[int]:
        if room <= 0 or not req.params.greedy:  # (called only when propose_drafts is set)
            return []
        left = req.params.max_tokens - len(req.output_token_ids)
        drafts = list(self.propose_drafts(req))[: min(room, max(0, left - 1))]
        if drafts and not self.manager.reserve(req.request_id, len(drafts)).ok:
            return []
        return drafts
