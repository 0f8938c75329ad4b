"""DeepSeek-V4 through the engine: `kvplan.LLM` on a folder HF's ``save_pretrained`` wrote
serves it on the hybrid family (planned by `kvplan.plan`), with continuous batching, chunked
prefill and preemption; greedy tokens equal HF's ``generate`` for each prompt alone."""

from __future__ import annotations

import json

import pytest
import torch

from kvplan import LLM, SamplingParams
from kvplan.engine.hybrid import HYBRID, HybridCausalLM, hybrid_block_size
from tests.models.dsv4_testlib import hf_config, hf_greedy, hf_model, random_tokens

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _saved(tmp_path, seed: int):
    hf = hf_model(hf_config(seed), seed)
    folder = tmp_path / f"dsv4_{seed}"
    hf.save_pretrained(folder)
    return hf, folder


@pytest.mark.parametrize("seed", [0, 1])
def test_llm_greedy_equals_hf_with_chunked_prefill_and_batching(tmp_path, seed):
    hf, folder = _saved(tmp_path, seed)
    prompts = [random_tokens(seed * 10 + i, n) for i, n in enumerate((29, 9, 41))]
    llm = LLM(str(folder), device="cpu", max_num_batched_tokens=12, max_num_seqs=3,
              max_model_len=96)  # fmt: skip
    assert isinstance(llm.parts.model, HybridCausalLM)
    assert set(llm.parts.model.layer_families) == {HYBRID}
    outs = llm.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)
    m = llm.parts.manager
    assert m.num_requests == 0
    assert m.num_free_blocks() == llm.parts.num_blocks - 1  # block 0 is reserved


def test_llm_repetition_penalty_and_bias_equal_hf(tmp_path):
    """The hybrid family's steps take the shared sampler: a repetition penalty and a logit
    bias give HF ``generate``'s tokens with ``repetition_penalty`` / ``sequence_bias``."""
    hf, folder = _saved(tmp_path, 4)
    prompts = [random_tokens(40 + i, n) for i, n in enumerate((17, 33))]
    llm = LLM(str(folder), device="cpu", max_num_batched_tokens=12, max_model_len=64)
    bias = {3: -100.0, 5: 4.0}
    params = SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.6,
                            logit_bias=bias)  # fmt: skip
    outs = llm.generate(prompts, params)
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p])
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                               min_new_tokens=10, do_sample=False, repetition_penalty=1.6,
                               sequence_bias={(t,): b for t, b in bias.items()})  # fmt: skip
            assert o.token_ids == want[0, len(p) :].tolist()
            assert 3 not in o.token_ids
    plain = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in plain] != [o.token_ids for o in outs]  # the test can fail


def test_llm_preemption_recomputes_and_frees_everything(tmp_path):
    hf, folder = _saved(tmp_path, 2)
    prompts = [random_tokens(20 + i, 30) for i in range(4)]
    # room for two sequences' blocks at a time: the others wait or are preempted
    llm = LLM(str(folder), device="cpu", max_num_seqs=4, max_model_len=48, block_size=16,
              num_blocks=8)  # fmt: skip
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, params.max_tokens)
    assert llm.parts.core.scheduler.num_preemptions > 0
    assert llm.parts.manager.num_free_blocks() == 7


def _cache_tensor_bytes(llm) -> int:
    """Bytes of the hybrid family's cache tensors and its snapshot store, measured, less the
    one trash row of each compressor-state tensor."""
    fam = llm.engine.runner.families[HYBRID]
    total = 0
    for layer in fam.family.caches:
        total += layer.ring.cache.untyped_storage().nbytes()
        total += sum(p.cache.untyped_storage().nbytes() for p in layer.pools.values())
        total += sum(t[:-1].nbytes for kv_gate in layer.state.values() for t in kv_gate)
    if fam.snapshots is not None:
        total += fam.snapshots.capacity * fam.snapshots.nbytes_per_snapshot
    return total


