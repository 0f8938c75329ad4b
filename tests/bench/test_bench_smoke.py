"""CPU smoke runs of the benchmark scripts the next GPU calls use (``--quick``: tiny shapes,
the Triton interpreter), so that a script error shows up here and not in device time: the JSON
each writes and its checked values."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]


def _run(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def bench_engine():
    """``bench/bench_engine.py`` as a module (its helpers), loaded once."""
    spec = importlib.util.spec_from_file_location(
        "bench_engine", ROOT / "bench" / "bench_engine.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quant_decode_quick_with_prefetch(tmp_path):
    out = tmp_path / "quant.json"
    proc = _run("bench_quant_decode.py", "--quick", "--formats", "fp8,fp4", "--prefetch", "1,2",
                "--splits", "", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    modes = {(r["format"], r["config"]["prefetch"]) for r in rows
             if isinstance(r["config"], dict) and "prefetch" in r["config"]}  # fmt: skip
    assert modes == {(f, m) for f in ("fp8", "fp4") for m in (0, 1, 2)}
    assert all(r["rel_err"] < 1e-2 for r in rows)


def test_profile_prefill_quick_workload(tmp_path):
    out = tmp_path / "prefill.json"
    proc = _run("profile_prefill.py", "--quick", "--workload", "3,4", "--variants",
                "bf16,fp8,fp8-paged,fp4+prefetch", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert [r["variant"] for r in rec["runs"]] == ["bf16", "fp8", "fp8-paged", "fp4+prefetch"]
    assert rec["workload"] == [3, 4] and all(r["ms_per_prompt"] > 0 for r in rec["runs"])


def test_sparse_kernels_quick_index_prompt(tmp_path):
    out = tmp_path / "ip.json"
    proc = _run("bench_sparse_kernels.py", "--only", "index_prompt", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["case"].split()[1] for r in rows} == {"mxfp8", "fp8_fp32sf"}
    assert all(r["rel_err"] < 1e-5 for r in rows if "rel_err" in r)


def test_decode_loop_ops_reads_the_main_loop():
    """``decode_kernel_regs.py --loop-ops`` compiles one decode launch for sm_90 on the CPU and
    counts its main loop's instructions: a loop with tensor-core MMAs and cp.async loads."""
    proc = _run("decode_kernel_regs.py", "--loop-ops", "fp8:64,2,3")
    if proc.returncode != 0 and "ptxas" in proc.stderr.lower():
        import pytest

        pytest.skip("no ptxas in this Triton install")
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    loop = row["main_loop"]
    assert row["format"] == "fp8" and row["registers"] > 0
    assert loop["len"] > 100 and loop["HMMA"] > 0 and loop["LDGSTS"] > 0


