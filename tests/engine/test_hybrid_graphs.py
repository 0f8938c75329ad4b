"""CUDA-graph decode steps of DeepSeek-V4 (hybrid family).

CPU: the static-buffer step (persistent buffers rewritten in place, padding rows, fixed
shapes) run eagerly equals the eager planned step, logits and caches, over decode steps of
varying batch sizes; the engine with eager stand-ins for the graphs gives the tokens of
plain eager steps. GPU: captured graphs replay the eager steps, and greedy outputs with graphs
equal those without.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvplan import LLM, SamplingParams
from kvplan.backends.hybrid.api import HybridSeq
from kvplan.backends.hybrid.planned import PlannedHybridFamily
from kvplan.backends.hybrid.static_step import StaticDecodeBuffers, StaticDecodeStep
from kvplan.engine.cuda_graphs import bucket_for, decode_buckets
from kvplan.engine.hybrid import HYBRID, hybrid_block_size
from kvplan.engine.hybrid_graphs import HybridDecodeGraphs
from kvplan.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM, init_random
from tests.models.dsv4_testlib import hf_config, hf_model, random_tokens

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
MAX_LEN = 64


def _family(cfg: DeepseekV4Config, num_seqs: int, kv_format: str) -> PlannedHybridFamily:
    specs = cfg.layer_specs()
    bs = hybrid_block_size(8, sorted({s.ratio for s in specs if s.ratio}))
    per_seq = -(-MAX_LEN // bs)
    return PlannedHybridFamily(specs, block_size=bs, num_blocks=1 + num_seqs * per_seq,
                               num_state_slots=num_seqs, max_model_len=MAX_LEN,
                               kv_format=kv_format, check=True)  # fmt: skip


def _caches(family: PlannedHybridFamily) -> list[torch.Tensor]:
    """Every cache byte of the family; compressor-state rings without their trash row."""
    out = []
    for c in family.caches:
        out.append(c.ring.cache.view(torch.uint8))
        out += [p.cache.view(torch.uint8) for p in c.pools.values()]
        out += [t[:-1] for pair in c.state.values() for t in pair]
    return out


@pytest.mark.parametrize(("seed", "kv_format"), [(0, "exact"), (1, "exact"), (2, "fp8")])
@torch.no_grad()
def test_static_step_equals_eager_step_on_cpu(seed, kv_format):
    cfg = DeepseekV4Config.from_hf(hf_config(seed))
    model = init_random(DeepseekV4ForCausalLM(cfg), seed=seed, std=0.1)
    num_seqs = 5
    eager, static = _family(cfg, num_seqs, kv_format), _family(cfg, num_seqs, kv_format)
    per_seq = -(-MAX_LEN // eager.config.block_size)
    buffers = StaticDecodeBuffers(static, 8)
    steps = {b: StaticDecodeStep(static, b, buffers) for b in decode_buckets(8)}
    rng = random.Random(seed)
    tokens = {i: random_tokens(seed * 10 + i, rng.randint(4, 30)) for i in range(num_seqs)}

    def seq(i: int, q_start: int, n: int) -> HybridSeq:
        return HybridSeq(i, q_start, n, tokens[i], range(1 + i * per_seq, 1 + (i + 1) * per_seq), i)

    for fam in (eager, static):  # the same prompts (but their last token) on both families
        prompt = [seq(i, 0, len(tokens[i]) - 1) for i in range(num_seqs)]
        ids = torch.tensor([t for i in range(num_seqs) for t in tokens[i][:-1]])
        pos = torch.cat([torch.arange(len(tokens[i]) - 1) for i in range(num_seqs)])
        model(ids, pos, fam.plan(prompt, pos))
    num_padded = 0
    for step_idx in range(14):
        rows = rng.sample(range(num_seqs), rng.randint(1, num_seqs))
        seqs = [seq(i, len(tokens[i]) - 1, 1) for i in rows]
        pos = torch.tensor([s.q_start for s in seqs])
        ids = torch.tensor([tokens[i][-1] for i in rows])
        want = model(ids, pos, eager.plan(seqs, pos))
        b = bucket_for(len(seqs), sorted(steps))
        num_padded += b > len(seqs)
        static.check_continuation(seqs)
        steps[b].stage(seqs)
        static.record(seqs)
        steps[b].begin()
        got = model(steps[b].input_ids, steps[b].positions, steps[b])[: len(seqs)]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"step {step_idx}")
        for a, e in zip(_caches(static), _caches(eager)):
            if kv_format == "exact" and a.dtype == torch.uint8:
                a, e = a.view(torch.float32), e.view(torch.float32)
            torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5, msg=f"step {step_idx}")
        for i, t in zip(rows, want.argmax(dim=-1).tolist()):
            tokens[i].append(t)
    assert num_padded > 3
    assert min(len(t) for t in tokens.values()) >= 8  # windows of ratio 4 closed in decode


def test_static_step_rejects_bad_input():
    cfg = DeepseekV4Config.from_hf(hf_config(0))
    fam = _family(cfg, 2, "exact")
    buffers = StaticDecodeBuffers(fam, 2)
    with pytest.raises(ValueError, match="num_rows"):
        StaticDecodeStep(fam, 3, buffers)
    with pytest.raises(ValueError, match=r"max_seqlen_k = 65 outside \[1, max_model_len = 64\]"):
        StaticDecodeStep(fam, 2, buffers, MAX_LEN + 1)
    with pytest.raises(TypeError, match="max_seqlen_k"):
        StaticDecodeStep(fam, 2, buffers, 8.0)
    step = StaticDecodeStep(fam, 2, buffers)
    with pytest.raises(RuntimeError, match="stage"):
        step.begin()
    with pytest.raises(ValueError, match="decode rows"):
        step.stage([HybridSeq(0, 0, 2, [1, 2], [1], 0)])
    with pytest.raises(ValueError, match="do not fit"):
        step.stage([HybridSeq(i, 0, 1, [1], [1], 0) for i in range(3)])


class _EagerReplay:
    """Stand-in for a captured graph on CPU: re-runs the device half of the step the bucket
    staged and the model into the logits buffer this capture returned (the static step's
    host values do not change); ``tiers`` records each replay's tier."""

    def __init__(self, graphs: HybridDecodeGraphs, b: int) -> None:
        self.graphs, self.b = graphs, b
        self.out = graphs.logits[b]
        self.tier = graphs.staged_step(b).max_seqlen_k

    def replay(self) -> None:
        assert self.graphs.staged_step(self.b).max_seqlen_k == self.tier  # the tier's graph
        with torch.inference_mode():
            self.out.copy_(self.graphs._forward(self.b))
        self.graphs.__dict__.setdefault("tiers_run", []).append(self.tier)


