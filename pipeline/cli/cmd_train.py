"""``multitoken train``: train heads (optionally with LoRA on the backbone) on a dataset.

Run it under ``torchrun --nproc-per-node N $(which multitoken) train ...`` for data-parallel
training; the flags are the same.
"""

from __future__ import annotations

from multitoken.base.data import DataConfig
from multitoken.pipeline.train.trainer_config import TrainConfig
from multitoken.base.errors import UsageError
from multitoken.base.outputs import add_overwrite_flag, prepare_output
from multitoken.pipeline.cli import add_command
from multitoken.pipeline.cli.args import dataclass_from_args


def register(sub) -> None:
    add_overwrite_flag(add_command(sub, "train", TrainConfig, DataConfig, run=run))


def run(args) -> None:
    from multitoken.pipeline.train.train import format_summary, train  # lazy: torch

    cfg = dataclass_from_args(TrainConfig, args)
    data = dataclass_from_args(DataConfig, args)
    _check_out(cfg, data, args.overwrite)
    if not data.data:
        raise UsageError("no training data given", "pass --data FILE|DIR|GLOB|HUB_ID")
    summary = train(cfg, data)
    if summary["eval"]:  # the main process (the others have no evaluation)
        print(format_summary(summary))

def _check_out(cfg, data, overwrite: bool) -> None:
    """--out (and the checkpoint dir beside it) before anything loads; --resume continues this
    run's own output, which is not an overwrite."""
    from pathlib import Path

    from multitoken.pipeline.model.heads_io import CONFIG_FILE as HEADS_CONFIG  # lazy: torch
    from multitoken.pipeline.train.checkpoint import list_checkpoints  # lazy: torch

    checkpoints = bool(cfg.out and Path(cfg.out).name and list_checkpoints(cfg.ckpt_dir()))
    if checkpoints and not cfg.resume:
        raise UsageError(f"{cfg.ckpt_dir()} already holds checkpoints of a run",
                         "pass --resume to continue it (a finished run then changes nothing), or another --checkpoint-dir")
    resume = cfg.resume and checkpoints  # resuming means a checkpoint: without one --out is written anew
    if cfg.resume and not checkpoints and (Path(cfg.out) / HEADS_CONFIG).is_file() and not overwrite:
        raise UsageError(f"--resume: {cfg.ckpt_dir()} holds no checkpoint to continue from, and --out {cfg.out} already holds heads",
                         "pass --checkpoint-dir where this run's checkpoints are, another --out, or --overwrite to train new heads over these")
    inputs = (cfg.heads, data.data, cfg.eval_data, cfg.backbone.base)
    prepare_output(cfg.out, "heads", overwrite=overwrite, inputs=inputs, resume=resume)
    prepare_output(str(cfg.ckpt_dir()), "checkpoints", inputs=inputs, resume=True)  # train checks --resume itself
