"""CUDA-graph decode steps: bucket choice (CPU) and graph vs eager token equality (GPU)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from kvplan import LLM as _LLM
from kvplan import SamplingParams
from kvplan.engine.cuda_graphs import DecodeGraphs, bucket_for, context_tiers, decode_buckets
from kvplan.models.config import named_config

# CPU fp32 semantics (token equality with HF fp32) even where CUDA is present
LLM = partial(_LLM, device="cpu")


def test_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    b = decode_buckets(40)
    assert [bucket_for(n, b) for n in (1, 3, 9, 33, 40, 41)] == [1, 4, 16, 40, 40, None]
    with pytest.raises(ValueError):
        decode_buckets(0)


def test_cpu_engine_has_no_graphs():
    llm = LLM(named_config("tiny-llama"), max_model_len=64)
    assert llm.engine.runner.graphs is None


def _gpu_case(seed: int):
    """(config, 11 random prompts of 1-59 tokens, 24 greedy tokens each) of the GPU tests."""
    cfg = named_config("tiny-llama", head_dim_override=64, num_heads=4, num_kv_heads=2,
                       hidden_size=256)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 60, (11,), generator=g)]  # fmt: skip
    return cfg, prompts, SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["block_offsets"])
def test_graph_decode_matches_eager_on_gpu(backend):
    cfg, prompts, params = _gpu_case(0)
    outs = {}
    for graphs in (False, True):
        # fp32: padded buckets change GEMM shapes, which must not flip bf16 near-ties
        llm = LLM(cfg, device="cuda", dtype="float32", backend=backend, max_num_seqs=16,
                  max_model_len=128, use_cuda_graph=graphs, num_blocks=200)  # fmt: skip
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        if graphs:
            assert llm.engine.runner.graphs is not None
            assert llm.engine.runner.graphs.num_replays > 0
    assert outs[True] == outs[False]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_argmax_matches_argmax_after_replay_on_gpu(monkeypatch, dtype):
    """Greedy outputs with the argmax captured in the decode graphs (and fused into the LM
    head where `small_linear` runs its kernel) equal those of ``KVPLAN_GRAPH_ARGMAX=0``
    (argmax after the replay) and of eager steps, async scheduling on; every greedy replay
    used the graph's tokens. The LM head's size floors are lifted so that this tiny bf16
    model's head runs the Triton kernel with the fused argmax."""
    from kvplan.ops import small_gemm

    monkeypatch.setattr(small_gemm, "MIN_N", 1)
    monkeypatch.setattr(small_gemm, "MIN_WEIGHT", 1)
    cfg, prompts, params = _gpu_case(1)
    outs = {}
    for name, flag, graphs in (("fused", "1", True), ("after", "0", True), ("eager", "1", False)):
        monkeypatch.setenv("KVPLAN_GRAPH_ARGMAX", flag)
        llm = LLM(cfg, device="cuda", dtype=dtype, backend="block_offsets", max_num_seqs=16,
                  max_model_len=128, use_cuda_graph=graphs, num_blocks=200)  # fmt: skip
        assert llm.engine.async_scheduling
        outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
        core, dg = llm.engine, llm.engine.runner.graphs
        if graphs:
            assert dg is not None and dg.num_replays > 0
            assert (dg.tokens is None) == (flag == "0")
            want = dg.num_replays if flag == "1" else 0
            assert core.num_graph_argmax_steps == want
            assert core.num_steps_ahead > 0
    assert outs["fused"] == outs["after"]
    if dtype == "float32":  # bf16 buckets change GEMM shapes: near ties may flip vs eager
        assert outs["fused"] == outs["eager"]


class _EagerReplay:
    """Stand-in for a captured graph on CPU.

    A real graph replays the kernels with the host values of capture time and the current
    contents of the device buffers. The stand-in does the same in eager mode: it swaps the
    metadata's capture-time host values (everything but tensors) back in, re-runs the step
    into the captured logits buffer, then restores the live host values.
    """

    def __init__(self, graphs, b):
        self.graphs, self.b = graphs, b
        self.out = graphs.logits[b]  # the buffer this capture returned
        md = graphs.metadata
        self.host = {k: v for k, v in vars(md).items() if not isinstance(v, torch.Tensor)}

    def replay(self):
        md = self.graphs.metadata
        live = dict(vars(md))
        vars(md).update(self.host)
        try:
            with torch.inference_mode():
                self.out.copy_(self.graphs._forward(self.b))
        finally:
            vars(md).clear()
            vars(md).update(live)


class _CpuGraphs(DecodeGraphs):
    def _capture(self, b, pool):
        self.logits[b] = self._forward(b)
        return _EagerReplay(self, b)

    def greedy_tokens(self, n):
        """A copy: on CUDA the engine's host copy of the tokens is queued before the next
        replay rewrites the buffer; on the CPU that "copy" is the tensor itself."""
        tokens = super().greedy_tokens(n)
        return None if tokens is None else tokens.clone()


