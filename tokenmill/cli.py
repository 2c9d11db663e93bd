"""Command line: tokenmill generate | chat | serve | bench | kv-memory | tokenize | pull | list.

Each subcommand lives in its own module with add_parser(subparsers) and run(args); heavy
imports (torch, fastapi) happen inside run(), so `tokenmill --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = {
    "generate": "tokenmill.commands.generate",
    "chat": "tokenmill.commands.chat",
    "serve": "tokenmill.server.cli",
    "bench": "tokenmill.bench.cli",
    "kv-memory": "tokenmill.commands.kv_memory",
    "tokenize": "tokenmill.commands.tokenize",
    "pull": "tokenmill.commands.hub",
    "list": "tokenmill.commands.hub",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    seen = set()
    for module_name in COMMANDS.values():
        if module_name in seen:
            continue
        seen.add(module_name)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if not module_name.startswith(e.name or "-"):
                raise
            continue  # a command not built yet
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # a positional after an option (generate MODEL --raw PROMPT): argparse leaves it
        positional = getattr(args, "args", None)
        if not isinstance(positional, list) or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        positional.extend(extra)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        if args.verbose:
            raise
        print(f"tokenmill {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
