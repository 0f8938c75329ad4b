"""``bench/bench_gemma3.py --quick`` on the CPU (tiny gemma3_text, fp32): the JSON it writes,
kvplan's greedy tokens against Hugging Face's on the same saved weights, and the long-context
runs holding the computed window-pool and full-page batches at once; plus its prompt-length rule by hand."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

PATH = pathlib.Path(__file__).parents[2] / "bench" / "bench_gemma3.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_gemma3", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ramp_steps_by_hand(bench):
    # budget 8, prompts of 10: step 1 admits #0 (8 tokens); step 2 ends #0 (2) and admits #1
    # (6); step 3: #0 decodes (1), #1 ends (4)
    assert bench.ramp_steps(2, 10, 8) == 3
    assert bench.ramp_steps(9, 10, 8) == float("inf")  # 8 decoding requests take the budget
    context, chunk, n = 256, 64, 7
    prompt = bench.demo_prompt_len(n, context, chunk)
    assert prompt % bench.BLOCK_SIZE == 0 and prompt > 0

    def fits(p):
        r = bench.ramp_steps(n, p, chunk)
        return context - p >= r + 16 + r / 20

    assert fits(prompt) and not fits(prompt + bench.BLOCK_SIZE)


def test_quick_run(bench, tmp_path):
    out = tmp_path / "q.json"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    for key in ("date", "device", "command", "params", "workload", "hf", "kvplan",
                "ratio_vs_best_hf", "greedy_check", "long_context", "wall_s"):  # fmt: skip
        assert key in row, key
    assert row["device"] == "cpu" and row["workload"]["dtype"] == "torch.float32"
    work = row["workload"]
    kv, hf = row["kvplan"], row["hf"]["generate"]
    assert kv["output_tokens"] == hf["output_tokens"] == work["requests"] * work["new_tokens"]
    assert kv["output_tokens_per_s"] > 0 and row["ratio_vs_best_hf"] > 0

    check = row["greedy_check"]
    ours, theirs = check["kvplan_tokens"], check["hf_tokens"]
    assert len(ours) == work["requests"] and all(len(t) == work["new_tokens"] for t in ours)
    assert ours == theirs  # fp32, the same bf16-valued weights: greedy tokens are equal
    assert check["sequences_equal"] == 1.0
    assert len({t for seq in theirs for t in seq}) > 3  # not a degenerate repeated token

    lc = row["long_context"]
    full, window = lc["max_batch_full_pages_computed"], lc["max_batch_window_pools_computed"]
    assert 0 < full < window
    runs = lc["runs"]
    run = runs["window"]
    assert run["sliding_window_kv"] == "window"
    assert run["engine_num_window_seqs"] == run["requests"] == window
    assert run["peak_running"] == window and run["preemptions"] == 0
    assert run["all_ran_concurrently"] and not run["stopped_by_time_budget"]
    # at the peak the full-attention layers hold more tokens than full pages could hold
    # requests of the whole context, and every running request is past the sliding window
    peak = run["at_peak_kv"]
    assert peak["kv_tokens_held"] > full * lc["context_tokens"]
    assert peak["min_context"] > 32 and peak["full_pool_blocks_used"] <= sum(
        n for w, n in run["engine_pool_blocks"].items() if w == "None"
    )
    # full pages: the engine's own sizing admits the computed batch, all of it at once
    run = runs["full"]
    assert run["sliding_window_kv"] == "full" and run["requests"] == full
    assert run["peak_running"] == full and run["preemptions"] == 0
    assert run["all_ran_concurrently"]
