"""Async scheduling for DeepSeek-V4 (hybrid family): decode steps launched one step ahead,
planned with placeholder input tokens and fed the previous step's device tokens.

Two engines (async on / off) get the same requests; greedy tokens and finish reasons must
be equal and every block freed. CPU: eager steps ahead, and the graph path with eager
stand-ins for the captured graphs (`test_hybrid_graphs.CpuGraphs`). GPU: real graphs.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_hybrid_graphs import CpuGraphs, _check_replays_against_eager, _prompts

from kvplan import LLM, SamplingParams
from kvplan.backends.hybrid.api import HybridSeq
from kvplan.backends.hybrid.static_step import StaticDecodeBuffers, StaticDecodeStep
from kvplan.engine.hybrid import HYBRID, PENDING_TOKEN, PendingTokenIds
from kvplan.engine.hybrid_graphs import HybridDecodeGraphs
from kvplan.engine.request import TokenIds
from kvplan.models.deepseek_v4 import DeepseekV4Config
from tests.models.dsv4_testlib import hf_config, hf_model, random_tokens

MAX_SEQS = 5


def _saved(tmp_path, seed: int):
    folder = tmp_path / f"dsv4_{seed}"
    hf_model(hf_config(seed), seed).save_pretrained(folder)
    return folder


def _workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of varied lengths; greedy params, some with stop ids (rows finish while a
    step runs ahead of them: discarded rows), the others ending at max_tokens."""
    rng = random.Random(seed)
    prompts = [random_tokens(seed * 10 + i, rng.randint(3, 30)) for i in range(7)]
    params = [
        SamplingParams(
            max_tokens=rng.randint(10, 30),
            temperature=0.0,
            ignore_eos=True,
            stop_token_ids=rng.sample(range(96), rng.choice([0, 12])),
        )
        for _ in prompts
    ]
    return prompts, params


def _generate(llm: LLM, prompts, params) -> list[tuple[list[int], str]]:
    outs = llm.generate(prompts, params)
    m = llm.parts.manager
    assert m.num_requests == 0 and m.num_free_blocks() == llm.parts.num_blocks - 1
    return [(o.token_ids, o.finish_reason) for o in outs]


def _cpu_graphs(llm: LLM) -> CpuGraphs:
    runner = llm.engine.runner
    family = runner.families[HYBRID]
    graphs = CpuGraphs(runner.model, family.family, llm.engine.scheduler.max_num_seqs)
    graphs.capture_all()
    runner.graphs = family.graphs = graphs
    return graphs


@pytest.mark.parametrize(("seed", "graphs"), [(0, False), (1, True), (3, True)])
def test_async_equals_sync_on_cpu(tmp_path, seed, graphs):
    folder = _saved(tmp_path, seed)
    prompts, params = _workload(seed)
    kw = dict(device="cpu", max_num_seqs=MAX_SEQS, max_model_len=96, max_num_batched_tokens=24)
    sync = LLM(str(folder), async_scheduling=False, **kw)
    llm = LLM(str(folder), async_scheduling=True, **kw)
    assert llm.engine.async_scheduling and not sync.engine.async_scheduling
    g = _cpu_graphs(llm) if graphs else None
    want = _generate(sync, prompts, params)
    got = _generate(llm, prompts, params)
    assert got == want
    assert {r for _, r in want} == {"stop", "length"}
    core = llm.engine
    assert sync.engine.num_steps_ahead == 0
    assert core.num_steps_ahead > 10 and core.num_discarded_rows > 0
    if g is not None:  # steps ahead replayed the graphs, padded buckets among them
        assert g.num_replays_ahead > 10 and g.num_replays > g.num_replays_ahead
        assert set(g.rows) - set(g.buckets)


def test_replays_ahead_equal_eager_steps_ahead_on_cpu(tmp_path):
    """test_hybrid_graphs' per-step check (each replay against an eager step on copies of
    the caches) with async scheduling: steps ahead, fed device tokens, in both."""
    llm = LLM(str(_saved(tmp_path, 2)), device="cpu", max_num_seqs=4, max_model_len=96,
              max_num_batched_tokens=16, async_scheduling=True)  # fmt: skip
    graphs = _cpu_graphs(llm)
    _check_replays_against_eager(llm, graphs, _prompts(2))
    assert graphs.num_replays_ahead > 5 and llm.engine.num_steps_ahead >= graphs.num_replays_ahead


def test_default_is_off_on_cpu(tmp_path):
    llm = LLM(str(_saved(tmp_path, 0)), device="cpu", max_model_len=64)
    assert llm.engine.async_scheduling is False