@pytest.mark.parametrize("kv_format", ["auto", "fp8"])
def test_kv_cache_memory_sizes_the_pools_and_preemption_keeps_outputs_exact(tmp_path, kv_format):
    """``kv_cache_memory`` bounds every cache the engine allocates (pools, state slots,
    prefix-cache snapshots): the blocks are the most that fit. A budget that holds fewer
    than ``max_num_seqs`` full sequences makes requests wait or be preempted, with outputs
    unchanged; one that holds no sequence is refused, naming the setting."""
    hf, folder = _saved(tmp_path, 2)
    kw = dict(device="cpu", max_num_seqs=4, max_model_len=48, block_size=16, kv_format=kv_format)
    roomy = LLM(str(folder), **kw)
    assert roomy.parts.num_blocks == 4 * 3 + 1  # capped at max_num_seqs full sequences
    one_block = (_cache_tensor_bytes(LLM(str(folder), num_blocks=5, **kw))
                 - _cache_tensor_bytes(LLM(str(folder), num_blocks=4, **kw)))  # fmt: skip
    budget = _cache_tensor_bytes(LLM(str(folder), num_blocks=8, **kw)) + one_block - 1
    llm = LLM(str(folder), kv_cache_memory=budget, **kw)
    assert llm.parts.num_blocks == 8  # a ninth block would exceed the budget by one byte
    assert _cache_tensor_bytes(llm) <= budget
    prompts = [random_tokens(20 + i, 30) for i in range(4)]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    ref = roomy.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    if kv_format == "auto":
        for p, o in zip(prompts, outs):
            assert o.token_ids == hf_greedy(hf, p, params.max_tokens)
    assert llm.parts.core.scheduler.num_preemptions > 0
    with pytest.raises(ValueError, match=r"kv_cache_memory=\d+ bytes cannot hold one sequence"):
        LLM(str(folder), kv_cache_memory=budget // 4, **kw)


@pytest.mark.parametrize("kv_format", ["fp8", "fp4"])
def test_llm_quantized_kv_runs_and_agrees_mostly(tmp_path, kv_format):
    _, folder = _saved(tmp_path, 3)
    prompts = [random_tokens(30 + i, 25) for i in range(2)]
    exact_llm = LLM(str(folder), device="cpu", max_model_len=64)
    quant_llm = LLM(str(folder), device="cpu", max_model_len=64, kv_format=kv_format)
    exact = exact_llm.generate(prompts, GREEDY)
    quant = quant_llm.generate(prompts, GREEDY)
    for e, q in zip(exact, quant):
        assert len(q.token_ids) == GREEDY.max_tokens
        assert q.token_ids[0] == e.token_ids[0]  # the first token is robust to the rounding
    # contexts shorter than the CSA ratio: the first decode steps load no compressed entry
    # and no index key (a zero-row load of the quantized index cache)
    short = [random_tokens(40, 1), random_tokens(41, 2)]
    for e, q in zip(exact_llm.generate(short, GREEDY), quant_llm.generate(short, GREEDY)):
        assert len(q.token_ids) == GREEDY.max_tokens
        assert q.token_ids[0] == e.token_ids[0]


def test_unsupported_settings_and_architectures_name_the_problem(tmp_path):
    _, folder = _saved(tmp_path, 0)
    with pytest.raises(ValueError, match="num_speculative_tokens=8: .* at most 7 drafts"):
        LLM(str(folder), device="cpu", num_speculative_tokens=8)  # CSA ratio 4: 8 state rows
    with pytest.raises(ValueError, match="kv_format"):
        LLM(str(folder), device="cpu", kv_format="fp16")  # the model runs in fp32
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        LLM(str(other))
    with pytest.raises(ValueError, match="kv_format='fp8' needs head_dim % 32"):
        LLM("random:tiny-llama", kv_format="fp8")  # dense models: whole scale groups per head


def test_cli_generate_serves_the_folder(tmp_path, capsys):
    from kvplan.cli import main

    hf, folder = _saved(tmp_path, 1)
    prompt = random_tokens(5, 21)
    argv = ["generate", "--model", str(folder), "--device", "cpu", "--max-tokens", "6"]
    assert main([*argv, "--token-ids", ",".join(map(str, prompt))]) == 0
    got = [int(t) for t in capsys.readouterr().out.split()]
    assert got == hf_greedy(hf, prompt, 6)
    assert main([*argv, "hello"]) == 2  # no tokenizer in the folder: one clear line
    assert "--token-ids" in capsys.readouterr().err
    assert main([*argv, "--token-ids", "1, x"]) == 2
    assert "'x' is not an integer" in capsys.readouterr().err


def test_block_size_is_rounded_to_every_ratio():
    assert hybrid_block_size(16, [4, 16]) == 16
    assert hybrid_block_size(16, [4, 128]) == 128
    assert hybrid_block_size(130, [4, 8]) == 136
    assert hybrid_block_size(5, []) == 5


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_llm_cuda_fp32_greedy_equals_hf(tmp_path, seed):
    """On CUDA in fp32: Triton store / load / index kernels, ``prepare_decode_on_device``
    and the in-place sparse attention; greedy tokens equal HF's (run on the CPU)."""
    hf, folder = _saved(tmp_path, seed)
    prompts = [random_tokens(seed * 10 + i, n) for i, n in enumerate((29, 9, 41))]
    llm = LLM(str(folder), device="cuda", dtype="float32", max_num_batched_tokens=12,
              max_num_seqs=3, max_model_len=96)  # fmt: skip
    assert llm.parts.model.model.embed_tokens.weight.is_cuda
    for p, o in zip(prompts, llm.generate(prompts, GREEDY)):
        assert o.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)
    assert llm.parts.manager.num_free_blocks() == llm.parts.num_blocks - 1


