"""Speculative decoding (n-gram drafts) on DeepSeek-V4 models: verification rows write the
sliding-window ring (``W + k`` slots) and the compressor-state rings, and the rows of rejected
drafts are rolled back (`kvplan.backends.hybrid.drafts`). Greedy tokens equal HF's
``generate`` and the engine's own output without drafts, with drafts both accepted and
rejected, across chunked prefill, batching, preemption and prefix caching."""

from __future__ import annotations

import pytest
import torch

from kvplan import LLM, SamplingParams
from kvplan.backends.hybrid.drafts import DraftRollback, max_drafts
from kvplan.engine.hybrid import PENDING_TOKEN, PendingTokenIds, TailTokenIds
from tests.models.dsv4_testlib import hf_greedy, random_tokens, saved_folder

N_NEW = 24


@pytest.fixture(scope="module", params=[0, 5])
def pair(request, tmp_path_factory):
    seed = request.param
    return saved_folder(seed, tmp_path_factory.mktemp(f"dsv4_spec_{seed}"))


def _prompts(seed: int) -> list[list[int]]:
    """Repetitive prompts (prompt lookup finds n-grams) of several lengths."""
    base = [random_tokens(seed * 10 + i, n, vocab=12) for i, n in enumerate((5, 3, 7))]
    return [b * r for b, r in zip(base, (5, 9, 3))]


GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)


def _engine(folder: str, **kw) -> LLM:
    args = dict(device="cpu", max_num_batched_tokens=16, max_num_seqs=3, max_model_len=96)
    return LLM(folder, **{**args, **kw})


@pytest.mark.parametrize("k", [3, 7])
def test_drafts_give_hf_greedy_tokens_some_accepted_some_rejected(pair, k):
    hf, folder = pair
    prompts = _prompts(1)
    llm = _engine(folder, num_speculative_tokens=k)
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, N_NEW)
    proposed = sum(o.num_draft_tokens_proposed for o in outs)
    accepted = sum(o.num_draft_tokens_accepted for o in outs)
    assert 0 < accepted < proposed  # both paths ran: kept drafts and rolled-back ones
    fam = llm.parts.core.runner.families["hybrid"].family
    assert fam.config.swa_block_size == fam.config.window_size + k
    m = llm.parts.manager
    assert m.num_requests == 0 and m.num_free_blocks() == llm.parts.num_blocks - 1


def test_without_rollback_the_output_differs(pair, monkeypatch):
    """The state rollback is what keeps the tokens right: with `restore` a no-op the same
    run leaves HF's tokens (the equality test above can fail)."""
    hf, folder = pair
    prompts = _prompts(1)
    monkeypatch.setattr(DraftRollback, "restore", lambda self, accepted: None)
    outs = _engine(folder, num_speculative_tokens=7).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] != [hf_greedy(hf, p, N_NEW) for p in prompts]


def test_without_the_ring_slack_the_output_differs(pair, monkeypatch):
    """The sliding-window ring's ``k`` extra slots are needed too: with a ring of the
    window alone, rejected drafts overwrite rows later queries read."""
    from kvplan.backends.hybrid.planned import PlannedHybridFamily

    hf, folder = pair
    prompts = _prompts(1)
    init = PlannedHybridFamily.__init__
    monkeypatch.setattr(PlannedHybridFamily, "__init__",
                        lambda self, *a, **kw: init(self, *a, **{**kw, "ring_size": None}))  # fmt: skip
    outs = _engine(folder, num_speculative_tokens=7).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] != [hf_greedy(hf, p, N_NEW) for p in prompts]


@pytest.mark.parametrize("kv_format", ["fp8", "fp4"])
def test_quantized_caches_give_the_tokens_of_plain_decoding(pair, kv_format):
    _, folder = pair
    prompts = _prompts(2)
    plain = _engine(folder, kv_format=kv_format).generate(prompts, GREEDY)
    spec = _engine(folder, kv_format=kv_format, num_speculative_tokens=4).generate(prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.num_draft_tokens_accepted for o in spec) > 0


def test_preemption_and_prefix_caching_keep_hf_tokens(pair):
    """Few blocks (requests are preempted and recomputed) and a conversation whose next
    turn resumes from a snapshot: the tokens stay HF's, and nothing is left allocated."""
    hf, folder = pair
    prompts = [random_tokens(60 + i, 6, vocab=10) * 4 for i in range(4)]
    llm = _engine(folder, num_speculative_tokens=5, max_num_seqs=4, max_model_len=64,
                  block_size=16, num_blocks=8)  # fmt: skip
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, N_NEW)
    assert llm.parts.core.scheduler.num_preemptions > 0
    assert sum(o.num_draft_tokens_accepted for o in outs) > 0
    m = llm.parts.manager
    assert m.num_requests == 0 and m.num_free_blocks() == llm.parts.num_blocks - 1


