"""The engine's host work around long-prompt steps, phase by phase (CPU, model time excluded).

On the GPU a prefill step is synchronous: the host waits for the step's sampled tokens, then
commits the prompt's K/V (hashing its full blocks for prefix reuse), schedules the next
prompt (prefix lookup, block allocation), plans its attention metadata, builds its inputs and
only then launches the next step's first kernel. Whatever of that runs while the device has
nothing queued is device idle time per prompt. This script runs ``--prompts`` prompts of
``--prompt-len`` tokens through `LLM.generate` on the CPU (tiny random Llama, one prompt a
step, one new token each) with every phase wrapped by a timer, and reports the median
milliseconds per prompt of each phase. The model's forward is replaced by zero logits of the
right shape (``--real-forward`` keeps it: seconds a prompt on a CPU, and its memory traffic
leaves the host phases after it cache-cold, unlike a GPU's forward); ``host`` is the wall
time less the forward; ``idle`` is the part of ``host`` that runs between the step's sampled tokens
being ready and the next step's forward (what the device waits for).

    PYTHONPATH=. python3 bench/host_prefill.py --out host_prefill.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections import defaultdict

import torch

from kvplan import LLM
from kvplan.engine import runner as runner_mod
from kvplan.engine.cli_bench import make_prompts
from kvplan.engine.sampling import SamplingParams

PHASES = (
    "add_request", "schedule", "plan", "expand", "inputs", "forward", "sample", "wait",
    "update", "after_wait",
)  # fmt: skip

# The hybrid family's index expansions: the torch references on a CPU, device kernels that the
# host only launches on a GPU (timed as ``expand``, inside ``plan``; ``idle`` leaves them out)
EXPANSIONS = (
    ("kvplan.ops", ("expand_swa_index", "expand_kv_ca_index", "expand_swa_index_decode",
                               "expand_kv_ca_index_decode")),
    ("kvplan.backends.hybrid.planned_step", ("expand_window_index",)),
)  # fmt: skip


class Timers:
    """Accumulates the wall time of wrapped callables per phase, and one row per prompt."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)
        self.wait_end = 0.0

    def wrap_wait(self, fn):
        """The sampled tokens' wait: also remembers when it returned."""
        timed = self.wrap("wait", fn)

        def wait(*args, **kwargs):
            try:
                return timed(*args, **kwargs)
            finally:
                self.wait_end = time.perf_counter()

        return wait

    def wrap_update(self, fn):
        """The step's update; ``after_wait`` is the part after the tokens arrived (all of it
        when the wait runs before the update, the part after its own wait when inside)."""
        timed = self.wrap("update", fn)

        def update(*args, **kwargs):
            self.wait_end = time.perf_counter()
            try:
                return timed(*args, **kwargs)
            finally:
                self.now["after_wait"] += time.perf_counter() - self.wait_end

        return update

    def wrap(self, phase: str, fn):
        now = self.now

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                now[phase] += time.perf_counter() - t0

        return timed

    def take(self) -> dict[str, float]:
        row = {p: self.now.get(p, 0.0) * 1e3 for p in PHASES}
        self.now.clear()
        return row


def instrument(llm: LLM, timers: Timers, real_forward: bool) -> None:
    core = llm.engine
    core.add_request = timers.wrap("add_request", core.add_request)
    core.scheduler.schedule = timers.wrap("schedule", core.scheduler.schedule)
    runner = core.runner
    runner.plan = timers.wrap("plan", runner.plan)
    model = runner.model
    vocab = llm.engine.vocab_size

    def zero_logits(input_ids, positions, attention, rows):
        return torch.zeros(rows.numel(), vocab)

    forward = timers.wrap("forward", model if real_forward else zero_logits)

    class Timed:  # the runner calls ``model(...)`` and reads ``layer_families``
        layer_families = model.layer_families

        def __call__(self, *a, **k):
            return forward(*a, **k)

    runner.model = Timed()
    core._sample = timers.wrap("sample", core._sample)
    core._copies.wait = timers.wrap_wait(core._copies.wait)
    core._update_rows = timers.wrap_update(core._update_rows)
    for module, names in EXPANSIONS:
        mod = importlib.import_module(module)
        for name in names:
            setattr(mod, name, timers.wrap("expand", getattr(mod, name)))
    init = runner_mod.StepInputs.__init__
    runner_mod.StepInputs.__init__ = timers.wrap("inputs", init)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt-len", type=int, default=8000)
    ap.add_argument("--prompts", type=int, default=21)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--real-forward", action="store_true", help="run the tiny model's forward")
    ap.add_argument(
        "--model",
        default="random:tiny-llama",
        help="what LLM() loads, e.g. a DeepSeek-V4 folder (the hybrid family)",
    )
    ap.add_argument("--kv-format", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.prompt_len
    extra = {} if args.kv_format is None else {"kv_format": args.kv_format}
    if not args.model.startswith("random:"):
        extra["dtype"] = torch.float32
    llm = LLM(args.model, device="cpu", block_size=args.block_size, max_num_seqs=1,
              max_num_batched_tokens=n, max_model_len=n + 1,
              kv_cache_memory=256 << 20, **extra)  # fmt: skip
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = llm.engine.vocab_size
    timers = Timers()
    instrument(llm, timers, args.real_forward)
    llm.generate(make_prompts(1, n, vocab, seed=1), params)  # warm-up
    timers.take()
    rows = []
    for p in make_prompts(args.prompts, n, vocab, seed=2):
        t0 = time.perf_counter()
        llm.generate([p], params)
        wall = (time.perf_counter() - t0) * 1e3
        row = timers.take()
        row["wall"] = wall
        # sample's work after the forward is queued device work on a GPU: left in host
        row["host"] = wall - row["forward"]
        # after the tokens are ready (wait returned) until the next forward: the rest of the
        # update, then the next prompt's schedule, plan and inputs (add_request runs up front
        # in generate)
        row["idle"] = (
            row["after_wait"] + row["schedule"] + row["plan"] - row["expand"] + row["inputs"]
        )
        rows.append(row)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"{n}-token prompts, block size {args.block_size}, median ms a prompt of {len(rows)}:")
    for k in (*PHASES, "host", "idle", "wall"):
        print(f"  {k:12s} {med[k]:8.3f}")
    rec = {
        "bench": "host_prefill", "device": "cpu", "threads": args.threads, "model": args.model,
        "kv_format": args.kv_format,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "prompt_len": n,
        "block_size": args.block_size, "real_forward": args.real_forward, "median_ms": med, "runs": rows,
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