class CpuGraphs(HybridDecodeGraphs):
    rows: list[int]

    def _capture(self, b, pool):
        self.logits[b] = self._forward(b)
        return _EagerReplay(self, b)

    def run(self, inputs, device_input_ids=None):
        self.__dict__.setdefault("rows", []).append(inputs.input_ids.shape[0])
        return super().run(inputs, device_input_ids)

    def greedy_tokens(self, n):
        """A copy, as `test_cuda_graphs._CpuGraphs` gives (the CPU has no stream order)."""
        tokens = super().greedy_tokens(n)
        return None if tokens is None else tokens.clone()


def _saved(tmp_path, seed: int):
    folder = tmp_path / f"dsv4_{seed}"
    hf_model(hf_config(seed), seed).save_pretrained(folder)
    return folder


def _prompts(seed: int) -> list[list[int]]:
    return [random_tokens(seed * 10 + i, n) for i, n in enumerate((29, 9, 41, 5, 17))]


@pytest.mark.parametrize("seed", [0, 3])
def test_engine_graph_plumbing_on_cpu(tmp_path, seed):
    """Decode steps through the static steps (eager stand-ins for graphs, padded buckets)
    give the tokens of plain eager steps; other steps stay eager."""
    folder = _saved(tmp_path, seed)
    kw = dict(device="cpu", max_num_seqs=5, max_model_len=96, max_num_batched_tokens=16)
    want = [o.token_ids for o in LLM(str(folder), **kw).generate(_prompts(seed), GREEDY)]
    llm = LLM(str(folder), **kw)
    runner = llm.engine.runner
    assert runner.graphs is None  # not on CPU
    engine_family = runner.families[HYBRID]
    graphs = CpuGraphs(runner.model, engine_family.family, 5)
    graphs.capture_all()
    assert sorted(graphs.graphs) == [1, 2, 4, 5]
    runner.graphs = engine_family.graphs = graphs
    got = [o.token_ids for o in llm.generate(_prompts(seed), GREEDY)]
    assert graphs.num_replays == len(graphs.rows) > 0
    assert set(graphs.rows) - set(graphs.buckets)  # padded buckets ran
    # every replayed step took the graph's (the stand-in's) argmax as its tokens
    assert llm.engine.num_graph_argmax_steps == graphs.num_replays
    assert got == want
    assert llm.parts.manager.num_free_blocks() == llm.parts.num_blocks - 1
    # decode steps replayed through the static steps snapshot their rows' state at block
    # boundaries too: the next turn of a conversation resumes from the newest one
    snaps = engine_family.snapshots
    taken = snaps.num_taken
    turn = _prompts(seed)[2] + got[2] + random_tokens(99, 4)  # 41 + 9 computed: 48
    ref = LLM(str(folder), **kw, enable_prefix_caching=False).generate([turn], GREEDY)[0]
    replays = graphs.num_replays
    out = llm.generate([turn], GREEDY)[0]
    assert out.num_cached_prefix_tokens == 48 and out.token_ids == ref.token_ids
    assert graphs.num_replays > replays and snaps.num_taken > taken


