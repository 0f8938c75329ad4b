"""Model runner: one scheduled batch -> input tensors + attention metadata -> model -> logits.

Host work per step is O(tokens) numpy: token ids, positions, the rows whose logits are needed;
the attention metadata gets the scheduler's raw facts (request ids, query lengths, cached
lengths, number of context rows) and its ``prepare()`` derives the backend's kernel format.
Everything goes to the device in one copy per tensor.
"""

from __future__ import annotations

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
    scheduled row i (empty for a prefill chunk that is not the last one). ``request_ids`` and
    ``prompt_lens`` (Python int lists ``[num_seqs]``) feed the attention metadata.
    """

    def __init__(self, sched: SchedulerOutput) -> None:
        if sched.num_contexts == 0:
            self._init_decode_only(sched)
            return
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

    def _init_decode_only(self, sched: SchedulerOutput) -> None:
        """Fast path of a step with only plain decode rows (no prefill, no drafts).

        Row i has one query token (its request's newest token) at position
        ``num_computed_tokens`` and owns logits row i, so every array but the token ids is a
        numpy expression over the cached lengths: one Python pass over the rows in all.
        """
        n = len(sched.seqs)
        ids = np.empty(n, dtype=np.int64)
        cached = np.empty(n, dtype=np.int32)
        self.request_ids = [0] * n
        self.prompt_lens = [0] * n
        for i, s in enumerate(sched.seqs):
            r = s.request
            ids[i] = r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
            cached[i] = r.num_computed_tokens
            self.request_ids[i] = r.request_id
            self.prompt_lens[i] = r.num_prefill_tokens
        self.input_ids = ids
        self.positions = cached.astype(np.int64)
        self.logits_rows = np.arange(n, dtype=np.int64)
        self.row_slices = [slice(i, i + 1) for i in range(n)]
        self.seq_lens = np.ones(n, dtype=np.int32)
        self.num_cached = cached


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

    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, StepInputs]:
        """Run one step; returns (fp32 logits ``[N, V]`` on the device, the host inputs)."""
        inputs = StepInputs(sched)
        self.fill_metadata(sched, inputs)
        if self.graphs is not None and self.graphs.can_run(sched, inputs):
            return self.graphs.run(inputs), inputs
        dev = self.device
        input_ids = torch.from_numpy(inputs.input_ids).to(dev, non_blocking=True)
        positions = torch.from_numpy(inputs.positions).to(dev, non_blocking=True)
        rows = torch.from_numpy(inputs.logits_rows).to(dev, non_blocking=True)
        logits = self.model(input_ids, positions, self.metadata, rows)
        return logits, inputs
