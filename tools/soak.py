"""Soak the engine (CPU): the reliability fuzz of `tests/engine/test_reliability.py` over many
seeds and random engine settings, or random concurrent traffic against ``kvplan serve``, for
a time budget. Each run prints ``ok`` or ``FAIL`` with its seed, settings and traceback;
the exit status is 1 when any run failed. The test suite runs each fuzz at one fixed seed;
this is the wide search (session 40's first hour found the zero-row index-cache load of
DeepSeek-V4 engines with fp8 / fp4 KV).

    PYTHONPATH=. python tools/soak.py dense --seconds 600
    PYTHONPATH=. python tools/soak.py hybrid --seconds 1800 --seed 200
    PYTHONPATH=. python tools/soak.py server --seconds 600
    PYTHONPATH=. python tools/soak.py structured --seconds 300

``dense``: a tiny random Llama, or one with a window-8 sliding layer beside a global one
(head_dim 16, or 32 for the fp8 / int8 formats); per run a
random backend, kv_format, `kv_exact_window` (quantized formats), chunked prefill, n-gram
speculation, pool size, step budget and batch size, and prompts that may share prefixes.
Survivors (requests that ran to their length) equal a reference engine's single runs of
their prompts (same backend, format and window, no prefix cache), window runs that chunk
prompts or preempt included (every query reads its own window exact however its prompt is
grouped into steps); the block ledger holds after every operation.

``hybrid``: tiny random DeepSeek-V4 models (`tests/models/dsv4_testlib.hf_config`), the
exact, fp8 or fp4 cache, pools small enough to preempt, n-gram drafts in some runs (their
rejected rows rolled back); the same checks, plus every live request holding its own state
slot.

``structured``: batches mixing JSON mode, JSON schemas (nested, bounded arrays, a recursive
``$ref``), forced tool calls and plain requests on a byte-level-tokenizer Llama, with random
sampling and async scheduling: every guided output is a prefix of a valid text, finished ones
whole, and no block is left.

``server``: eight client threads send random completions / chat requests (streamed or not,
some cut short, some invalid) to a served tiny Llama with a small pool; after each round no
response was a 5xx other than 503, every block is free and a greedy request equals the
engine's own `generate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import random
import sys
import tempfile
import threading
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def dense_settings(rng: random.Random) -> dict:
    kv_format = rng.choice(["auto", "auto", "fp8", "int8", "fp4"])
    chunked = rng.random() < 0.5
    # quantized caches: sometimes with the recent rows exact (`kv_exact_window`), then
    # without prefix caching (a hit reads its reused rows from the pages)
    window = rng.choice([0, 0, 2, 5]) if kv_format != "auto" else 0
    return dict(
        kv_exact_window=window,
        model=rng.choice(["tiny-llama", "tiny-llama", "sliding"]),
        backend=rng.choice(["vanilla", "ragged", "block_offsets"]),
        kv_format=kv_format,
        head_dim=32 if kv_format in ("fp8", "int8") else 16,
        enable_chunked_prefill=chunked,
        num_speculative_tokens=rng.choice([0, 0, 2, 3]),
        max_num_batched_tokens=rng.choice([16, 24, 32]) if chunked else 32,
        num_blocks=rng.choice([10, 12, 16]),
        max_num_seqs=rng.choice([2, 3, 8]),
        shared_prefixes=rng.random() < 0.5,
    )


def run_dense(seed: int, ops: int = 120) -> dict:
    """One dense fuzz run (settings drawn from ``seed``); raises on any failed check."""
    from kvplan import LLM
    from kvplan.models.config import named_config
    from tests.engine.test_reliability import GREEDY, VOCAB, check_ledger, fuzz

    rng = random.Random(seed)
    s = dense_settings(rng)
    if s["model"] == "sliding":  # a window-8 layer (its own block pool) and a global one
        base = dataclasses.replace(named_config("tiny-mistral"), layer_windows=(8, None))
    else:
        base = named_config("tiny-llama")
    model = dataclasses.replace(base, head_dim_override=s["head_dim"])
    common = dict(device="cpu", block_size=4, max_model_len=32, backend=s["backend"],
                  kv_format=s["kv_format"], kv_exact_window=s["kv_exact_window"])  # fmt: skip
    llm = LLM(model, **common, enable_chunked_prefill=s["enable_chunked_prefill"],
              num_speculative_tokens=s["num_speculative_tokens"],
              max_num_batched_tokens=s["max_num_batched_tokens"], num_blocks=s["num_blocks"],
              max_num_seqs=s["max_num_seqs"],
              enable_prefix_caching=not s["kv_exact_window"])  # fmt: skip
    # every run compared, window runs too: each query reads its own last W keys exact in
    # every step, so a prompt split into chunks, recomputed after a preemption or verified
    # with drafts sees the keys of a lone run's steps (a last-bit difference in a chunk's K/V
    # rows could still move an fp8 rounding and, at a near tie, a greedy token: none did in
    # 306 window-only runs with every output compared, 159 chunked or preempting, session 47)
    ref = LLM(model, **common, enable_prefix_caching=False)
    prefixes = ()
    if s["shared_prefixes"]:
        prefixes = [[rng.randrange(VOCAB) for _ in range(12)] for _ in range(3)]
    checked = fuzz(llm, ref, rng, vocab=VOCAB, params=GREEDY,
                   ops=ops, max_prompt=10, bad=[[VOCAB], [-3], [1.5], [1] * 70],
                   check=lambda: check_ledger(llm),
                   keep_streams=0.3, prefixes=prefixes)  # fmt: skip
    if llm.engine.scheduler.manager.request_ids():
        raise AssertionError("requests left in the cache manager after the run")
    return {**s, "compared": checked}


_HYBRID_FOLDERS: dict[int, tuple[str, int]] = {}


def _hybrid_folder(model_seed: int) -> tuple[str, int]:
    if model_seed not in _HYBRID_FOLDERS:
        from tests.models.dsv4_testlib import hf_config, hf_model

        cfg = hf_config(model_seed)
        folder = pathlib.Path(tempfile.mkdtemp()) / f"dsv4_{model_seed}"
        hf_model(cfg, model_seed).save_pretrained(folder)
        _HYBRID_FOLDERS[model_seed] = (str(folder), cfg.vocab_size)
    return _HYBRID_FOLDERS[model_seed]


def run_hybrid(seed: int, ops: int = 100) -> dict:
    """One DeepSeek-V4 fuzz run (model and settings drawn from ``seed``)."""
    from kvplan import LLM, SamplingParams
    from tests.engine.test_reliability import check_hybrid_ledger, fuzz

    rng = random.Random(seed)
    model_seed = rng.choice([0, 1, 3, 4])
    folder, vocab = _hybrid_folder(model_seed)
    shared = rng.random() < 0.5
    kv_format = rng.choice(["auto", "auto", "fp8", "fp4"])
    s = dict(model_seed=model_seed, shared_prefixes=shared, kv_format=kv_format,
             max_num_seqs=rng.choice([1, 2, 3, 4]), max_num_batched_tokens=rng.choice([16, 24, 40]),
             num_blocks=rng.choice([5, 6, 8]), max_tokens=rng.choice([4, 12]),
             num_speculative_tokens=rng.choice([0, 0, 3, 7]))  # fmt: skip
    params = SamplingParams(max_tokens=s["max_tokens"], ignore_eos=True)
    ref = LLM(folder, device="cpu", max_model_len=64, enable_prefix_caching=False,
              kv_format=kv_format)  # fmt: skip
    llm = LLM(folder, device="cpu", max_model_len=64, kv_format=kv_format,
              max_num_seqs=s["max_num_seqs"], max_num_batched_tokens=s["max_num_batched_tokens"],
              num_blocks=s["num_blocks"],
              num_speculative_tokens=s["num_speculative_tokens"])  # fmt: skip
    core, m = llm.engine, llm.parts.manager
    num_blocks = llm.parts.num_blocks

    prefixes = [[rng.randrange(vocab) for _ in range(40)] for _ in range(3)] if shared else ()
    checked = fuzz(llm, ref, rng, vocab=vocab, params=params, ops=ops, max_prompt=40,
                   bad=[[vocab], [-1], [2.0], [1] * 70],
                   check=lambda: check_hybrid_ledger(llm, shared),
                   prefixes=prefixes)  # fmt: skip
    if m.request_ids() or m.num_free_blocks() != num_blocks - 1:
        raise AssertionError("blocks or requests left after the run")
    return {**s, "compared": checked, "preemptions": core.scheduler.num_preemptions}


# --- server -----------------------------------------------------------------------------------


_PICK = {"type": "object", "properties": {"c": {"enum": ["x", "y"]}}, "required": ["c"]}
_FORMATS = [  # JSON mode, a schema, an unsupported schema (a 400)
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "pick", "schema": _PICK}},
    {"type": "json_schema", "json_schema": {"schema": {"properties": {"a": {"pattern": "x"}}}}},
]


def _request_body(rng: random.Random, words: list[str]) -> tuple[str, dict]:
    """A random completions / chat body; about one in twelve has an invalid field."""

    def text() -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))

    chat = rng.random() < 0.4
    b: dict = {"model": "tiny-llama", "max_tokens": rng.choice([1, 4, 16, 40])}
    if chat:
        b["messages"] = [{"role": "user", "content": text()}]
    else:
        ids = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
        b["prompt"] = rng.choice([text(), ids, [text(), text()]])
    optional = [
        ("temperature", [0, 0.7, 1.0], 0.5), ("top_p", [0.5, 0.9], 0.2), ("top_k", [1, 5], 0.2),
        ("seed", list(range(100)), 0.2), ("n", [1, 2, 3], 0.2), ("stop", ["a", ["w1", "b"]], 0.15),
        ("presence_penalty", [0.5, -1.0], 0.15), ("repetition_penalty", [1.3], 0.1),
        ("min_tokens", [3], 0.1), ("response_format", _FORMATS, 0.08),
    ]  # fmt: skip
    for key, values, p in optional:
        if rng.random() < p:
            b[key] = rng.choice(values)
    if rng.random() < 0.1:
        b["logit_bias"] = {str(rng.randrange(256)): rng.choice([-100, 5])}
    if rng.random() < 0.15:
        b.update({"logprobs": True, "top_logprobs": 3} if chat else {"logprobs": 2})
    if not chat and rng.random() < 0.08:
        b["echo"] = True
    if not chat and "n" not in b and rng.random() < 0.08:
        b["best_of"] = 2
    if rng.random() < 0.08:
        key, value = rng.choice([("max_tokens", -1), ("temperature", -2), ("n", 99),
                                 ("top_p", 5), ("logit_bias", {"x": 1}), ("stop", 5)])  # fmt: skip
        b[key] = value
    return ("/v1/chat/completions" if chat else "/v1/completions"), b


def soak_server(seconds: float, seed: int, *, threads: int = 8, per_thread: int = 15) -> int:
    """Rounds of random concurrent traffic against a served tiny Llama; returns failures."""
    import httpx
    import torch
    import uvicorn

    sys.path.insert(0, str(ROOT / "tests" / "server"))
    from server_testlib import API_KEY, WORDS, make_model_folder

    from kvplan import LLM, SamplingParams
    from kvplan.server.app import build_app
    from tests.engine.test_reliability import all_free

    torch.set_num_threads(1)
    folder = make_model_folder(pathlib.Path(tempfile.mkdtemp()) / "tiny-llama")
    engine = dict(device="cpu", block_size=8, max_model_len=256, chat_template=False)
    llm = LLM(str(folder), max_num_seqs=8, num_blocks=60, num_speculative_tokens=2, **engine)
    ref = LLM(str(folder), **engine)
    app = build_app(llm, api_key=API_KEY, max_live_requests=12)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    problems: list[str] = []

    def client(cseed: int) -> None:
        rng = random.Random(cseed)
        with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
            for _ in range(per_thread):
                path, body = _request_body(rng, WORDS)
                try:
                    if rng.random() < 0.4 and "best_of" not in body:
                        body["stream"] = True
                        with c.stream("POST", path, json=body) as r:
                            if r.status_code >= 500 and r.status_code != 503:
                                problems.append(f"{r.status_code} (stream) for {body}")
                            cut = rng.randint(0, 4) if rng.random() < 0.3 else None
                            for i, _ in enumerate(r.iter_lines()):
                                if cut is not None and i > cut:
                                    break  # the client leaves: the server must abort
                    else:
                        r = c.post(path, json=body)
                        if r.status_code >= 500 and r.status_code != 503:
                            problems.append(f"{r.status_code} for {body}: {r.text[:200]}")
                except Exception as exc:
                    problems.append(f"{exc!r} for {body}")

    rounds, end = 0, time.monotonic() + seconds
    greedy = {"model": "tiny-llama", "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0}
    want = ref.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0))[0].text
    try:
        while rounds == 0 or time.monotonic() < end:
            workers = [threading.Thread(target=client, args=(seed * 1000 + rounds * 100 + i,))
                       for i in range(threads)]  # fmt: skip
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            idle_by = time.monotonic() + 30
            while (app.state.engine.num_live or llm.engine.has_unfinished()) and (
                time.monotonic() < idle_by
            ):
                time.sleep(0.05)
            if not all_free(llm):
                problems.append(f"round {rounds}: blocks or requests left after the round")
            got = httpx.post(url + "/v1/completions", headers=headers, json=greedy).json()
            if got["choices"][0]["text"] != want:
                problems.append(f"round {rounds}: greedy {got['choices'][0]['text']!r} != {want!r}")
            rounds += 1
            print(f"round {rounds}: {len(problems)} problems", flush=True)
    finally:
        server.should_exit = True
    for p in problems:
        print("FAIL", p, flush=True)
    return len(problems)


_STRUCTURED_MODEL: list = []  # (LLM, token bytes), built by the first structured run


def _structured_schemas() -> list:
    """Schemas of the structured soak: nested objects, bounded arrays, enums, unions (one of
    alternatives that start alike), a recursive ``$ref`` and a forced tool call
    (`JsonSchema.tool_call`)."""
    from kvplan.engine.json_schema import JsonSchema

    item = {"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                                             "tag": {"enum": ["a", "b", None]}}, "required": ["id"]}  # fmt: skip
    tree = {"type": "object", "properties": {"v": {"type": ["number", "null"]},
                                             "kids": {"type": "array", "items": {"$ref": "#"},
                                                      "maxItems": 2}}, "required": ["v"]}  # fmt: skip
    return [
        JsonSchema({"type": "array", "items": item, "minItems": 1, "maxItems": 3}),
        JsonSchema(tree),
        JsonSchema({"type": "object", "properties": {"s": {"type": "string"}, "any": {}}}),
        JsonSchema(
            {
                "type": "array",
                "items": {"anyOf": [item, tree, {"type": "integer"}, {"enum": [1, 2.5, "s"]}]},
            }
        ),  # fmt: skip
        JsonSchema.tool_call(
            [
                ("f", {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}),
                ("g", {"type": "object"}),
            ]
        ),  # fmt: skip
    ]


def run_structured(seed: int, ops: int = 24) -> dict:
    """One batch of ``ops`` requests on a random byte-level-tokenizer Llama: JSON mode,
    schemas and tool calls mixed with plain sampling, random temperatures, seeds, lengths and
    async scheduling. Every guided output is a prefix of a valid text, and a finished one a
    whole one; every block is free afterwards."""
    from kvplan import LLM, SamplingParams
    from kvplan.engine.json_mode import complete, start_state, step, token_bytes
    from tests.engine.test_json_mode import make_json_model_folder
    from tests.engine.test_reliability import all_free

    if not _STRUCTURED_MODEL:
        folder = make_json_model_folder(pathlib.Path(tempfile.mkdtemp()) / "json-llama", seed=3)
        llm = LLM(str(folder), device="cpu", block_size=8, num_blocks=120, max_num_seqs=8)
        _STRUCTURED_MODEL[:] = [llm, token_bytes(llm.tokenizer), _structured_schemas()]
    llm, pieces, schemas = _STRUCTURED_MODEL
    rng = random.Random(seed)
    llm.engine.async_scheduling = rng.random() < 0.5
    guides, params = [], []
    for _ in range(ops):
        kind = rng.randrange(len(schemas) + 2)
        sp = dict(max_tokens=rng.choice([8, 40, 90]), temperature=rng.choice([0.0, 0.8, 1.2]),
                  seed=rng.randrange(1000))  # fmt: skip
        if kind < len(schemas):
            guides.append(schemas[kind])
            params.append(SamplingParams(json_schema=schemas[kind], **sp))
        elif kind == len(schemas):
            guides.append("json")
            params.append(SamplingParams(json_mode=True, **sp))
        else:
            guides.append(None)
            params.append(SamplingParams(**sp))
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 30))] for _ in range(ops)]
    outs = llm.generate(prompts, params)
    finished = 0
    for guide, out in zip(guides, outs):
        if guide is None:
            continue
        data = b"".join(pieces[t] for t in out.token_ids if pieces[t] is not None)
        st = start_state() if guide == "json" else guide.start_state()
        fn = step if guide == "json" else guide.step
        for b in data:
            st = fn(st, b)
            if st is None:
                raise AssertionError(f"seed {seed}: {data!r} is not a prefix for {guide}")
        if out.finish_reason == "stop":
            done = complete(st) if guide == "json" else guide.complete(st)
            if not done:
                raise AssertionError(f"seed {seed}: {data!r} stopped before its end")
            finished += 1
    if not all_free(llm):
        raise AssertionError(f"seed {seed}: blocks or requests left after the batch")
    return {"requests": ops, "guided_finished": finished}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["dense", "hybrid", "server", "structured"])
    ap.add_argument("--seconds", type=float, default=600.0, help="time budget (at least one run)")
    ap.add_argument("--seed", type=int, default=1000, help="the first run's seed (then +1 a run)")
    ap.add_argument("--runs", type=int, default=0, help="exactly this many runs (0: the budget)")
    ap.add_argument("--ops", type=int, default=0, help="operations a fuzz run (0: the default)")
    args = ap.parse_args(argv)
    if args.mode == "server":
        return int(soak_server(args.seconds, args.seed) > 0)
    run = {"dense": run_dense, "hybrid": run_hybrid, "structured": run_structured}[args.mode]
    failures, seed, done = 0, args.seed, 0
    end = time.monotonic() + args.seconds
    while done < args.runs if args.runs else (done == 0 or time.monotonic() < end):
        try:
            info = run(seed, args.ops) if args.ops else run(seed)
            print(f"ok seed={seed} {info}", flush=True)
        except Exception:
            failures += 1
            print(f"FAIL seed={seed}\n{traceback.format_exc()}", flush=True)
        seed, done = seed + 1, done + 1
    print(f"{args.mode}: {done} runs, {failures} failed", flush=True)
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(main())
