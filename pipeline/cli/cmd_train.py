"""``multitoken train``: train heads (optionally with LoRA on the backbone) on a dataset.

Run it under ``torchrun --nproc-per-node N $(which multitoken) train ...`` for data-parallel
training; the flags are the same.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from multitoken.base.data import DataConfig
from multitoken.pipeline.train.trainer_config import TrainConfig
from multitoken.base.errors import UsageError
from multitoken.base.outputs import add_overwrite_flag, claim_output, prepare_output
from multitoken.pipeline.cli import add_command
from multitoken.pipeline.cli.args import dataclass_from_args


def register(sub) -> None:
    add_overwrite_flag(add_command(sub, "train", TrainConfig, DataConfig, run=run))


def run(args) -> None:
    from multitoken.pipeline.train.train import format_summary, train  # lazy: torch

    cfg = dataclass_from_args(TrainConfig, args)
    data = dataclass_from_args(DataConfig, args)
    with _claim_outputs(cfg, data, args.overwrite):
        if not data.data:
            raise UsageError("no training data given", "pass --data FILE|DIR|GLOB|HUB_ID")
        summary = train(cfg, data)
    if summary["eval"]:  # the main process (the others have no evaluation)
        print(format_summary(summary))


@contextlib.contextmanager
def _claim_outputs(cfg, data, overwrite: bool):
    """--out and the checkpoint dir beside it, checked and locked before anything loads and
    held to the end; --resume continues this run's own checkpoint, which is not an overwrite
    (without one, --out is written anew). Under torchrun only the main process (RANK 0) locks:
    the others write nothing."""
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
    with contextlib.ExitStack() as stack:
        def claim(path, kind, **flags):
            if os.environ.get("RANK", "0") == "0":
                stack.enter_context(claim_output(path, kind, inputs=inputs, **flags))
            else:
                prepare_output(path, kind, inputs=inputs, **flags)

        claim(cfg.out, "heads", overwrite=overwrite, resume=resume)
        claim(str(cfg.ckpt_dir()), "checkpoints", resume=True, flag="--checkpoint-dir")  # train checks --resume itself
        yield
