"""``multitoken train``: train heads (optionally with LoRA on the backbone) on a dataset.

Run it under ``torchrun --nproc-per-node N $(which multitoken) train ...`` for data-parallel
training; the flags are the same.
"""

from __future__ import annotations

from .data import DataConfig
from .trainer_config import TrainConfig


def register(sub) -> None:
    from .cli import add_command

    add_command(sub, "train", TrainConfig, DataConfig, run=run)


def run(args) -> None:
    from .cliargs import dataclass_from_args
    from .errors import UsageError
    from .train import format_summary, train

    cfg = dataclass_from_args(TrainConfig, args)
    data = dataclass_from_args(DataConfig, args)
    if not data.data:
        raise UsageError("no training data given", "pass --data FILE|DIR|GLOB|HUB_ID")
    summary = train(cfg, data)
    if summary["eval"]:  # the main process (the others have no evaluation)
        print(format_summary(summary))
