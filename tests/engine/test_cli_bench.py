"""``kvplan.engine.cli_bench``: the Triton compile recorder that benchmark timings report
(compiles inside a timed run make it slower than the steady state) and ``run_workload``'s
result on a tiny CPU model."""

from __future__ import annotations

import pytest
import torch

from kvplan.engine.cli_bench import make_prompts, run_workload, triton_compiles
from kvplan.models.config import named_config

knobs = pytest.importorskip("triton").knobs


def test_recorder_chains_and_restores_the_previous_hook():
    seen = []

    def previous(*args, **kwargs):
        seen.append(kwargs["repr"])

    saved = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = previous
    try:
        with triton_compiles() as names:
            # what Triton's JIT calls after compiling a specialization
            knobs.runtime.jit_post_compile_hook(key=None, repr="k[num_warps=4](i32)", fn=None,
                                                compile={}, is_manual_warmup=False,
                                                already_compiled=False)  # fmt: skip
            with triton_compiles() as inner:  # nested recorders both see a compile
                knobs.runtime.jit_post_compile_hook(repr="j[num_warps=8](*bf16)")
        assert names == ["k[num_warps=4](i32)", "j[num_warps=8](*bf16)"]
        assert inner == ["j[num_warps=8](*bf16)"]
        assert seen == names  # the hook installed before keeps being called
        assert knobs.runtime.jit_post_compile_hook is previous
    finally:
        knobs.runtime.jit_post_compile_hook = saved


def test_recorder_restores_on_error():
    saved = knobs.runtime.jit_post_compile_hook
    with pytest.raises(RuntimeError, match="boom"), triton_compiles():
        raise RuntimeError("boom")
    assert knobs.runtime.jit_post_compile_hook is saved


def test_run_workload_on_cpu_counts_tokens_steps_and_no_compiles():
    from kvplan import LLM

    cfg = named_config("tiny-llama")
    llm = LLM(cfg, device="cpu", dtype=torch.float32, max_num_seqs=3, max_model_len=64,
              max_num_batched_tokens=64)  # fmt: skip
    prompts = make_prompts(3, 10, cfg.vocab_size, seed=5)
    res = run_workload(llm, prompts, 6, progress=False)
    assert res.num_requests == 3 and res.prompt_tokens == 30 and res.output_tokens == 18
    assert res.num_steps == 6  # one step takes all three prompts, then five decode steps
    assert len(res.decode_step_ms) == 5 and res.wall_s > 0
    assert res.triton_compiles == []  # the CPU path (torch) compiles nothing


@pytest.mark.gpu
def test_gpu_recorder_sees_a_fresh_specialization():
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, SCALE: tl.constexpr):
        i = tl.arange(0, 128)
        m = i < n
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=m) + SCALE, mask=m)

    x = torch.zeros(100, device="cuda")
    scale = 1 + torch.randint(1 << 20, ()).item()  # a constexpr value no earlier run used
    with triton_compiles() as names:
        add_one[(1,)](x, 100, SCALE=scale)
        add_one[(1,)](x, 100, SCALE=scale)  # cached: no second compile
    assert len(names) == 1 and "add_one" in names[0]
    assert torch.all(x == 2 * scale)


def test_run_workload_sorts_steps_by_what_they_ran():
    from kvplan import LLM

    cfg = named_config("tiny-llama")
    # a 16-token budget over three 10-token prompts: the first step holds prompt rows only,
    # later ones mix the rest of the prompts with the first requests' decode rows
    llm = LLM(cfg, device="cpu", dtype=torch.float32, max_num_seqs=3, max_model_len=64,
              max_num_batched_tokens=16)  # fmt: skip
    res = run_workload(llm, make_prompts(3, 10, cfg.vocab_size, seed=6), 5, progress=False)
    kinds = res.step_ms_by_kind
    assert sum(len(v) for v in kinds.values()) == res.num_steps  # synchronous on the CPU
    assert len(kinds["prefill"]) == 1 and len(kinds["mixed"]) >= 1 and len(kinds["decode"]) >= 3
    assert set(kinds) == {"prefill", "mixed", "decode"}
    assert llm.engine.last_step_kind == "decode"


def test_kvplan_bench_table_reports_steps_by_kind(capsys):
    from kvplan.cli import main

    rc = main(["bench", "--config", "tiny-llama", "--num-requests", "3", "--prompt-len", "12",
               "--new-tokens", "4", "--device", "cpu"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    lines = {ln.split("  ")[0]: ln for ln in out.splitlines()}
    assert "prefill steps" in lines and "decode steps" in lines
    assert lines["Triton kernels compiled in the run"].split()[-1] == "0"
    assert "36 / 12" in lines["prompt / output tokens"]