def test_default_context_tiers(monkeypatch):
    from kvplan.engine.hybrid_graphs import hybrid_context_bounds

    assert hybrid_context_bounds(131072) == (8192, 32768)
    assert hybrid_context_bounds(8192) == () and hybrid_context_bounds(8193) == (8192,)
    monkeypatch.setenv("KVPLAN_HYBRID_GRAPH_TIERS", "0")
    assert hybrid_context_bounds(131072) == ()


def test_engine_graph_context_tiers_on_cpu(tmp_path):
    """Decode graphs by context tier (eager stand-ins): each bucket has a step per tier whose
    widths follow the tier, a step replays the smallest tier holding its longest row, and
    the tokens equal plain eager steps'; a step rejects a row longer than its tier."""
    folder = _saved(tmp_path, 2)
    kw = dict(device="cpu", max_num_seqs=5, max_model_len=96, max_num_batched_tokens=16)
    want = [o.token_ids for o in LLM(str(folder), **kw).generate(_prompts(2), GREEDY)]
    llm = LLM(str(folder), **kw)
    runner = llm.engine.runner
    engine_family = runner.families[HYBRID]
    graphs = CpuGraphs(runner.model, engine_family.family, 5, context_bounds=(16, 32, 500))
    assert graphs.tiers == [16, 32, 96]
    assert {k: s.max_seqlen_k for k, s in graphs.steps.items()} == {
        (b, t): t for b in (1, 2, 4, 5) for t in (16, 32, 96)
    }
    graphs.capture_all()
    assert sorted(graphs.graphs) == [1, 2, 4, 5] and len(graphs.tier_graphs) == 8
    runner.graphs = engine_family.graphs = graphs
    got = [o.token_ids for o in llm.generate(_prompts(2), GREEDY)]
    assert got == want
    assert set(graphs.tiers_run) == {16, 32, 96}  # contexts 6 .. 51 (prompts 5 .. 41, +10)
    assert 0 < graphs.tier_replays < graphs.num_replays
    # a step takes its rows' tier: the longest row decides
    seq = [HybridSeq(0, 31, 1, list(range(40)), [1, 2, 3], 0)]
    assert graphs.tier_for(seq) == 32
    assert graphs.tier_for([*seq, HybridSeq(1, 32, 1, list(range(40)), [4, 5, 6], 1)]) == 96
    assert graphs.tier_for([HybridSeq(0, 200, 1, [0] * 201, [1], 0)]) == 96  # its step says
    with pytest.raises(ValueError, match="max_seqlen_k = 16"):
        graphs.steps[1, 16].stage([HybridSeq(0, 16, 1, list(range(20)), [1, 2], 0)])


def _cache_tensors(family) -> list[torch.Tensor]:
    return [t for c in family.caches for t in (c.ring.cache, *(p.cache for p in c.pools.values()),
            *(x for pair in c.state.values() for x in pair))]  # fmt: skip


@torch.no_grad()
def _check_replays_against_eager(llm, graphs, prompts) -> list[int]:
    """Generate with every graph step checked: an eager step on copies of the caches first,
    then the replay on the real ones; logits equal (fp32, 1e-5). Returns the checked sizes."""
    runner = llm.engine.runner
    engine_family = runner.families[HYBRID]
    family = engine_family.family
    checked = []
    execute = runner.execute

    def checked_execute(step, device_input_ids=None):
        if not graphs.can_run(step):
            return execute(step, device_input_ids)
        saved = [t.clone() for t in _cache_tensors(family)]
        books = dict(family._cached_len), dict(family._owner)
        runner.graphs = engine_family.graphs = None
        try:
            eager = execute(step, device_input_ids)[0].clone()
        finally:
            runner.graphs = engine_family.graphs = graphs
        for t, s in zip(_cache_tensors(family), saved):
            t.copy_(s)
        family._cached_len, family._owner = books
        logits, inputs = execute(step, device_input_ids)
        torch.testing.assert_close(logits, eager, atol=1e-5, rtol=1e-5)
        checked.append(step.num_seqs)
        return logits, inputs

    runner.execute = checked_execute
    llm.generate(prompts, GREEDY)
    assert graphs.num_replays == len(checked) > 0
    assert len(set(checked)) > 1  # several batch sizes, padded buckets among them
    return checked


