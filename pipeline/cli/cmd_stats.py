"""``multitoken stats build | merge | info``."""

from __future__ import annotations

from dataclasses import dataclass, field

from multitoken.base.config_io import resolved_config_text
from multitoken.base.data import DataConfig
from multitoken.base.errors import CheckpointError
from multitoken.base.outputs import add_overwrite_flag, claim_output
from multitoken.base.tokenizer import load_tokenizer
from multitoken.pipeline.cli import add_command
from multitoken.pipeline.cli.args import add_dataclass_args, dataclass_from_args
from multitoken.stats.info import summary
from multitoken.stats.job import BuildConfig, build, merge
from multitoken.stats.table import CooccurrenceTable


@dataclass
class MergeConfig:
    inputs: tuple[str, ...] = field(default=(), metadata={"positional": True, "nargs": "+", "help": "directories holding partials (the --out of each `stats build --shard I/N`)"})
    out: str | None = field(default=None, metadata={"help": "stats directory to write"})
    min_count: tuple[int, ...] = field(default=(1,), metadata={"help": "prune n-grams rarer than this: one value for orders 2..N, or one per order 1..N"})
    num_proc: int = field(default=1, metadata={"help": "merge key ranges on this many processes"})
    memory_mb: int = field(default=1024, metadata={"help": "memory bound per process"})


@dataclass
class InfoConfig:
    dir: str = field(default="", metadata={"positional": True, "help": "stats directory"})
    top: int = field(default=10, metadata={"help": "pairs to list by PMI"})
    min_pair_count: int = field(default=10, metadata={"help": "only list pairs seen at least this often"})


BUILD_HELP = "count unigrams..trigrams of a corpus into a stats dir (resumable)"
BUILD_DESCRIPTION = (
    "Count the unigrams, bigrams and trigrams of a corpus, tokenized with the base model's tokenizer, "
    "into a stats dir that dynamic decoding (DynaMo's co-occurrence mask) and the joint drafter read. "
    "A killed run resumes where it stopped when run again with the same options. Large corpora can be "
    "split across machines with --shard I/N and joined with `multitoken stats merge`.")
MERGE_HELP = "merge the partials of shards counted separately (--shard I/N)"
MERGE_DESCRIPTION = (
    "Join the partial counts written by `multitoken stats build --shard I/N` on several machines into "
    "one stats dir. Every shard must be given exactly once; the counts are pruned with --min-count.")
INFO_HELP = "summarise a stats dir"
INFO_DESCRIPTION = (
    "Print what a stats dir holds: its tokenizer, the corpus size, the n-grams kept per order, and the "
    "token pairs with the highest pointwise mutual information (as text when the tokenizer is at hand).")


def register(sub) -> None:
    p = add_command(sub, "stats")
    ssub = p.add_subparsers(dest="stats_command", metavar="SUBCOMMAND", required=True)
    b = ssub.add_parser("build", help=BUILD_HELP, description=BUILD_DESCRIPTION)
    add_dataclass_args(b, BuildConfig)
    add_dataclass_args(b, DataConfig)
    add_overwrite_flag(b)
    b.set_defaults(func=run_build)
    m = ssub.add_parser("merge", help=MERGE_HELP, description=MERGE_DESCRIPTION)
    add_dataclass_args(m, MergeConfig)
    add_overwrite_flag(m)
    m.set_defaults(func=run_merge)
    i = ssub.add_parser("info", help=INFO_HELP, description=INFO_DESCRIPTION)
    add_dataclass_args(i, InfoConfig)
    i.set_defaults(func=run_info)


def run_build(args) -> None:
    cfg, data = dataclass_from_args(BuildConfig, args), dataclass_from_args(DataConfig, args)
    with claim_output(cfg.out, "stats", overwrite=args.overwrite, inputs=(data.data, cfg.tokenizer), resume=True):
        out = build(cfg, data, overwrite=args.overwrite)  # a local --work-dir is claimed there, once it is resolved
    if out is not None:
        print(f"wrote {out}")


def run_merge(args) -> None:
    cfg = dataclass_from_args(MergeConfig, args)
    with claim_output(cfg.out, "stats", overwrite=args.overwrite, inputs=cfg.inputs):
        merge(list(cfg.inputs), cfg.out, cfg.min_count, cfg.num_proc, cfg.memory_mb,
              config=resolved_config_text("stats merge", cfg))
    print(f"wrote {cfg.out}")


def run_info(args) -> None:
    cfg = dataclass_from_args(InfoConfig, args)
    name = CooccurrenceTable(cfg.dir).meta["tokenizer"]["name"]  # load_tokenizer resolves embedded:NAME
    print(summary(cfg.dir, cfg.top, cfg.min_pair_count, tokenizer=_try_tokenizer(name)))


def _try_tokenizer(name: str | None):
    """The stats' tokenizer, to show pairs as text; ids are shown if it is not available here."""
    if not name:
        return None
    try:
        return load_tokenizer(name)
    except CheckpointError:
        return None