@pytest.mark.parametrize("k", [3, 7])
def test_a_conversation_resumes_where_plain_decoding_would(pair, k):
    """Block boundaries that verification steps pass inside their drafts keep snapshots
    (kept where the accepted tokens reach them, discarded where drafts were rejected): the
    next turns resume at the same boundary as with plain decoding, with HF's tokens."""
    hf, folder = pair
    plain = _engine(folder, max_model_len=160)
    spec = _engine(folder, max_model_len=160, num_speculative_tokens=k)
    p = _prompts(3)[0]
    for turn in range(3):
        a, b = plain.generate([p], GREEDY)[0], spec.generate([p], GREEDY)[0]
        assert b.token_ids == a.token_ids == hf_greedy(hf, p, N_NEW)
        assert b.num_cached_prefix_tokens == a.num_cached_prefix_tokens
        assert turn == 0 or b.num_cached_prefix_tokens > 0
        p = p + b.token_ids + random_tokens(4 + turn, 3, vocab=12)
    snaps = spec.parts.core.runner.families["hybrid"].snapshots
    assert snaps.num_pending == 0 and snaps.num_restored == 2


def test_tail_token_ids_read_the_base_then_the_tail():
    base = [5, 6, 7]
    ids = TailTokenIds(base, (8, 9))
    assert len(ids) == 5 and list(ids) == [5, 6, 7, 8, 9]
    assert ids[-1] == 9 and ids[3] == 8 and ids[-5] == 5
    assert (
        ids[:2] == [5, 6] and ids[:5] is ids and ids[1:4] == [6, 7, 8] and ids[:4] == [5, 6, 7, 8]
    )
    with pytest.raises(IndexError, match="outside"):
        ids[5]
    pending = PendingTokenIds(base)
    assert list(pending) == [5, 6, 7, PENDING_TOKEN]


def test_one_state_slot(pair):
    """``max_num_seqs=1``: one state slot, so the trash row is a large share of each state
    tensor (the rollback must not count it into the ring's rows)."""
    hf, folder = pair
    prompts = _prompts(5)
    llm = _engine(folder, max_num_seqs=1, num_speculative_tokens=3)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, N_NEW) for p in prompts]
    assert sum(o.num_draft_tokens_accepted for o in outs) > 0
    assert sum(o.num_draft_tokens_accepted for o in outs) < sum(
        o.num_draft_tokens_proposed for o in outs
    )


def _family(device: str = "cpu", slots: int = 3):
    from kvplan.backends.hybrid.api import HybridLayerSpec
    from kvplan.backends.hybrid.planned import PlannedHybridFamily

    specs = [
        HybridLayerSpec("compressed_sparse_attention", 6, 4, 2, 16, 8, 2, 4),
        HybridLayerSpec("heavily_compressed_attention", 6, 16, 0, 16, 0, 2, 0),
    ]
    return PlannedHybridFamily(specs, block_size=16, num_blocks=4, num_state_slots=slots,
                               max_model_len=64, device=device)  # fmt: skip


@pytest.mark.parametrize("slots", [1, 3])
def test_rollback_puts_back_exactly_the_rejected_rows(slots):
    fam = _family(slots=slots)
    assert max_drafts(fam.layers) == 7  # CSA ratio 4: rings of 8 rows
    gen = torch.Generator().manual_seed(0)
    live = [t for c in fam.caches for pair in c.state.values() for t in pair]
    for t in live:
        t.copy_(torch.randn(t.shape, generator=gen))
    before = [t.clone() for t in live]
    last = slots - 1
    rows = [(last, 13, 5), (0, 30, 3)]  # (state slot, newest position L, drafts)
    rollback = DraftRollback(fam, rows)
    for t in live:  # the step writes every row of the state rings
        t.add_(1.0)
    written = [t.clone() for t in live]
    rollback.restore([2, 3])  # row 0 rejects drafts 3..5 (positions 16..18), row 1 none
    assert rollback.num_restored == 3
    for t, b, w in zip(live, before, written):
        big_r = (t.shape[0] - 1) // slots
        back = {last * big_r + p % big_r for p in (16, 17, 18)}
        for r in range(t.shape[0]):
            assert torch.equal(t[r], b[r] if r in back else w[r]), (big_r, r)


def test_rollback_checks_its_arguments():
    fam = _family()
    with pytest.raises(ValueError, match=r"rows\[0\]: num_drafts = 8, need 1 <= num_drafts <= 7"):
        DraftRollback(fam, [(0, 3, 8)])
    rollback = DraftRollback(fam, [(0, 3, 2)])
    with pytest.raises(ValueError, match="accepted has 2 entries, need 1"):
        rollback.restore([0, 1])
    with pytest.raises(ValueError, match="each must lie in 0 .. num_drafts"):
        rollback.restore([3])
    assert max_drafts(fam.layers) == 7


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["auto", "fp8"])
def test_cuda_drafts_with_graphs_give_the_cpu_tokens(pair, kv_format):
    """On CUDA (fp32): plain decode steps replay CUDA graphs over the ``W + k`` ring, the
    verification steps run eagerly with the Triton kernels; the tokens are the CPU
    engine's without drafts (HF's, for the exact cache)."""
    hf, folder = pair
    prompts = _prompts(1)
    want = [o.token_ids for o in _engine(folder, kv_format=kv_format).generate(prompts, GREEDY)]
    if kv_format == "auto":
        assert want == [hf_greedy(hf, p, N_NEW) for p in prompts]
    gpu = _engine(folder, device="cuda", dtype="float32", kv_format=kv_format,
                  num_speculative_tokens=4)  # fmt: skip
    assert gpu.parts.core.runner.graphs is not None
    outs = gpu.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert sum(o.num_draft_tokens_accepted for o in outs) > 0
    assert gpu.parts.core.runner.graphs.num_replays > 0