def test_hybrid_steps_quick(tmp_path):
    """`hybrid_steps.py`: every step of the tiny workload recorded (a prefill, mixed steps,
    decode steps), the prompt steps again under cProfile, one prompt alone, the lean-launch
    A/B's walks."""
    out = tmp_path / "steps.json"
    proc = _run("hybrid_steps.py", "--quick", "--profile", "cprofile", "--top", "5", "--small",
                "8", "--lean-ab", "1", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    kinds = [s["kind"] for s in rec["steps"]]
    assert kinds[0] == "prefill" and "decode" in kinds and "mixed" in kinds
    n, p = rec["workload"]["requests"], rec["workload"]["prompt_len"]
    assert sum(s["prompt_tokens"] for s in rec["steps"]) == n * p
    assert all(s["ms"] > 0 for s in rec["steps"])
    prof = rec["steps_cprofile"]
    assert prof and all(len(s["host_own"]) == 5 and s["wall_ms_profiled"] > 0 for s in prof)
    assert rec["small_prompts"][0]["prompt_tokens"] == 8
    eager = sum(1 for s in rec["steps"] if s["prompt_tokens"])
    for runs in (rec["lean_ab"]["off"], rec["lean_ab"]["on"]):
        assert len(runs) == 1 and len(runs[0]["eager_ms"]) == eager
        assert runs[0]["decode_median_ms"] > 0 and runs[0]["prompt8_ms_min"] > 0


def test_specializations_a_new_prompt_size_compiles_nothing(tmp_path):
    """`specializations.py`: after prompts of 5, 16 and 17 tokens, a 23-token prompt needs no
    new specialization of any kernel (before the kernels stopped specializing on their
    sizes it compiled three: the window, kv_ca and convert index expansions)."""
    out = tmp_path / "spec.json"
    proc = _run("specializations.py", "--layers", "2", "--lengths", "5,16,17,23",
                "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert [p["prompt_tokens"] for p in rec["prompts"]] == [5, 16, 17, 23]
    assert rec["prompts"][0]["new"] > 20  # the first prompt compiles the prompt path
    assert rec["prompts"][-1]["new"] == 0, rec["prompts"][-1]["by_kernel"]


@pytest.mark.slow
def test_specializations_after_the_warmup_a_random_workload_compiles_nothing(tmp_path):
    """`specializations.py --warmup`: the quick DeepSeek-V4 engine warmed up at construction
    (`kvplan.engine.warmup`) compiles no new kernel specialization for prompts of lengths it
    did not run, nor for a random workload of prompts joining decode rows. (A guard at small
    sizes; the larger run that found the sparse kernels' slot counts specializing, 2 new
    compiles in 20 random requests up to 100 tokens, is in bench/RESULTS.md, session 30.)"""
    out = tmp_path / "spec.json"
    # two layers (the hash-routed HCA one and the CSA one): the 4-layer quick model's 42
    # specializations of 20 kernels, in half the time (bench/RESULTS.md, session 34)
    proc = _run("specializations.py", "--warmup", "--layers", "2", "--lengths", "6,13",
                "--random", "6", "--budget", "16", "--out", str(out), timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["warmup"] and rec["after_build"]["specializations"] > 20
    assert [p["new"] for p in rec["prompts"]] == [0, 0], rec["prompts"]
    work = rec["random_workload"]
    assert work["steps"] > work["requests"] and work["new"] == 0, work["by_kernel"]


def test_first_request_quick(tmp_path):
    """`first_request.py`: the dense engine's build (with its warmup) and the first and later
    runs of prompts of new lengths, recorded."""
    out = tmp_path / "first.json"
    proc = _run("first_request.py", "--quick", "--warmup", "on", "--small", "5,30",
                "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["warmup"]["steps"] > rec["warmup"]["requests"] > 10
    assert [r["prompt_tokens"] for r in rec["small_prompts"]] == [5, 30]
    assert all(len(r["ms_runs"]) == 5 and r["ms_min_after"] > 0 for r in rec["small_prompts"])


def test_hybrid_prefix_cache_quick(tmp_path):
    """`hybrid_prefix_cache.py`: the system-prompt, rounds and conversation workloads with
    the cache off and on; with it on, the questions resume after the (primed) system prompt,
    every round's questions but the first one's after the shared part (they wait for it in
    round 1; without waiting, round 1 computes it again), each later turn after the last
    turn's newest block boundary, with the same tokens as without the cache."""
    out = tmp_path / "prefix.json"
    proc = _run("hybrid_prefix_cache.py", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    off, on = rec["results"]["off"], rec["results"]["on"]
    assert off["system"]["hit_tokens"] == [0, 0, 0] and on["system"]["hit_tokens"] == [32] * 3
    assert all(h == [0, 0, 0] for h in off["rounds"]["hit_tokens"])
    # 41 shared tokens: 2 blocks
    assert on["rounds"]["hit_tokens"] == [[0, 32, 32], [32] * 3, [32] * 3]
    nowait = rec["results"]["nowait"]
    assert (
        sum(nowait["rounds"]["hit_tokens"][0]) < 64
        and nowait["rounds"]["hit_tokens"][-1] == [32] * 3
    )
    assert on["prefix_waits"] > 0 and nowait["prefix_waits"] == 0 == off["prefix_waits"]
    assert on["conversation"]["hit_tokens"][1:] == [64, 80]
    summary = rec["summary"]
    assert summary["system_tokens_equal"] and summary["conversation_tokens_equal"]
    assert summary["rounds_tokens_equal"] and summary["rounds_tokens_equal_nowait"]
    assert on["snapshots"]["restored"] >= 11 and "snapshots" not in off


def test_shared_prefix_quick(tmp_path):
    """`shared_prefix.py`: requests sharing a fresh system prompt, sent together: with the
    cache on but no waiting every request computes it (the first lookups find nothing); with
    waiting one request computes it and the others reuse its blocks; tokens are equal."""
    out = tmp_path / "shared.json"
    proc = _run("shared_prefix.py", "--quick", "--rounds", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    res, w = rec["results"], rec["workload"]
    prompt_tokens = w["requests"] * (w["system_len"] + w["question_len"])
    shared = w["system_len"] // 16 * 16  # the default 16-token blocks
    for r in res["off"]["rounds"] + res["nowait"]["rounds"]:
        assert r["computed_prompt_tokens"] == prompt_tokens
    for r in res["wait"]["rounds"]:
        assert r["hit_tokens"] == [0] + [shared] * (w["requests"] - 1)
        assert r["computed_prompt_tokens"] == prompt_tokens - (w["requests"] - 1) * shared
    assert res["wait"]["prefix_waits"] > 0 == res["nowait"]["prefix_waits"]
    assert rec["summary"]["nowait_tokens_equal"] and rec["summary"]["wait_tokens_equal"]


def test_host_ops_an_eager_prompt_step_makes_no_host_sync(tmp_path):
    """`host_ops.py`: one mixed step (a new prompt beside decode rows) of the quick
    DeepSeek-V4 model on the CUDA code paths counts its launches and torch ops; none of them
    reads a value back to the host (``.item()`` / ``.tolist()``: a sync on a GPU)."""
    out = tmp_path / "ops.json"
    proc = _run("host_ops.py", "--prompt-len", "5", "--decode-rows", "2", "--repeat", "0",
                "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["step_rows"] == {"decode": 2, "prompt_tokens": 5}
    assert rec["host_syncs"] == 0, rec["ops_by_name"]
    launched = rec["launches_by_kernel"]
    for kernel in ("hc_pre_kernel", "compress_store_kernel", "sparse_ranges_kernel"):
        assert launched.get(kernel, 0) > 0, launched
    assert rec["torch_ops"] > 0 and rec["host_ms_cpu"] is None  # no timed steps asked


def test_engine_quick_reports_the_requests_its_kv_budget_holds(tmp_path, bench_engine):
    """bench_engine says how many requests its KV budget holds at full length: a ratio
    between KV formats is partly capacity where one holds fewer (the long workload's bf16 in 8
    GiB: 16,384 blocks of 530-block requests hold 30 of 32)."""
    kv_capacity = bench_engine.kv_capacity

    from kvplan.cache.pool_sizing import PoolSizes

    assert kv_capacity(PoolSizes((None,), (16384,), (530,), (1 << 19,), 0), 32) == {
        "kv_blocks": [16384],
        "blocks_per_request": [530],
        "requests_that_fit": 30,
    }
    assert kv_capacity(PoolSizes((None,), (16961,), (530,), (1,), 0), 32)["requests_that_fit"] == 32
    two = PoolSizes((None, 512), (4001, 301), (100, 10), (1, 1), 30)  # the tighter pool decides
    assert kv_capacity(two, 64)["requests_that_fit"] == 30
    assert kv_capacity(None, 8) == {}
    out = tmp_path / "engine.json"
    proc = _run("bench_engine.py", "--quick", "--hf", "", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    kv = json.loads(out.read_text())["kvplan"]
    per = kv["blocks_per_request"][0]
    assert kv["requests_that_fit"] == min(4, (kv["kv_blocks"][0] - 1) // per) == 4
    assert "requests at full length" in proc.stdout


def test_bench_engine_repeats_report_the_median_run(tmp_path, bench_engine):
    """``--repeats 3``: three timed runs (the later ones on other random prompts), every run
    in the JSON's ``runs``, the headline figures those of the median run, the decode step the
    median over every run's full-batch steps; ``--repeats 0`` is refused naming the flag."""
    median_run = bench_engine.median_run

    from kvplan.engine.cli_bench import WorkloadResult

    runs = [WorkloadResult(4, 64, 32, wall, decode_step_ms=ms)
            for wall, ms in ((0.3, [1.0, 2.0]), (0.1, [5.0]), (0.2, []))]  # fmt: skip
    res, step = median_run(runs)
    assert res is runs[2] and step == 2.0  # walls 0.1 < 0.2 < 0.3; steps 1, 2, 5
    assert median_run(runs[:2])[0] is runs[1]  # an even count: the lower middle
    assert median_run([runs[2]])[1] is None
    out = tmp_path / "engine.json"
    proc = _run("bench_engine.py", "--quick", "--hf", "", "--repeats", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    kv = json.loads(out.read_text())["kvplan"]
    assert len(kv["runs"]) == 3
    walls = sorted(r["wall_s"] for r in kv["runs"])
    assert kv["wall_s"] == walls[1]
    assert kv["output_tokens_per_s"] in [r["output_tokens_per_s"] for r in kv["runs"]]
    assert all(r["steps_by_kind"] for r in kv["runs"])
    assert "kvplan runs (output tok/s" in proc.stdout
    bad = _run("bench_engine.py", "--quick", "--hf", "", "--repeats", "0", "--out", str(out))
    assert bad.returncode != 0 and "--repeats must be >= 1, got 0" in bad.stderr


def test_split_linear_bench_loads_and_needs_a_gpu():
    """``bench_split_linear.py`` imports its helpers from ``bench_small_gemm.py`` and, without
    a CUDA device, stops with a message saying so (its timings need one)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device: the script would run the benchmark")
    proc = _run("bench_split_linear.py", "--shapes", "64,2048,2048,o")
    assert proc.returncode == 1 and "bench_split_linear needs a CUDA device" in proc.stderr


def test_argmax_bench_quick_and_its_lm_head_mode_needs_a_gpu(tmp_path):
    """``bench_argmax.py`` on the CPU (tiny shapes, every path equal to torch's argmax); its
    ``--lm-head`` mode, which times the GEMM kernel, stops without a CUDA device."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device: the script would run the benchmark")
    out = tmp_path / "argmax.json"
    proc = _run("bench_argmax.py", "--shapes", "3x300", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["bench"] == "argmax" and all(r["equal"] for r in record["rows"])
    proc = _run("bench_argmax.py", "--lm-head")
    assert proc.returncode == 1 and "bench_argmax --lm-head needs a CUDA device" in proc.stderr
