"""Model runner: one scheduled batch -> input tensors + attention metadata -> model -> logits.

Host work per step is O(tokens) numpy: token ids, positions, the rows whose logits are needed;
the attention metadata gets the scheduler's raw facts (request ids, query lengths, cached
lengths, number of context rows) and its ``prepare()`` derives the backend's kernel format.
Everything goes to the device in one copy per tensor.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from kvplan.engine.scheduler import SchedulerOutput


def set_step_fields(
    md: Any,
    request_ids: list[Any],
    prompt_lens: list[int],
    num_cached: np.ndarray,
    seq_lens: np.ndarray,
    num_contexts: int,
) -> None:
    """Write one step's raw facts into the backend metadata ``md`` and ``prepare()`` it."""
    md.request_ids = request_ids
    md.prompt_lens = prompt_lens
    md.num_cached_tokens_per_seq = num_cached
    md.num_contexts = 0  # keep the setters' invariant while seq_lens changes size
    md.seq_lens = seq_lens
    md.num_contexts = num_contexts
    md.prepare()


class StepInputs:
    """Host arrays of one step, in batch row order.

    ``input_ids``/``positions``: int64 ``[T]``; ``logits_rows``: int64 ``[N]`` rows of T whose
    logits are needed (the last query token of every sampling row; every query token of a
    speculative-verification row); ``row_slices[i]``: the slice of ``logits_rows`` owned by
    scheduled row i (empty for a prefill chunk that is not the last one; a list, or a shared
    tuple on the decode-only path). ``request_ids`` and ``prompt_lens`` (Python int lists
    ``[num_seqs]``, shared across steps by a `DecodeBatch`: never mutate them) feed the
    attention metadata.
    """

    def __init__(self, sched: SchedulerOutput, ahead: bool = False) -> None:
        if sched.num_contexts == 0:
            self._init_decode_only(sched, ahead)
            return
        if ahead:
            raise ValueError("ahead=True needs a decode-only step (num_contexts == 0)")
        ids: list[int] = []
        pos: list[int] = []
        rows: list[int] = []
        self.row_slices: list[slice] = []
        for s in sched.seqs:
            r = s.request
            start = r.num_computed_tokens
            n = s.num_query_tokens
            offset = len(ids)
            if s.is_prefill:
                ids.extend(r.all_token_ids[start : start + n])
            else:
                ids.append(r.last_token_id)
                ids.extend(s.drafts)
            pos.extend(range(start, start + n))
            first = len(rows)
            if s.drafts:
                rows.extend(range(offset, offset + n))
            elif s.samples:
                rows.append(offset + n - 1)
            self.row_slices.append(slice(first, len(rows)))
        self.input_ids = np.array(ids, dtype=np.int64)
        self.positions = np.array(pos, dtype=np.int64)
        self.logits_rows = np.array(rows, dtype=np.int64)
        self.seq_lens = np.array([s.num_query_tokens for s in sched.seqs], dtype=np.int32)
        self.num_cached = np.array(
            [s.request.num_computed_tokens for s in sched.seqs], dtype=np.int32
        )
        self.request_ids = [s.request.request_id for s in sched.seqs]
        self.prompt_lens = [s.request.num_prefill_tokens for s in sched.seqs]

    def _init_decode_only(self, sched: SchedulerOutput, ahead: bool) -> None:
        """Fast path of a step with only plain decode rows (no prefill, no drafts).

        Row i has one query token (its request's newest token) at position
        ``num_computed_tokens`` and owns logits row i, so every array but the token ids and
        positions is fixed by ``n``; ``request_ids``/``prompt_lens`` come from the
        scheduler's `DecodeBatch` when it has one (the same lists every step).

        ``ahead``: the step after a launched step whose tokens the requests do not have yet
        (async scheduling): every row is one position further and ``input_ids`` is a
        placeholder (zeros) until the caller writes the launched step's tokens into it.
        """
        batch = sched.decode_batch
        if batch is not None:
            reqs = batch.requests
            self.request_ids = batch.request_ids
            self.prompt_lens = batch.prompt_lens
        else:
            reqs = [s.request for s in sched.seqs]
            self.request_ids = [r.request_id for r in reqs]
            self.prompt_lens = [r.num_prefill_tokens for r in reqs]
        n = len(reqs)
        if ahead:
            self.input_ids = np.zeros(n, dtype=np.int64)
        else:
            self.input_ids = np.array(
                [
                    r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
                    for r in reqs
                ],
                dtype=np.int64,
            )
        self.num_cached = np.array([r.num_computed_tokens + ahead for r in reqs], dtype=np.int32)
        self.positions = self.num_cached.astype(np.int64)
        self.logits_rows = np.arange(n, dtype=np.int64)
        self.row_slices = _unit_slices(n)
        self.seq_lens = np.ones(n, dtype=np.int32)


@functools.lru_cache(maxsize=64)
def _unit_slices(n: int) -> tuple[slice, ...]:
    """``(slice(0, 1), .., slice(n - 1, n))``: row i of a decode-only step owns logits row i."""
    return tuple(slice(i, i + 1) for i in range(n))


class ModelRunner:
    """Runs the model on scheduled batches.

    Args:
        model: a `kvplan.models.llama.LlamaForCausalLM`.
        metadata: the backend's metadata object (``backend.Metadata(...)``), reused every step.
        device: the model device.
        graphs: optional `kvplan.engine.cuda_graphs.DecodeGraphs` for decode-only steps.
    """

    def __init__(self, model: Any, metadata: Any, device: torch.device, graphs: Any = None) -> None:
        self.model = model
        self.metadata = metadata
        self.device = device
        self.graphs = graphs

    def fill_metadata(self, sched: SchedulerOutput, inputs: StepInputs) -> None:
        set_step_fields(
            self.metadata,
            inputs.request_ids,
            inputs.prompt_lens,
            inputs.num_cached,
            inputs.seq_lens,
            sched.num_contexts,
        )

    def execute(
        self, sched: SchedulerOutput, device_input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, StepInputs]:
        """Run one step; returns (fp32 logits ``[N, V]`` on the device, the host inputs).

        ``device_input_ids``: int64 ``[num_seqs]`` on the device, the input tokens of a
        decode-only step scheduled ahead (`StepInputs` ``ahead``; async scheduling): the
        model reads them in place of the host ``input_ids``, which are still placeholders.
        """
        ahead = device_input_ids is not None
        inputs = StepInputs(sched, ahead)
        self.fill_metadata(sched, inputs)
        if self.graphs is not None and self.graphs.can_run(sched, inputs):
            return self.graphs.run(inputs, device_input_ids), inputs
        dev = self.device
        if ahead:
            input_ids = device_input_ids
        else:
            input_ids = torch.from_numpy(inputs.input_ids).to(dev, non_blocking=True)
        positions = torch.from_numpy(inputs.positions).to(dev, non_blocking=True)
        rows = torch.from_numpy(inputs.logits_rows).to(dev, non_blocking=True)
        logits = self.model(input_ids, positions, self.metadata, rows)
        return logits, inputs