@pytest.mark.gpu
def test_llm_cuda_fp32_split_o_proj_equals_hf(tmp_path, monkeypatch):
    """``KVPLAN_DSV4_O_SPLITS=2`` (the split rule's size limits lowered to this tiny model):
    the attention blocks return ``o_b_proj`` as split-K partials in eager and graph-captured
    steps, the residual updates add them, and greedy tokens still equal HF's."""
    import kvplan.models.deepseek_v4.attention as attn
    import kvplan.ops.split_linear as sl

    monkeypatch.setenv("KVPLAN_DSV4_O_SPLITS", "2")
    monkeypatch.setattr(sl, "SPLIT_LINEAR_MIN_WEIGHT", 0)
    monkeypatch.setattr(sl, "SPLIT_LINEAR_ROWS", (1, 128))
    calls = []
    monkeypatch.setattr(attn, "split_linear", lambda *a: calls.append(a[2]) or sl.split_linear(*a))
    hf, folder = _saved(tmp_path, 0)
    prompts = [random_tokens(i, n) for i, n in enumerate((29, 9, 41))]
    llm = LLM(str(folder), device="cuda", dtype="float32", max_num_seqs=3, max_model_len=96)
    for p, o in zip(prompts, llm.generate(prompts, GREEDY)):
        assert o.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)
    assert calls and set(calls) == {2}


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["fp8", "fp4"])
def test_llm_cuda_quantized_kv_matches_cpu(tmp_path, kv_format):
    """The quantized caches give the same tokens on CUDA as on the CPU (bit-exact stores),
    also for prompts shorter than the CSA ratio (decode steps that first see no compressed
    entry), with CUDA graphs and without."""
    _, folder = _saved(tmp_path, 3)
    batches = [[random_tokens(30 + i, 25) for i in range(2)], [random_tokens(40, 1), [7, 3]]]
    cpu = LLM(str(folder), device="cpu", max_model_len=64, kv_format=kv_format)
    want = [[o.token_ids for o in cpu.generate(b, GREEDY)] for b in batches]
    for graphs in (True, False):
        gpu = LLM(str(folder), max_model_len=64, kv_format=kv_format, device="cuda",
                  dtype="float32", use_cuda_graph=graphs)  # fmt: skip
        assert [[o.token_ids for o in gpu.generate(b, GREEDY)] for b in batches] == want


