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
    held to the end; --resume continues this run's own output, which is not an overwrite. Under
    torchrun only the main process (RANK 0) locks: the others write nothing."""
    from multitoken.pipeline.train.checkpoint import list_checkpoints  # lazy: torch

    if cfg.out and Path(cfg.out).name and not cfg.resume and list_checkpoints(cfg.ckpt_dir()):
        raise UsageError(f"{cfg.ckpt_dir()} already holds checkpoints of a run",
                         "pass --resume to continue it (a finished run then changes nothing), or another --checkpoint-dir")
    inputs = (cfg.heads, data.data, cfg.eval_data, cfg.backbone.base)
    with contextlib.ExitStack() as stack:
        def claim(path, kind, **flags):
            if os.environ.get("RANK", "0") == "0":
                stack.enter_context(claim_output(path, kind, inputs=inputs, **flags))
            else:
                prepare_output(path, kind, inputs=inputs, **flags)

        claim(cfg.out, "heads", overwrite=overwrite, resume=cfg.resume)
        claim(str(cfg.ckpt_dir()), "checkpoints", resume=True, flag="--checkpoint-dir")  # train checks --resume itself
        yield