def test_pending_token_ids():
    prompt, output = [5, 6, 7], [8]
    ids = PendingTokenIds(TokenIds(prompt, output))
    output.append(9)  # appended after the view was taken: not seen
    assert len(ids) == 5 and list(ids) == [5, 6, 7, 8, PENDING_TOKEN]
    assert ids[-1] == PENDING_TOKEN and ids[3] == 8 and ids[-5] == 5
    assert ids[:5] is ids and list(ids[:2]) == [5, 6] and list(ids[:4]) == [5, 6, 7, 8]
    assert ids[2:] == [7, 8, PENDING_TOKEN] and ids[::2] == [5, 7, PENDING_TOKEN]
    for bad in (5, -6):
        with pytest.raises(IndexError, match="outside"):
            ids[bad]


def test_staging_slots_alternate_and_pending_tokens_need_device_ids():
    """Each stage() fills the other staging slot; a step staged ahead stages placeholders
    and refuses to replay without device tokens."""
    cfg = DeepseekV4Config.from_hf(hf_config(0))
    from test_hybrid_graphs import _family

    fam = _family(cfg, 2, "exact")
    buffers = StaticDecodeBuffers(fam, 2)
    step = StaticDecodeStep(fam, 2, buffers)
    seqs = [HybridSeq(i, 3, 1, PendingTokenIds(TokenIds([1 + i, 2, 3], [])), [1 + i], i)
            for i in range(2)]  # fmt: skip
    slots = []
    for _ in range(3):
        slots.append(buffers.host().ctypes.data)
        step.stage(seqs)
    assert slots[0] == slots[2] != slots[1]
    assert buffers.inputs[0, :2].tolist() == [PENDING_TOKEN] * 2
    assert buffers.inputs[1, :2].tolist() == [3, 3]

    class Inputs:  # what run() reads of the runner's StepInputs
        input_ids = torch.zeros(2, dtype=torch.int64)

    graphs = HybridDecodeGraphs.__new__(HybridDecodeGraphs)
    graphs.max_model_len = step.max_seqlen_k
    graphs.buckets, graphs.steps, graphs._ahead = [2], {(2, step.max_seqlen_k): step}, {2: True}
    graphs._tier = {}
    graphs.num_replays = graphs.num_replays_ahead = 0
    graphs.graphs, graphs.logits = {2: None}, {2: torch.zeros(2, 3)}
    with pytest.raises(RuntimeError, match="device_input_ids"):
        graphs.run(Inputs())

    class Replay:
        def replay(self):
            graphs.logits[2].copy_(buffers.inputs[0, :2, None].float().expand(2, 3))

    graphs.graphs[2] = Replay()
    out = graphs.run(Inputs(), torch.tensor([11, 12]))
    assert out[:, 0].tolist() == [11.0, 12.0] and graphs.num_replays_ahead == 1


# ---------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_async_equals_sync_with_graphs_on_gpu(tmp_path, seed):
    """fp32 on CUDA with captured graphs: async on equals off; steps ran ahead as replays."""
    folder = _saved(tmp_path, seed)
    prompts, params = _workload(seed)
    outs, cores = {}, {}
    for on in (False, True):
        llm = LLM(str(folder), device="cuda", dtype="float32", max_num_seqs=MAX_SEQS,
                  max_model_len=96, max_num_batched_tokens=24, async_scheduling=on)  # fmt: skip
        assert llm.engine.async_scheduling is on
        outs[on] = _generate(llm, prompts, params)
        cores[on] = llm.engine
    assert outs[True] == outs[False]
    g = cores[True].runner.graphs
    assert isinstance(g, HybridDecodeGraphs), "capture failed (see stderr)"
    assert cores[True].num_steps_ahead > 10 and cores[True].num_discarded_rows > 0
    assert g.num_replays_ahead > 10
    assert cores[False].num_steps_ahead == 0 and cores[False].runner.graphs.num_replays_ahead == 0


@pytest.mark.gpu
def test_async_eager_steps_on_gpu(tmp_path):
    """Without graphs (eager steps planned ahead on CUDA) async on equals off."""
    folder = _saved(tmp_path, 2)
    prompts, params = _workload(2)
    outs = {}
    for on in (False, True):
        llm = LLM(str(folder), device="cuda", dtype="float32", max_num_seqs=MAX_SEQS,
                  max_model_len=96, use_cuda_graph=False, async_scheduling=on)  # fmt: skip
        outs[on] = _generate(llm, prompts, params)
        assert llm.engine.runner.graphs is None
        assert (llm.engine.num_steps_ahead > 10) is on
    assert outs[True] == outs[False]


@pytest.mark.gpu
def test_async_is_the_cuda_default(tmp_path):
    llm = LLM(str(_saved(tmp_path, 0)), device="cuda", dtype="float32", max_model_len=64)
    assert llm.engine.async_scheduling is True
