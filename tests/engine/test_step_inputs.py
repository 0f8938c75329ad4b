"""Step inputs: the decode-only fast path builds exactly what the general per-row path builds."""

from __future__ import annotations

import numpy as np

from kvplan.engine.request import Request
from kvplan.engine.runner import StepInputs
from kvplan.engine.sampling import SamplingParams
from kvplan.engine.step import DecodeBatch, ScheduledSeq, StepBatch


def _decoding_requests(seed: int, n: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        prompt = rng.integers(0, 1000, int(rng.integers(1, 20))).tolist()
        out = rng.integers(0, 1000, int(rng.integers(0, 6))).tolist()  # 0: first decode step
        r = Request(10 + 3 * i, prompt, SamplingParams(max_tokens=50), output_token_ids=out)
        r.num_prefill_tokens = len(prompt) + max(0, len(out) - 2)  # as after a preemption
        r.num_computed_tokens = len(prompt) + len(out) - 1 if out else len(prompt) - 1
        reqs.append(r)
    return reqs


def _expected(reqs: list[Request]) -> dict:
    """Per-row reference: a decode row feeds its newest token at position num_computed."""
    return {
        "input_ids": [r.all_token_ids[-1] for r in reqs],
        "positions": [r.num_computed_tokens for r in reqs],
        "logits_rows": list(range(len(reqs))),
        "seq_lens": [1] * len(reqs),
        "num_cached": [r.num_computed_tokens for r in reqs],
        "request_ids": [r.request_id for r in reqs],
        "prompt_lens": [r.num_prefill_tokens for r in reqs],
        "row_slices": [(i, i + 1) for i in range(len(reqs))],
    }


def _got(step: StepBatch) -> dict:
    """The step's facts (`StepBatch`) and the model inputs built from them (`StepInputs`)."""
    inputs = StepInputs(step)
    return {
        "input_ids": inputs.input_ids.tolist(),
        "positions": inputs.positions.tolist(),
        "logits_rows": inputs.logits_rows.tolist(),
        "seq_lens": step.num_query_tokens.tolist(),
        "num_cached": step.num_cached_tokens.tolist(),
        "request_ids": list(step.request_ids),
        "prompt_lens": list(step.prompt_lens),
        "row_slices": [(s.start, s.stop) for s in inputs.row_slices],
    }


def test_decode_only_fast_path_matches_reference_and_general_path():
    reqs = _decoding_requests(0, 9)
    step = StepBatch.decode(DecodeBatch.from_seqs([ScheduledSeq(r, 1, False) for r in reqs]))
    fast_inputs = StepInputs(step)
    assert _got(step) == _expected(reqs)
    fast = _got(step)
    assert fast_inputs.input_ids.dtype == np.int64 and fast_inputs.positions.dtype == np.int64
    assert step.num_query_tokens.dtype == np.int32 and step.num_cached_tokens.dtype == np.int32
    # the general path runs when a context row leads the batch; its decode rows must agree
    ctx = Request(1, [5, 6, 7, 8], SamplingParams(max_tokens=5))
    ctx.num_prefill_tokens = 4
    rows = [ScheduledSeq(ctx, 4, True)] + [ScheduledSeq(r, 1, False) for r in reqs]
    general = _got(StepBatch.general(rows, 1))
    assert general["input_ids"][4:] == fast["input_ids"]
    assert general["positions"][4:] == fast["positions"]
    assert general["num_cached"][1:] == fast["num_cached"]
    assert general["request_ids"][1:] == fast["request_ids"]
    assert general["prompt_lens"][1:] == fast["prompt_lens"]
    assert general["logits_rows"] == [3] + [4 + i for i in range(len(reqs))]
