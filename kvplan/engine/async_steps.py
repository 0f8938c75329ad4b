"""Async scheduling for `EngineCore`: launch the next greedy decode step before reading this one.

With ``async_scheduling`` on, a decode-only step k on a remembered `DecodeBatch`
whose rows are all greedy is left *launched* when ``step()`` returns. The next ``step()``
launches k + 1 for the same rows before it waits for k's tokens: row i's input token is k's
device-side argmax of row i (copied on the stream; ``StepBatch.ahead``), and positions,
``extend_many`` and ``prepare()`` do not depend on token values. Then it processes k (commit,
append, stop rules) while the GPU runs k + 1. Results thus arrive one ``step()`` later.

* Finish detection lags one step: a request that finishes at step k (EOS, stop id, stop
  string) was launched in k + 1 already. Its k + 1 token is discarded, never committed, and
  its blocks are freed when k is processed. Safe: any later owner of those blocks writes
  them with work queued after k + 1 on the same stream. The zombie row writes only its next
  position, which lies in a block that is partial (committed up to the position before) or
  new: never a full, hashed block that a prefix hit could hand out.
* A request that surely hits max_tokens at step k is not launched again: the step drains.
* k's tokens may live in the decode graph's static buffer (its captured argmax,
  `kvplan.engine.cuda_graphs.DecodeGraphs.greedy_tokens` and the hybrid one's), which
  k + 1's replay rewrites. Both of their reads are queued on the stream before that replay:
  the host copy right after k (`EngineCore._sample`), and the copy into k + 1's input ids
  inside ``run`` ahead of ``graph.replay()`` (an eager k + 1 reads them and writes no
  buffer of the graphs).
* Sliding-window pools (``release_out_of_window``): processing k commits k's input tokens
  (committed count ``c``) and frees the blocks that left the window, those whose positions
  are all ``< c - W + 1``. The launched step k + 1 queries position ``c``, which sees keys
  ``>= c - W + 1``: it reads none of them (its block table may still list them; the kernels
  mask them out). A freed block is handed out again only by a later schedule, whose step is
  queued after k + 1 on the same stream. A row holds at most one block more than
  synchronously (the bound of `kvplan.cache.pool_sizing` counts two tokens ahead).
* Any other change drains too (wait for the launched step, process it, then the normal
  path): prefill, a waiting request, drafts, sampled rows, a pool without a free block per
  row (`Scheduler.schedule_ahead`), a finished row (the batch changed).
  ``abort`` first processes the launched step, so every request's
  tokens, finish reasons and stop cuts equal those of synchronous steps; block ids may
  differ, and k + 1's allocation may evict a cached free block that the synchronous order
  would have kept (blocks freed by step k's finishes are listed after it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvplan.engine.host_tokens import Pending
from kvplan.engine.request import Request
from kvplan.engine.runner import StepInputs
from kvplan.engine.step import StepBatch


@dataclass
class LaunchedStep:
    """A decode-only step launched and not yet processed."""

    step: StepBatch  # its decode_batch is set
    inputs: StepInputs  # input_ids hold real tokens once the step before was processed
    tokens: torch.Tensor  # [num_seqs] int64 argmax on the device (maybe a graph's buffer)
    pending: Pending  # their copy to the host
    zombies: bool = False  # some rows finished before it was processed


def unique_requests(reqs: list[Request]) -> list[Request]:
    """``reqs`` without repeats (first occurrence kept)."""
    return list({id(r): r for r in reqs}.values())


class AsyncSteps:
    """`EngineCore`'s lookahead steps (a mixin over its scheduler, runner, ``_copies``,
    ``_sample``, ``_update_decode_rows``, ``_launched`` and ``_drained``)."""

    def drain(self) -> None:
        """Wait for and process the launched step, if any (async scheduling); the next
        ``step()`` returns the requests it touched."""
        launched, self._launched = self._launched, None
        if launched is not None:
            self._drained += self._finish(launched, None)

    def _launch_ahead(self, launched: LaunchedStep) -> LaunchedStep | None:
        """Launch the step after ``launched`` for the same rows, fed by its device tokens, or
        return None (nothing launched, nothing changed) when that step could differ from the
        one scheduled after processing ``launched`` (module docstring)."""
        batch = launched.step.decode_batch
        if launched.zombies:
            return None
        for r in batch.requests:  # surely finished by max_tokens: the batch changes
            if len(r.output_token_ids) + 1 >= r.params.max_tokens:
                return None
        step = self.scheduler.schedule_ahead(batch)
        if step is None:
            return None
        logits, inputs = self.runner.execute(step, launched.tokens)
        tokens, pending = self._sample(step, inputs, logits)
        self.num_steps += 1
        self.num_steps_ahead += 1
        return LaunchedStep(step, inputs, tokens, pending)

    def _finish(self, launched: LaunchedStep, ahead: LaunchedStep | None) -> list[Request]:
        """Process a launched decode step: commit its input tokens, wait for its sampled
        tokens, update its live rows (rows finished since its launch are skipped); give
        ``ahead`` (launched after it, same rows) those tokens as its host input ids."""
        manager = self.scheduler.manager
        batch = launched.step.decode_batch
        reqs = batch.requests
        input_ids = launched.inputs.input_ids
        if launched.zombies:
            live = [i for i, r in enumerate(reqs) if not r.finished]
            ids = [batch.request_ids[i] for i in live]
            dead = manager.commit_tokens_many(ids, input_ids[live], release=False)
            tokens = self._copies.wait(launched.pending)
            self.num_discarded_rows += len(reqs) - len(live)
            reqs, new = [reqs[i] for i in live], [tokens[i] for i in live]
        else:
            dead = manager.commit_tokens_many(batch.request_ids, input_ids, release=False)
            tokens = new = self._copies.wait(launched.pending)
        num_running = len(self.scheduler.running)
        touched = self._update_decode_rows(reqs, new, dead)
        if ahead is not None:
            ahead.inputs.input_ids[:] = tokens
            ahead.zombies = len(self.scheduler.running) != num_running
        return touched
