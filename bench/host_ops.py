"""What the host issues for one eager DeepSeek-V4 prompt step (CPU, no GPU needed).

An eager step's host time on the GPU is spent issuing work: each Triton launch costs ~20 us of
host time (lean launches, session 29), each torch op ~5-8 us, each cuBLAS call more (session
28's cProfile: ~630 launches and ~43 ms for one 8-token prompt next to 15 decode rows, 3.9 ms
of kernels). This runs the quick DeepSeek-V4 model (``hybrid_steps.py --quick``) with kvplan's
Triton kernels forced on the CPU (``KVPLAN_FORCE_TRITON=1``, the interpreter, so the CUDA
code paths run) and counts, for the steps of one new prompt of ``--prompt-len`` tokens after a
warm request, every Triton launch by kernel and every torch operator dispatched outside a
launch (``TorchDispatchMode``), with the ops that would wait for the device on a GPU
(`SYNC_OPS`: ``.item()``, ``int()`` / ``bool()`` of a tensor, ``nonzero``, ``unique``, ...)
counted apart. ``.tolist()`` dispatches no op on a CPU tensor, so it is not seen here. The counts are what an optimisation of the eager step must
lower; the milliseconds stay the GPU's to measure.

    PYTHONPATH=. python3 bench/host_ops.py --prompt-len 8 --out host_ops.json
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
os.environ["KVPLAN_FORCE_TRITON"] = "1"
os.environ.setdefault("KVPLAN_FUSED_COMPRESS", "1")  # CUDA's default: the fused compressor

import argparse  # noqa: E402
import collections  # noqa: E402
import cProfile  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hybrid_steps import build_folder, step_rows  # noqa: E402

from kvplan import LLM, SamplingParams  # noqa: E402

# torch ops that only describe a tensor (no kernel, no allocation on a device)
VIEW_OPS = {
    "aten.view", "aten._unsafe_view", "aten.as_strided", "aten.t", "aten.transpose",
    "aten.permute", "aten.unsqueeze", "aten.squeeze", "aten.expand", "aten.slice",
    "aten.select", "aten.alias", "aten.detach", "aten.split", "aten.split_with_sizes",
    "aten.unbind", "aten.chunk", "aten.reshape", "aten.narrow", "aten.view_as_real",
    "aten.view_as_complex", "aten.unflatten", "aten.flatten", "aten.lift_fresh",
}  # fmt: skip


class Counter(TorchDispatchMode):
    """Counts torch operators by name, except while a Triton launch runs (the interpreter's
    own tensor traffic is not host work on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.inside = 0
        self.counting = True
        self.profile: cProfile.Profile | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.inside and self.counting:
            name = str(func.overloadpacket)
            # ``.to()`` / ``.contiguous()`` that return their input launch nothing
            noop = name in ("aten.to", "aten.contiguous") and args and out is args[0]
            self.ops[name + " (no-op)" if noop else name] += 1
        return out


def install_launch_counter(counter: Counter) -> tuple[collections.Counter, list[float]]:
    """Wrap the interpreter's launch: (launches by kernel while ``counter.counting``, a
    one-element list accumulating the seconds spent inside launches)."""
    from triton.runtime import interpreter

    launches: collections.Counter = collections.Counter()
    seconds = [0.0]
    original = interpreter.InterpretedFunction.run

    def run(self, *args, **kwargs):
        outer = not counter.inside
        if outer and counter.counting:
            launches[self.fn.__name__] += 1
        counter.inside += 1
        if outer and counter.profile is not None:
            counter.profile.disable()  # the interpreter's run is kernel time, not host time
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            counter.inside -= 1
            if outer:
                seconds[0] += time.perf_counter() - t0
                if counter.profile is not None:
                    counter.profile.enable()

    interpreter.InterpretedFunction.run = run
    return launches, seconds


# torch ops that wait for a device value on a GPU: a scalar read back (``.item()``, ``int()``,
# ``bool()``; ``aten.item`` under inference mode), a result whose size depends on the values
SYNC_OPS = {
    "aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal", "aten.nonzero",
    "aten.nonzero_numpy", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive",
    "aten.masked_select",
}  # fmt: skip


def summary(launches, ops) -> dict:
    skip = VIEW_OPS | SYNC_OPS
    kernels = sum(ops[k] for k in ops if k not in skip and not k.endswith("(no-op)"))
    return {
        "triton_launches": sum(launches.values()),
        "torch_ops": kernels,
        "view_ops": sum(ops[k] for k in ops if k in VIEW_OPS),
        "noop_ops": sum(ops[k] for k in ops if k.endswith("(no-op)")),
        "host_syncs": sum(ops[k] for k in ops if k in SYNC_OPS),
        "launches_by_kernel": dict(launches.most_common()),
        "ops_by_name": dict(ops.most_common()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--decode-rows", type=int, default=0,
                    help="requests decoding beside the new prompt (its step is then mixed)")  # fmt: skip
    ap.add_argument("--kv-format", default="fp8")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the model's dtype (bf16: what the GPU runs; conversions a bf16 "
                    "model needs differ from an fp32 one's)")  # fmt: skip
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--repeat", type=int, default=5, help="timed prompt steps after the count")
    ap.add_argument("--cprofile", action="store_true",
                    help="one more step under cProfile: kvplan's and torch's host functions "
                    "by own time (the interpreter's frames left out)")  # fmt: skip
    ap.add_argument("--cumulative", action="store_true", help="sort the profile by cumulative time")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        vocab = build_folder(folder + "/model", True, args.prompt_len + 512, torch.device("cpu"))
        llm = LLM(folder + "/model", device="cpu", dtype=args.dtype, kv_format=args.kv_format,
                  max_num_seqs=args.decode_rows + 2, max_model_len=args.prompt_len + 256,
                  max_num_batched_tokens=max(256, args.prompt_len + args.decode_rows))  # fmt: skip
        # CUDA's MoE path for the counted step's rows (`DeepseekV4MoE.dense_size`: dense, else
        # grouped; the quick model's 4 experts are too few for grouped dense batches), where
        # the CPU's rule takes the sparse loop
        num_rows = args.prompt_len + args.decode_rows
        for module in llm.engine.runner.model.modules():
            if hasattr(module, "dense_size"):
                module.dense_routing = module.dense_size(num_rows)
                module.grouped_routing = not module.dense_routing
        greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        if not args.decode_rows:  # a warm request (the decode rows' own steps warm up else)
            ids = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
            llm.generate([ids], greedy)
        for _ in range(args.decode_rows):  # requests that keep decoding through the step
            ids = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
            llm.add_request(ids, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        while args.decode_rows and any(r.is_prefilling for r in llm.engine.scheduler.running):
            llm.step()
        if args.decode_rows:
            llm.step()

        def prompt_step(count: bool = False) -> float:
            """Add a new prompt, run its step (one chunk: the budget holds it); the step's
            host seconds (its wall less the interpreter's kernels)."""
            ids = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
            llm.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            if count:
                result["step_rows"] = dict(zip(("decode", "prompt_tokens"), step_rows(llm.engine)))
            before, t0 = kernel_s[0], time.perf_counter()
            if count:
                with counter:
                    llm.step()
            elif counter.profile is not None:
                counter.profile.runcall(llm.step)
            else:
                llm.step()
            return time.perf_counter() - t0 - (kernel_s[0] - before)

        counter = Counter()
        launches, kernel_s = install_launch_counter(counter)
        result: dict = {}
        prompt_step(count=True)
        result |= summary(launches, counter.ops)
        counter.counting = False
        hosts = [prompt_step() for _ in range(args.repeat)]
        result["host_ms_cpu"] = 1e3 * statistics.median(hosts) if hosts else None
        if args.cprofile:
            counter.profile = cProfile.Profile()
            prompt_step()
            rows = list(pstats.Stats(counter.profile).stats.items())
            rows.sort(key=lambda kv: -kv[1][3 if args.cumulative else 2])
            result["cprofile_total_ms"] = 1e3 * pstats.Stats(counter.profile).total_tt
            result["cprofile_top"] = [
                {"function": f"{k[0].split('/kvplan/')[-1]}:{k[1]}:{k[2]}", "calls": v[1],
                 "own_ms": 1e3 * v[2], "cumulative_ms": 1e3 * v[3]}
                for k, v in rows[: args.top]
            ]  # fmt: skip
    rows = result["step_rows"]
    print(f"one step: {rows['prompt_tokens']} prompt tokens + {rows['decode']} decode rows, "
          f"{args.kv_format} KV, {args.dtype}, quick DeepSeek-V4 (4 layers)")  # fmt: skip
    print(f"  Triton launches {result['triton_launches']}, torch ops {result['torch_ops']} "
          f"(+{result['view_ops']} views, {result['noop_ops']} no-op conversions), "
          f"host syncs {result['host_syncs']}")  # fmt: skip
    if result["host_ms_cpu"] is not None:
        print(f"  host time (wall less the interpreter's kernels, median of {args.repeat}): "
              f"{result['host_ms_cpu']:.2f} ms on this CPU")  # fmt: skip
    if args.cprofile:
        print(f"  under cProfile: {result['cprofile_total_ms']:.2f} ms of host functions")
    for row in result.get("cprofile_top", []):
        print(f"    {row['own_ms']:7.2f} ms own {row['cumulative_ms']:8.2f} cum "
              f"{row['calls']:5d} x {row['function']}")  # fmt: skip
    print("  launches:", ", ".join(f"{k} {v}" for k, v in launches.most_common(args.top)))
    ops = [(k, v) for k, v in counter.ops.most_common() if k not in VIEW_OPS]
    print("  ops:", ", ".join(f"{k[5:]} {v}" for k, v in ops[: args.top]))
    if args.out:
        Path(args.out).write_text(json.dumps({
            "bench": "host_ops",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join([sys.executable, *sys.argv]),
            "prompt_len": args.prompt_len, "decode_rows": args.decode_rows,
            "kv_format": args.kv_format, "dtype": args.dtype, **result,
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
