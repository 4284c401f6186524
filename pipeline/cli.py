"""The ``multitoken`` command line. Each subcommand lives in its own module exposing
``register(subparsers)``; errors of the package family print without a traceback."""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import MultitokenError

# Subcommand -> (the module whose ``register(subparsers)`` adds it, its one-line help), in
# --help order. Only the chosen command's module is imported: most import torch (~2 s), which
# ``multitoken --help`` and a mistyped command should not wait for.
COMMANDS = {
    "generate": ("multitoken.pipeline.cmd_generate", "generate text from a prompt with multi-token decoding (default: the embedded model)"),
    "convert-llama2c": ("multitoken.pipeline.cmd_convert", "convert a llama2.c .bin checkpoint to a Hugging Face Llama"),
    "attach": ("multitoken.pipeline.cmd_attach", "create an untrained heads dir for a base model"),
    "train": ("multitoken.pipeline.cmd_train", "train a heads dir on a dataset (heads only, joint LoRA, warm-up, DynaMo rates)"),
    "distill": ("multitoken.pipeline.cmd_distill", "sample a self-distillation corpus (jsonl) from the base model"),
    "stats": ("multitoken.stats.cli", "co-occurrence statistics: build, merge, info"),
    "eval": ("multitoken.pipeline.cmd_eval", "PPL_n, PPL_1:n, PPL_d, top-k, marginalization baseline, logit lens"),
    "sweep": ("multitoken.pipeline.cmd_sweep", "dynamic decoding over prompts x seeds x eps_b vs ar sampling: JSON, CSV, PNG"),
}


def add_command(sub, name: str, *configs, run=None) -> argparse.ArgumentParser:
    """The subparser of ``name``: its help, one flag per field of each dataclass in ``configs``,
    and ``run(args)`` as its action. Called by the command's own ``register``."""
    from .cliargs import add_dataclass_args

    summary = COMMANDS[name][1]
    parser = sub.add_parser(name, help=summary, description=summary)
    for config in configs:
        add_dataclass_args(parser, config)
    if run is not None:
        parser.set_defaults(func=run)
    return parser


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command`` (None: none) gets its full flags."""
    from importlib.metadata import version

    parser = argparse.ArgumentParser(
        prog="multitoken",
        description="Make causal LMs emit several tokens per forward pass.",
    )
    parser.add_argument("--version", action="version", version=f"multitoken {version('multitoken')}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, summary) in COMMANDS.items():
        if name == command:
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name, help=summary)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)  # no option takes a value before it
    args = build_parser(command).parse_args(argv)
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