def test_padded_bucket_steps_match_unpadded_on_cpu():
    """CPU counterpart of the GPU test: capture dummies, padding rows (block 0, kv_len 1,
    slot -1) and in-place metadata give the same tokens as plain eager decode steps."""
    CpuGraphs = _CpuGraphs
    cfg = named_config("tiny-llama")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 30, (7,), generator=g)]  # fmt: skip
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = LLM(cfg, backend="block_offsets", block_size=4, max_num_seqs=8, max_model_len=64)
    want = [o.token_ids for o in plain.generate(prompts, params)]

    llm = LLM(cfg, backend="block_offsets", block_size=4, max_num_seqs=8, max_model_len=64)
    parts = llm.parts
    graphs = CpuGraphs(parts.model, parts.metadata, parts.manager, 8, 64)
    graphs.capture_all()
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    assert parts.manager.num_free_blocks() == parts.num_blocks - 1  # dummies freed
    llm.engine.runner.graphs = graphs
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert graphs.num_replays > 0
    # every replayed step was greedy: its tokens were the graph's (the stand-in's) argmax
    assert llm.engine.num_graph_argmax_steps == graphs.num_replays
    assert got == want


def test_graph_argmax_switch_on_cpu(monkeypatch):
    """``KVPLAN_GRAPH_ARGMAX=0``: the graphs capture no argmax (``tokens`` None) and greedy
    steps take `argmax_rows` after the replay, with the same tokens; sampled steps never use
    the graph's tokens; a bad value names the variable."""
    cfg = named_config("tiny-llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist()
               for n in (4, 11, 7)]  # fmt: skip
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    kw = dict(backend="block_offsets", block_size=4, max_num_seqs=4, max_model_len=64)
    outs, used = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KVPLAN_GRAPH_ARGMAX", flag)
        llm = LLM(cfg, **kw)
        parts = llm.parts
        graphs = _CpuGraphs(parts.model, parts.metadata, parts.manager, 4, 64)
        assert (graphs.tokens is None) == (flag == "0")
        graphs.capture_all()
        llm.engine.runner.graphs = graphs
        outs[flag] = [o.token_ids for o in llm.generate(prompts, greedy)]
        used[flag] = llm.engine.num_graph_argmax_steps
        assert graphs.num_replays > 0
        sampled = SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True)
        llm.generate(prompts, sampled)
        assert llm.engine.num_graph_argmax_steps == used[flag]
    assert outs["1"] == outs["0"] and used["1"] > 0 and used["0"] == 0
    monkeypatch.setenv("KVPLAN_GRAPH_ARGMAX", "yes")
    with pytest.raises(ValueError, match="KVPLAN_GRAPH_ARGMAX must be 0 or 1, got 'yes'"):
        _CpuGraphs(parts.model, parts.metadata, parts.manager, 4, 64)


def test_graphs_with_an_exact_window_match_eager_on_cpu():
    """``kv_exact_window``: the capture dummies take ring slots and give them back; replays
    read the ring's persistent buffers (padding rows of a bucket: no ring key, the trash row)
    and give the eager tokens."""
    from tests.engine.test_quantized_kv_engine import CFG

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, CFG.vocab_size, (int(n),), generator=g).tolist()
               for n in (3, 17, 9, 25, 6)]  # fmt: skip
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    kw = dict(backend="block_offsets", block_size=4, max_num_seqs=8, max_model_len=64,
              kv_format="fp8", kv_exact_window=6)  # fmt: skip
    want = [o.token_ids for o in LLM(CFG, **kw).generate(prompts, params)]
    llm = LLM(CFG, **kw)
    parts = llm.parts
    recent = llm.engine.runner.families["paged"].recent
    graphs = _CpuGraphs(parts.model, parts.metadata, parts.manager, 8, 64, (), recent)
    graphs.capture_all()
    assert len(recent._free) == 8 and parts.manager.num_free_blocks() == parts.num_blocks - 1
    llm.engine.runner.graphs = graphs
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert graphs.num_replays > 0
    assert got == want


def test_a_failed_capture_frees_its_dummies():
    """Too few blocks for the largest bucket's dummies: the capture fails, and every block
    and ring slot the dummies took is free again (the engine then runs eager steps)."""
    from tests.engine.test_quantized_kv_engine import CFG

    llm = LLM(CFG, backend="block_offsets", block_size=4, max_num_seqs=8, max_model_len=16,
              num_blocks=6, kv_format="fp8", kv_exact_window=4)  # fmt: skip
    parts = llm.parts
    recent = llm.engine.runner.families["paged"].recent
    graphs = _CpuGraphs(parts.model, parts.metadata, parts.manager, 8, 16, (), recent)
    with pytest.raises(RuntimeError, match="no free blocks for 8 capture dummies"):
        graphs.capture_all()
    assert parts.manager.num_free_blocks() == parts.num_blocks - 1
    assert len(recent._free) == 8