def test_replay_checker_on_cpu(tmp_path):
    """The GPU test's per-step check, with eager stand-ins for the graphs."""
    # (no prefix caching: its chunk cuts would leave no padded bucket in this schedule)
    llm = LLM(str(_saved(tmp_path, 1)), device="cpu", max_num_seqs=4, max_model_len=96,
              max_num_batched_tokens=16, enable_prefix_caching=False)  # fmt: skip
    runner = llm.engine.runner
    graphs = CpuGraphs(runner.model, runner.families[HYBRID].family, 4)
    graphs.capture_all()
    runner.graphs = runner.families[HYBRID].graphs = graphs
    checked = _check_replays_against_eager(llm, graphs, _prompts(1))
    assert set(checked) - set(graphs.buckets)


# ---------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_graph_replays_equal_eager_steps_on_gpu(tmp_path, seed):
    """Per decode step: the replayed graph's logits equal an eager step's (fp32, 1e-5)."""
    llm = LLM(str(_saved(tmp_path, seed)), device="cuda", dtype="float32", max_num_seqs=4,
              max_model_len=96, max_num_batched_tokens=16)  # fmt: skip
    graphs = llm.engine.runner.graphs
    assert isinstance(graphs, HybridDecodeGraphs), "capture failed (see stderr)"
    assert sorted(graphs.graphs) == [1, 2, 4]
    _check_replays_against_eager(llm, graphs, _prompts(seed))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["auto", "fp8"])
def test_llm_greedy_with_graphs_equals_without_on_gpu(tmp_path, kv_format):
    folder = _saved(tmp_path, 4)
    prompts = _prompts(4)
    outs = {}
    for graphs in (False, True):
        llm = LLM(str(folder), device="cuda", dtype="float32", max_num_seqs=4,
                  max_model_len=96, kv_format=kv_format, use_cuda_graph=graphs)  # fmt: skip
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        g = llm.engine.runner.graphs
        if graphs:
            assert isinstance(g, HybridDecodeGraphs) and g.num_replays > 0
        else:
            assert g is None
    assert outs[True] == outs[False]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_argmax_matches_argmax_after_replay_on_gpu(tmp_path, monkeypatch, dtype):
    """Greedy outputs with the argmax captured in the hybrid decode graphs (fused into the
    LM head: its size floors lifted for this tiny model) equal those of
    ``KVPLAN_GRAPH_ARGMAX=0``, async scheduling on (steps ahead fed by the graph's tokens);
    every greedy replay used the graph's tokens."""
    from kvplan.ops import small_gemm

    monkeypatch.setattr(small_gemm, "MIN_N", 1)
    monkeypatch.setattr(small_gemm, "MIN_WEIGHT", 1)
    folder = _saved(tmp_path, 5)
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KVPLAN_GRAPH_ARGMAX", flag)
        llm = LLM(str(folder), device="cuda", dtype=dtype, max_num_seqs=4, max_model_len=96)
        outs[flag] = [o.token_ids for o in llm.generate(_prompts(5), GREEDY)]
        core, graphs = llm.engine, llm.engine.runner.graphs
        assert isinstance(graphs, HybridDecodeGraphs) and graphs.num_replays > 0
        assert (graphs.tokens is None) == (flag == "0")
        assert core.num_graph_argmax_steps == (graphs.num_replays if flag == "1" else 0)
        assert graphs.num_replays_ahead > 0
    assert outs["1"] == outs["0"]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["auto", "fp8"])
def test_graph_context_tiers_replay_eager_steps_on_gpu(tmp_path, kv_format):
    """Captured graphs of three context tiers (16, 32 and max_model_len 96 tokens): every
    replayed step's logits equal an eager step's (fp32, 1e-5), every tier replays."""
    llm = LLM(str(_saved(tmp_path, 2)), device="cuda", dtype="float32", max_num_seqs=4,
              max_model_len=96, max_num_batched_tokens=16, kv_format=kv_format,
              enable_prefix_caching=False)  # fmt: skip
    runner = llm.engine.runner
    engine_family = runner.families[HYBRID]
    graphs = HybridDecodeGraphs.maybe_create(
        runner.model, engine_family.family, 4, context_bounds=(16, 32)
    )
    assert isinstance(graphs, HybridDecodeGraphs), "capture failed (see stderr)"
    assert graphs.tiers == [16, 32, 96] and len(graphs.tier_graphs) == 6
    runner.graphs = engine_family.graphs = graphs
    _check_replays_against_eager(llm, graphs, _prompts(2))
    assert 0 < graphs.tier_replays < graphs.num_replays
