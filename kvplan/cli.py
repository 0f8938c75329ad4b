"""Command line: ``kvplan kv-demo | generate | serve | bench``.

Each subcommand lives in its own module; this file only routes, so ``kvplan --help`` is fast.
Completions go to stdout; logs and progress go to stderr. A ValueError, TypeError,
RuntimeError or OSError while building or running is printed as one line on stderr (exit
status 2).
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help). The module defines ``add_arguments(parser)`` and
# ``run(args) -> int``.
_COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("kvplan.engine.cli_generate", "generate a completion with a real model"),
    "serve": ("kvplan.server.cli_serve", "OpenAI-compatible HTTP server on the engine"),
    "bench": ("kvplan.engine.cli_bench", "throughput benchmark on random-weight models"),
    "kv-demo": ("kvplan.demo", "store/load round trip of every KV cache format"),
}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="kvplan", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.set_defaults(_module=module_name)
        # Arguments are registered lazily: only the chosen subcommand's module is imported.
    args, rest = parser.parse_known_args(argv)
    module = importlib.import_module(args._module)
    sub_parser = argparse.ArgumentParser(
        prog=f"kvplan {args.command}", description=_COMMANDS[args.command][1]
    )
    module.add_arguments(sub_parser)
    sub_args = sub_parser.parse_args(rest)
    try:
        return int(module.run(sub_args) or 0)
    except (ValueError, TypeError, RuntimeError, OSError) as exc:  # bad settings, no device, ...
        print(f"kvplan {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
