"""``kvplan serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the engine.

Binds to 127.0.0.1 unless ``--host`` says otherwise; prints ``kvplan serve: listening on
http://HOST:PORT`` (stderr) once the engine is built and the socket is bound. ``--api-key``
(or the ``KVPLAN_API_KEY`` environment variable) makes the ``/v1`` routes require
``Authorization: Bearer KEY``. Engine settings are the `EngineConfig` flags.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvplan.engine.config import add_engine_arguments, config_from_args

_ENGINE_FLAGS = (
    "device",
    "dtype",
    "backend",
    "kv_format",
    "block_size",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "num_blocks",
    "kv_cache_memory",
    "enable_prefix_caching",
    "prefix_state_snapshots",
    "wait_for_shared_prefix",
    "enable_chunked_prefill",
    "num_speculative_tokens",
    "use_cuda_graph",
    "async_scheduling",
    "warmup",
    "seed",
    "sliding_window_kv",
    "tensor_parallel_size",
    "kv_exact_window",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="HF folder, .gguf file, gemma-3-270m or random:<name> (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--served-model-name", default=None, help="the model id clients send")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (0 = any free port)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("KVPLAN_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KVPLAN_API_KEY)",
    )
    parser.add_argument(
        "--max-live-requests",
        type=int,
        default=None,
        help="most requests running or waiting; more get HTTP 503 (default 4 x max_num_seqs)",
    )
    add_engine_arguments(parser, _ENGINE_FLAGS)


def make_server(llm, args: argparse.Namespace):
    """A `uvicorn.Server` for ``llm`` configured from ``args`` (host, port, api key...)."""
    import uvicorn

    from kvplan.server.app import build_app

    app = build_app(
        llm,
        model_name=args.served_model_name,
        api_key=args.api_key,
        max_live_requests=args.max_live_requests,
    )
    cfg = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    return uvicorn.Server(cfg)


def bound_address(server) -> str:
    """``http://host:port`` of a started `uvicorn.Server` (the real port when 0 was asked)."""
    sock = server.servers[0].sockets[0]
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}"


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import asyncio

    from kvplan.engine.llm import LLM

    if args.max_live_requests is not None and args.max_live_requests < 1:
        raise ValueError(f"--max-live-requests must be >= 1, got {args.max_live_requests}")
    llm = LLM(args.model, config_from_args(args), chat_template=False)
    server = make_server(llm, args)

    async def serve() -> None:
        task = asyncio.create_task(server.serve())  # uvicorn handles Ctrl-C / SIGTERM
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(
                f"kvplan serve: listening on {bound_address(server)}", file=sys.stderr, flush=True
            )
        await task

    asyncio.run(serve())
    return 0
