"""The ``multitoken`` command line. Each subcommand lives in its own module exposing
``register(subparsers)``; errors of the package family print without a traceback."""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import MultitokenError

# Modules that each add one or more subcommands, in --help order.
COMMAND_MODULES = (
    "multitoken.pipeline.cmd_generate",
    "multitoken.pipeline.cmd_convert",
    "multitoken.pipeline.cmd_attach",
    "multitoken.pipeline.cmd_train",
    "multitoken.pipeline.cmd_distill",
    "multitoken.stats.cli",
    "multitoken.pipeline.cmd_eval",
    "multitoken.pipeline.cmd_sweep",
)


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    parser = argparse.ArgumentParser(
        prog="multitoken",
        description="Make causal LMs emit several tokens per forward pass.",
    )
    parser.add_argument("--version", action="version", version=f"multitoken {version('multitoken')}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except MultitokenError as err:
        print(f"multitoken {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"multitoken {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
