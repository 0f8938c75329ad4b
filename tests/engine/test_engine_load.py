"""Under load: 200 requests of random lengths through a KV pool far too small for all of them.

Chunked prefill, prefix caching and preemption by recompute are all active; every request must
finish with exactly the tokens it gets when run alone, and no block may leak.
"""

from __future__ import annotations

import random
from functools import partial

import pytest

from kvplan import LLM as _LLM
from kvplan import SamplingParams
from kvplan.models.config import named_config

# CPU fp32 semantics (token equality with HF fp32) even where CUDA is present
LLM = partial(_LLM, device="cpu")

CFG = named_config("tiny-llama")


def _requests(n: int, seed: int):
    rng = random.Random(seed)
    shared = [rng.randrange(CFG.vocab_size) for _ in range(12)]
    out = []
    for _ in range(n):
        k = rng.randint(1, 40)
        prompt = [rng.randrange(CFG.vocab_size) for _ in range(k)]
        if rng.random() < 0.3:
            prompt = shared + prompt  # some prefixes repeat: prefix reuse under eviction
        out.append((prompt, SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True)))
    return out


@pytest.mark.parametrize("spec", [0, 3], ids=["plain", "speculative"])
def test_many_requests_small_pool(spec):
    reqs = _requests(200 if spec == 0 else 60, seed=spec)
    alone = LLM(
        CFG,
        backend="block_offsets",
        block_size=4,
        max_model_len=80,
        max_num_seqs=1,
        enable_prefix_caching=False,
    )
    expected = [alone.generate([p], sp)[0].token_ids for p, sp in reqs]

    llm = LLM(
        CFG,
        backend="block_offsets",
        block_size=4,
        max_model_len=80,
        max_num_seqs=32,
        max_num_batched_tokens=48,
        num_blocks=45,
        num_speculative_tokens=spec,
    )
    outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.num_cached_prefix_tokens for o in outs) > 0
    if spec:
        accepted = sum(o.num_draft_tokens_accepted for o in outs)
        assert accepted > 0
    manager = llm.parts.manager
    assert manager.num_requests == 0
    assert manager.num_free_blocks() == llm.parts.num_blocks - 1


def test_abort_frees_blocks_and_others_finish():
    llm = LLM(CFG, backend="vanilla", block_size=4, max_model_len=80, num_blocks=41)
    params = SamplingParams(max_tokens=15, ignore_eos=True)
    ids = [llm.add_request([1, 2, 3, 4, 5, 6, 7][: k + 1], params) for k in range(5)]
    for _ in range(3):
        llm.step()
    llm.abort(ids[2])
    llm.abort(ids[2])  # aborting a finished request is a no-op
    while llm.engine.has_unfinished():
        llm.step()
    reqs = llm.pop_finished()
    assert [r.request_id for r in reqs] == ids
    assert [r.finish_reason for r in reqs] == ["length", "length", "abort", "length", "length"]
    assert len(reqs[2].token_ids) < 15
    assert all(len(r.token_ids) == 15 for k, r in enumerate(reqs) if k != 2)
    assert llm.parts.manager.num_free_blocks() == 40
    with pytest.raises(ValueError, match="unknown request id"):
        llm.abort(999)