def test_llm_with_four_decode_warps_and_topk_register_forms_equals_hf(tmp_path, monkeypatch):
    """An fp32 engine on the Triton kernels (interpreter; 4 residual streams) with
    ``hc_pre_kernel``'s decode launches at four warps (``KVPLAN_HC_PRE_WARPS=4``) and the
    indexer's top-k as the one-stage in-register search with a tail, writing from its
    registers (``KVPLAN_TOPK_ROW_TAIL=1``, ``KVPLAN_TOPK_REG_WRITE=1``; the plan forced to it:
    the interpreter has no SM count). The top-k takes that form, and the greedy tokens equal
    Hugging Face's."""
    import kvplan.ops.hyper_connection as hcm
    import kvplan.ops.topk as tk

    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    monkeypatch.setattr(hcm, "PRE_DECODE_WARPS", 4)
    monkeypatch.setattr(tk, "ROW_TAIL", True)
    monkeypatch.setattr(tk, "REG_WRITE", True)
    monkeypatch.setattr(tk, "topk_plan", lambda *a: (True, 0, False))
    launches = []
    launch = tk._launch
    monkeypatch.setattr(tk, "_launch", lambda *a, **kw: launches.append(kw) or launch(*a, **kw))
    folder = tmp_path / "dsv4_hc4"
    hf = hf_model(hf_config(1, hc_mult=4, hc_sinkhorn_iters=3), 1)
    hf.save_pretrained(folder)
    prompts = [random_tokens(60 + i, n) for i, n in enumerate((17, 11))]
    llm = LLM(str(folder), device="cpu", max_model_len=64)
    outs = llm.generate(prompts, GREEDY)
    assert launches and all(kw["row"][0] > 0 and kw["reg_write"] for kw in launches)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)


@pytest.mark.parametrize("nib", [False, True])
def test_llm_bf16_fp4_records_on_f16_tiles(tmp_path, monkeypatch, nib):
    """A bf16 DeepSeek-V4 engine on the Triton kernels (interpreter) over fp4 records read as
    fp16 tiles (``FP4_F16_TILES``; in nibble order with ``FP4_NIBBLE_TILES``): its decode
    steps' sparse attention takes them, and the greedy tokens equal those of the bf16 tiles
    (the same key values; the probabilities round to fp16)."""
    import kvplan.ops.sparse_attention as sa

    monkeypatch.setenv("KVPLAN_FORCE_TRITON", "1")
    monkeypatch.setattr(sa, "FP4_NIBBLE_TILES", nib)
    taken = []
    real = sa.f16_tiles
    monkeypatch.setattr(sa, "f16_tiles", lambda *a: taken.append(real(*a)) or taken[-1])
    folder = tmp_path / "dsv4_d64"  # 64-wide heads: 36-byte records, word-aligned runs
    # 3 Sinkhorn iterations (not the seed's 20): the interpreter's hc kernels took a third of
    # the test's time, and the attention's tiles are its subject
    cfg = hf_config(3, head_dim=64, index_head_dim=32, hc_sinkhorn_iters=3)
    hf_model(cfg, 3).save_pretrained(folder)
    prompts = [random_tokens(40 + i, 13) for i in range(2)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(sa, "FP4_F16_TILES", on)
        llm = LLM(str(folder), device="cpu", dtype="bfloat16", max_model_len=64, kv_format="fp4")
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        # the decode steps' records (prompts read bf16 rows)
        assert set(taken) == ({0, 2 if nib else 1} if on else {0})
        taken.clear()
    assert outs[0] == outs[1]
