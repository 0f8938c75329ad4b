"""Model runner: one `StepBatch` -> model inputs + each attention family's plan -> logits.

Host work per step is O(tokens) numpy: token ids and the rows whose logits are needed
(`StepInputs`; positions come from the `StepBatch`). Each attention family turns the step
into the metadata its kernels read (`kvplan.engine.families`), once per step; the model gets
them as a mapping family name -> metadata and each layer reads its own family's. Everything
goes to the device in one copy per tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from kvplan.engine.families import PAGED, AttentionFamily
from kvplan.engine.step import StepBatch


class StepInputs:
    """Host arrays of one step's model inputs, in batch row order.

    ``input_ids``/``positions``: int64 ``[T]``; ``logits_rows``: int64 ``[N]`` rows of T whose
    logits are needed (the last query token of every sampling row; every query token of a
    speculative-verification row); ``row_slices[i]``: the slice of ``logits_rows`` owned by
    scheduled row i (empty for a prefill chunk that is not the last one; a list, or a shared
    tuple on the decode-only path).

    Prompt logprobs: a prefill row of a request that asks for them (and still misses some)
    also gets the rows of its chunk's positions that predict a prompt token, after every
    sampling row: ``logits_rows[num_sample_rows:]``; ``prompt_rows[j] = (seq index, first prompt
    token index, count)`` in that order (the request's next ``count`` prompt entries). Empty otherwise.

    A step scheduled ahead (``step.ahead``, async scheduling) gets placeholder ``input_ids``
    (zeros) until the caller writes the launched step's tokens into them.

    ``greedy_tokens``: set by `ModelRunner.execute` when the step replayed a decode graph that
    captured the greedy argmax: int64 ``[N]`` on the device, ``argmax(-1)`` of each logits
    row (the graph's static buffer: valid until the next replay); None otherwise.
    """

    greedy_tokens: torch.Tensor | None = None

    def __init__(self, step: StepBatch) -> None:
        self.positions = step.positions
        if step.num_contexts == 0:
            self._init_decode_only(step)
            return
        if step.ahead:
            raise ValueError("a step scheduled ahead must be decode-only (num_contexts == 0)")
        ids: list[int] = []
        rows: list[int] = []
        extra: list[int] = []
        self.prompt_rows: list[tuple[int, int, int]] = []
        self.row_slices: list[slice] = []
        for i, s in enumerate(step.seqs):
            r = s.request
            n = s.num_query_tokens
            offset = len(ids)
            if s.is_prefill:
                start = r.num_computed_tokens
                ids.extend(r.all_token_ids[start : start + n])
                if r.needs_prompt_logprobs:
                    # position p predicts prompt token p + 1; entries 0.. are tokens 1..
                    lo = max(start, len(r.prompt_logprobs))
                    hi = min(start + n, len(r.prompt_token_ids) - 1)
                    if hi > lo:
                        extra.extend(range(offset + lo - start, offset + hi - start))
                        self.prompt_rows.append((i, lo + 1, hi - lo))
            else:
                ids.append(r.last_token_id)
                ids.extend(s.drafts)
            first = len(rows)
            if s.drafts:
                rows.extend(range(offset, offset + n))
            elif s.samples:
                rows.append(offset + n - 1)
            self.row_slices.append(slice(first, len(rows)))
        self.input_ids = np.array(ids, dtype=np.int64)
        self.num_sample_rows = len(rows)
        self.logits_rows = np.array(rows + extra, dtype=np.int64)

    def _init_decode_only(self, step: StepBatch) -> None:
        """Fast path of a step with only plain decode rows (no prefill, no drafts): row i
        has one query token (its request's newest token) and owns logits row i."""
        n = len(step.seqs)
        if step.ahead:
            self.input_ids = np.zeros(n, dtype=np.int64)
        else:
            self.input_ids = np.array(
                [
                    r.output_token_ids[-1] if r.output_token_ids else r.prompt_token_ids[-1]
                    for r in step.requests
                ],
                dtype=np.int64,
            )
        self.logits_rows = np.arange(n, dtype=np.int64)
        self.num_sample_rows = n
        self.prompt_rows = ()
        self.row_slices = _unit_slices(n)


@functools.lru_cache(maxsize=64)
def _unit_slices(n: int) -> tuple[slice, ...]:
    """``(slice(0, 1), .., slice(n - 1, n))``: row i of a decode-only step owns logits row i."""
    return tuple(slice(i, i + 1) for i in range(n))


class ModelRunner:
    """Runs the model on scheduled steps.

    Args:
        model: a model whose ``layer_families`` names the family of each layer, called as
            ``model(input_ids, positions, attention, logits_indices)`` (e.g.
            `kvplan.models.llama.LlamaForCausalLM`).
        families: family name -> `AttentionFamily`, one per family the model's layers use.
        device: the model device.
        graphs: optional `kvplan.engine.cuda_graphs.DecodeGraphs` (or
            `kvplan.engine.hybrid_graphs.HybridDecodeGraphs`) for decode-only steps.
    """

    def __init__(
        self,
        model: Any,
        families: Mapping[str, AttentionFamily],
        device: torch.device,
        graphs: Any = None,
    ) -> None:
        missing = set(model.layer_families) - set(families)
        if missing:
            raise ValueError(f"no attention family for the model's layers of {sorted(missing)}")
        self.model = model
        self.families = dict(families)
        self.device = device
        self.graphs = graphs
        # families that act once the step's launches are queued (state snapshots)
        self._after_step = [f for f in self.families.values() if hasattr(f, "after_step")]
        # families whose per-request state must forget rejected drafts (hybrid state rings)
        self._verified = [f for f in self.families.values() if hasattr(f, "drafts_verified")]

    @property
    def metadata(self) -> Any:
        """The paged family's `AttentionMetadata` (None when no layer is paged)."""
        paged = self.families.get(PAGED)
        return None if paged is None else paged.metadata

    def plan(self, step: StepBatch) -> dict[str, Any]:
        """Each family's metadata for ``step``: family name -> planned metadata."""
        attention = {}
        for name, family in self.families.items():
            attention[name] = family.plan(step)
        return attention

    def free(self, request_id: Any) -> None:
        """Drop a finished or preempted request's per-request state in every family."""
        for family in self.families.values():
            family.free(request_id)

    def drafts_verified(self, step: StepBatch, accepted: dict[int, int]) -> None:
        """Tell the families that keep per-request state how many drafts each verification
        row of ``step`` accepted (row index -> count), before its tokens are committed."""
        for family in self._verified:
            family.drafts_verified(step, accepted)

    def execute(
        self, step: StepBatch, device_input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, StepInputs]:
        """Run one step, then each family's ``after_step(step)`` if it has one; returns
        (logits ``[N, V]`` on the device, fp32 or the model's dtype
        (its ``float_logits``), one row per entry of ``inputs.logits_rows``, the host inputs).
        A graph replay also sets ``inputs.greedy_tokens`` (the graph's argmax of the logits;
        ``graphs.greedy_tokens``).

        ``device_input_ids``: int64 ``[num_seqs]`` on the device, the input tokens of a
        decode-only step scheduled ahead (``step.ahead``; async scheduling): the model
        reads them in place of the host ``input_ids``, which are still placeholders.
        """
        inputs = StepInputs(step)
        attention = self.plan(step)
        if self.graphs is not None and self.graphs.can_run(step):
            logits = self.graphs.run(inputs, device_input_ids)
            inputs.greedy_tokens = self.graphs.greedy_tokens(logits.shape[0])
        else:
            dev = self.device
            if device_input_ids is not None:
                input_ids = device_input_ids
            else:
                input_ids = torch.from_numpy(inputs.input_ids).to(dev, non_blocking=True)
            positions = torch.from_numpy(inputs.positions).to(dev, non_blocking=True)
            rows = torch.from_numpy(inputs.logits_rows).to(dev, non_blocking=True)
            logits = self.model(input_ids, positions, attention, rows)
        for family in self._after_step:
            family.after_step(step)
        return logits, inputs
