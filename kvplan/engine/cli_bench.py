"""``kvplan bench``: throughput of the engine on a random-weight model from a named config.

A request mix (``--num-requests`` prompts of ``--prompt-len`` random tokens, or random lengths
up to it with ``--mix``; ``--new-tokens`` each, EOS ignored) runs through `kvplan.LLM`
after a short warm-up (kernel compilation, CUDA graph capture). Progress goes to stderr; the
throughput table to stdout. `run_workload` is shared with ``bench/bench_engine.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvplan.engine.config import add_engine_arguments, config_from_args


@dataclass
class WorkloadResult:
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    decode_step_ms: list[float] = field(default_factory=list)  # decode-only steps, full batch
    num_steps: int = 0
    num_graph_replays: int = 0
    # Triton kernels compiled during the run (``triton_compiles``): each one's compile time
    # is inside ``wall_s``; a warm-up of the same shapes leaves none
    triton_compiles: list[str] = field(default_factory=list)
    # every step() call's wall time (ms) by what the step it launched ran
    # (`EngineCore.last_step_kind`: "prefill", "mixed", "decode"; "none": it only processed
    # the step launched before)
    step_ms_by_kind: dict[str, list[float]] = field(default_factory=dict)

    def steps_by_kind_summary(self) -> dict[str, dict[str, float]]:
        """Per kind of step: how many, their summed and their longest wall time (ms)."""
        return {
            kind: {"count": len(ms), "total_ms": sum(ms), "max_ms": max(ms)}
            for kind, ms in self.step_ms_by_kind.items()
        }

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    @property
    def median_decode_step_ms(self) -> float | None:
        return statistics.median(self.decode_step_ms) if self.decode_step_ms else None


def make_prompts(
    num_requests: int, prompt_len: int, vocab_size: int, *, mix: bool = False, seed: int = 0
) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    if mix:
        lens = torch.randint(max(1, prompt_len // 8), prompt_len + 1, (num_requests,), generator=g)
    else:
        lens = torch.full((num_requests,), prompt_len)
    return [torch.randint(0, vocab_size, (int(n),), generator=g).tolist() for n in lens]


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def triton_compiles() -> Iterator[list[str]]:
    """Collects one line per Triton kernel compiled inside the block (``name[options](arg
    types)``, the specialization Triton keyed it by), through Triton's post-compile hook; a
    hook already installed keeps being called. Kernels found in Triton's in-process cache and
    the interpreter (``TRITON_INTERPRET=1``) compile nothing, so add nothing."""
    names: list[str] = []
    try:
        from triton import knobs
    except ImportError:  # no Triton: nothing can compile
        yield names
        return
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        names.append(str(kwargs.get("repr", "?")))
        return previous(*args, **kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield names
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def run_workload(
    llm, prompts: list[list[int]], new_tokens: int, *, progress: bool = True
) -> WorkloadResult:
    """Run every prompt to ``new_tokens`` tokens (EOS ignored), timing each step and
    recording the Triton kernels compiled meanwhile."""
    from tqdm import tqdm

    from kvplan.engine.sampling import SamplingParams

    core = llm.engine
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    graphs = core.runner.graphs
    replays0 = graphs.num_replays if graphs is not None else 0
    steps0 = core.num_steps
    sync_device(core.device)
    t0 = time.perf_counter()
    reqs = [core.add_request(p, params) for p in prompts]
    bar = tqdm(total=len(reqs) * new_tokens, desc="kvplan: tokens", file=sys.stderr,
               disable=not progress, unit="tok")  # fmt: skip
    steps: list[float] = []
    by_kind: dict[str, list[float]] = {}
    with triton_compiles() as compiled:
        _drive(core, reqs, steps, by_kind, bar)
    sync_device(core.device)
    wall = time.perf_counter() - t0
    bar.close()
    return WorkloadResult(
        num_requests=len(reqs),
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=sum(len(r.output_token_ids) for r in reqs),
        wall_s=wall,
        decode_step_ms=steps,
        num_steps=core.num_steps - steps0,
        num_graph_replays=(graphs.num_replays - replays0) if graphs is not None else 0,
        triton_compiles=list(compiled),
        step_ms_by_kind=by_kind,
    )


def _drive(core, reqs, steps: list[float], by_kind: dict[str, list[float]], bar) -> None:
    """The engine's steps until every request finished; full-batch decode step times in
    ``steps``, every step's in ``by_kind`` (see `WorkloadResult.step_ms_by_kind`)."""
    done = 0
    while core.has_unfinished():
        running = core.scheduler.running
        full_decode = (
            not core.scheduler.waiting
            and len(running) == len(reqs)
            and all(not r.is_prefilling for r in running)
        )
        ts = time.perf_counter()
        core.step()  # ends with the sampled tokens on the host (one sync)
        ms = (time.perf_counter() - ts) * 1e3
        by_kind.setdefault(core.last_step_kind or "none", []).append(ms)
        if full_decode:
            steps.append(ms)
        now = sum(len(r.output_token_ids) for r in reqs)
        bar.update(now - done)
        done = now


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvplan.models.config import named_configs

    parser.add_argument("--config", default="llama-1b", choices=named_configs())
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--mix", action="store_true", help="random prompt lengths up to --prompt-len"
    )
    add_engine_arguments(
        parser,
        ("device", "dtype", "backend", "kv_format", "kv_exact_window", "max_num_batched_tokens",
         "sliding_window_kv", "tensor_parallel_size", "warmup"),
        max_num_batched_tokens=8192,
    )  # fmt: skip
    parser.add_argument("--no-cuda-graph", action="store_true", help="eager decode steps")


def run(args: argparse.Namespace) -> int:
    from kvplan.engine.llm import LLM
    from kvplan.models.config import named_config

    for flag, value in (
        ("--num-requests", args.num_requests),
        ("--prompt-len", args.prompt_len),
        ("--new-tokens", args.new_tokens),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    cfg = named_config(args.config)
    config = config_from_args(
        args,
        max_num_seqs=args.num_requests,
        max_model_len=args.prompt_len + args.new_tokens + 16,
        use_cuda_graph=False if args.no_cuda_graph else None,
    )
    llm = LLM(cfg, config)
    run_workload(llm, make_prompts(2, 8, cfg.vocab_size, seed=1), 4, progress=False)  # warm-up
    prompts = make_prompts(args.num_requests, args.prompt_len, cfg.vocab_size, mix=args.mix)
    res = run_workload(llm, prompts, args.new_tokens)
    step = res.median_decode_step_ms
    rows = [
        ("model", f"{args.config} ({cfg.num_params / 1e9:.2f}B params, random weights)"),
        (
            "device / backend",
            f"{llm.parts.kv_cache.device} / {args.backend} / {llm.parts.kv_format}",
        ),
        ("requests", str(res.num_requests)),
        ("prompt / output tokens", f"{res.prompt_tokens} / {res.output_tokens}"),
        ("wall time", f"{res.wall_s:.3f} s"),
        ("output tokens/s", f"{res.output_tokens_per_s:,.0f}"),
        ("total tokens/s", f"{res.total_tokens_per_s:,.0f}"),
        ("median full-batch decode step", "-" if step is None else f"{step:.3f} ms"),
        ("steps / graph replays", f"{res.num_steps} / {res.num_graph_replays}"),
        *(
            (f"{kind} steps", f"{d['count']} ({d['total_ms']:.1f} ms of step() calls)")
            for kind, d in sorted(res.steps_by_kind_summary().items())
        ),
        ("Triton kernels compiled in the run", str(len(res.triton_compiles))),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