def test_context_bounds_follow_the_decode_launch_rule(monkeypatch):
    """The builder's tiers: fp8, int8 and fp4 caches get their two-heads bound
    (`DECODE_HEADS_AUTO`), float caches none, and none when ``KVPLAN_DECODE_HEADS`` fixes the count."""
    import kvplan.ops._paged_attention_kernels as pak
    from kvplan.engine.cuda_graphs import kv_format_context_bounds

    monkeypatch.setattr(pak, "DECODE_HEADS", None)
    assert kv_format_context_bounds("fp8") == (pak.DECODE_HEADS_AUTO["e4m3"][1],) == (4096,)
    assert [kv_format_context_bounds(f) for f in ("bf16", "fp32")] == [()] * 2
    assert kv_format_context_bounds("int8") == (4096,)
    assert kv_format_context_bounds("fp4") == (pak.DECODE_HEADS_AUTO["e2m1_f16"][1],) == (1024,)
    assert context_tiers(kv_format_context_bounds("fp8"), 8480) == [4096, 8480]
    assert context_tiers(kv_format_context_bounds("fp8"), 416) == [416]
    # fp4 pages launch under "e2m1_f16" (fp16 tiles) or "e2m1": either key's bound counts
    monkeypatch.setattr(pak, "DECODE_HEADS_AUTO", {"e4m3": (2, 4096), "e2m1_f16": (2, 2048)})
    assert kv_format_context_bounds("fp4") == (2048,)
    monkeypatch.setattr(pak, "DECODE_HEADS_AUTO", {"e2m1": (2, 1024), "e2m1_f16": (2, 2048)})
    assert kv_format_context_bounds("fp4") == (1024, 2048)
    monkeypatch.setattr(pak, "DECODE_HEADS", 2)
    assert kv_format_context_bounds("fp8") == kv_format_context_bounds("fp4") == ()


def test_context_tiers_replay_the_shortest_graph_that_holds_the_step_on_cpu():
    """With context bounds (fp8 pages: where the decode launch changes) every bucket is also
    captured for each bound below ``max_model_len``, its launch planned for that bound; a step
    replays the smallest tier holding its longest row, and the tokens stay the eager ones."""
    assert context_tiers((16, 99, 0), 64) == [16, 64]
    cfg = named_config("tiny-llama")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist()
               for n in (3, 9, 5, 12)]  # fmt: skip
    params = SamplingParams(max_tokens=14, ignore_eos=True)  # rows cross 16 keys mid-decode
    kw = dict(backend="block_offsets", block_size=4, max_num_seqs=4, max_model_len=64)
    want = [o.token_ids for o in LLM(cfg, **kw).generate(prompts, params)]
    llm = LLM(cfg, **kw)
    parts = llm.parts
    graphs = _CpuGraphs(parts.model, parts.metadata, parts.manager, 4, 64, (16,))
    graphs.capture_all()
    assert sorted(graphs.graphs) == [1, 2, 4]
    assert sorted(graphs.tier_graphs) == [(1, 16), (2, 16), (4, 16)]
    for b in (1, 2, 4):  # each planned for its own bound
        assert set(graphs.tier_graphs[b, 16].host["kv_lens_np"]) == {16}
        assert set(graphs.graphs[b].host["kv_lens_np"]) == {64}
        assert graphs.tier_logits[b, 16] is not graphs.logits[b]
    assert parts.manager.num_free_blocks() == parts.num_blocks - 1  # dummies freed
    llm.engine.runner.graphs = graphs
    graphs.replay_events = []  # a stamp pair around each replay (bench_engine's replay time)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert 0 < graphs.tier_replays < graphs.num_replays
    assert got == want
    events = graphs.replay_events
    assert len(events) == graphs.num_replays
    full = graphs.replay_device_ms(4)  # the steps of all four rows
    assert full and all(ms >= 0 for ms in full)
    assert len(full) == sum(n == 4 for n, *_ in events) and all(
        b == 4 for n, b, *_ in events if n == 4
    )


def test_capture_pauses_the_garbage_collector(monkeypatch):
    """`capture_graph` runs the captured forward with Python's cyclic collector off (a
    collection inside a capture can free another engine's graph, whose reset invalidates the
    capture) and leaves it as it found it, also when the forward raises (CPU stand-ins for
    torch's graph and capture context)."""
    import contextlib
    import gc

    from kvplan.engine import cuda_graphs as cg

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    seen = []

    def forward():
        seen.append(gc.isenabled())
        return torch.zeros(2)

    was_on = gc.isenabled()
    try:
        gc.enable()
        graph, out = cg.capture_graph(forward, None)
        assert graph == "graph" and out.shape == (2,)
        assert seen == [False] and gc.isenabled()

        def fails():
            raise RuntimeError("capture failed")

        with pytest.raises(RuntimeError, match="capture failed"):
            cg.capture_graph(fails, None)
        assert gc.isenabled()
        gc.disable()  # a caller that runs without the collector keeps it off
        cg.capture_graph(forward, None)
        assert seen == [False, False] and not gc.isenabled()
    finally:
        gc.enable() if was_on else gc.disable()
