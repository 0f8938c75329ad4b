"""`TPModelRunner`: rank 0's `ModelRunner`, which broadcasts every step before running it.

``execute(step)`` plans the step locally first (a step that does not plan is rejected before
any rank hears of it), then, inside the group's `collective`, broadcasts one ``STEP`` message
(facts, block-table rows, token ids, positions, logits rows) and runs its model shard; the
model's all-reduces and the logits gather pair with the workers'. ``plan`` and ``model``
called on their own (teacher-forced scoring) broadcast ``PLAN`` and ``FORWARD`` messages.
CUDA graphs and steps scheduled ahead are not used with tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvplan.distributed.step_broadcast import Kind, StepFacts, send
from kvplan.engine.families import AttentionFamily
from kvplan.engine.runner import ModelRunner, StepInputs
from kvplan.engine.step import StepBatch


class _BroadcastingModel:
    """The model as the runner's callers see it: each call is broadcast as ``FORWARD``."""

    def __init__(self, model: Any, runner: TPModelRunner) -> None:
        self._model, self._runner = model, runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, input_ids, positions, attention, logits_indices=None) -> torch.Tensor:
        group = self._runner.group
        with group.collective():
            send(Kind.FORWARD, group.device, inputs=(input_ids, positions, logits_indices))
            return self._model(input_ids, positions, attention, logits_indices)


class TPModelRunner(ModelRunner):
    """A `ModelRunner` for rank 0 of ``group`` (a `TensorParallelGroup`); ``manager`` is the
    KV cache manager whose block tables the steps read."""

    def __init__(
        self,
        model: Any,
        families: Mapping[str, AttentionFamily],
        device: torch.device,
        group: Any,
        manager: Any,
    ) -> None:
        super().__init__(model, families, device, None)
        self.shard = model
        self.model = _BroadcastingModel(model, self)
        self.group = group
        self.manager = manager
        group.start_serving()

    def plan(self, step: StepBatch) -> dict[str, Any]:
        attention = super().plan(step)
        with self.group.collective():
            send(Kind.PLAN, self.group.device, facts=StepFacts.of(step, self.manager))
        return attention

    def execute(
        self, step: StepBatch, device_input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, StepInputs]:
        if device_input_ids is not None:
            raise ValueError("tensor-parallel steps are never scheduled ahead")
        inputs = StepInputs(step)
        attention = super().plan(step)
        facts = StepFacts.of(step, self.manager)
        dev = self.device
        input_ids = torch.from_numpy(inputs.input_ids).to(dev, non_blocking=True)
        positions = torch.from_numpy(inputs.positions).to(dev, non_blocking=True)
        rows = torch.from_numpy(inputs.logits_rows).to(dev, non_blocking=True)
        group = self.group
        with group.collective():
            send(
                Kind.STEP,
                group.device,
                facts,
                (inputs.input_ids, inputs.positions, inputs.logits_rows),
            )
            logits = self.shard(input_ids, positions, attention, rows)
        return logits, inputs
