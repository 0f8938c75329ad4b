"""Helpers shared by the engine tests."""

from __future__ import annotations

from kvplan.engine.scheduler import Scheduler
from kvplan.engine.step import StepBatch


def run_schedules(s: Scheduler, num_steps: int, token: int) -> list[StepBatch]:
    """``num_steps`` scheduler steps without a model: every scheduled row computes its query
    tokens and its request gets ``token`` as its next output. Returns each step's output."""
    outs = []
    for _ in range(num_steps):
        out = s.schedule()
        for row in out.seqs:
            row.request.num_computed_tokens += row.num_query_tokens
            row.request.output_token_ids.append(token)
        outs.append(out)
    return outs
