"""``multitoken distill``: sample a training corpus from the base model itself."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from multitoken.pipeline.model.loading import BackboneConfig
from multitoken.pipeline.train.distill import DistillConfig
from multitoken.base.config_io import save_resolved_config
from multitoken.base.outputs import CONFIG_SUFFIX, CORPUS, add_overwrite_flag, claim_file
from multitoken.base.publish import staged_file
from multitoken.pipeline.cli import add_command, threads_for_batches
from multitoken.pipeline.cli.args import dataclass_from_args


def register(sub) -> None:
    parser = add_command(sub, "distill", DistillConfig, BackboneConfig, run=run)
    add_overwrite_flag(parser)
    threads_for_batches(parser)  # distill samples batches, not one sequence


def run(args) -> None:
    from multitoken.pipeline.model.loading import load_backbone  # lazy: torch
    from multitoken.pipeline.train.distill import distill, validate  # lazy: torch

    cfg = dataclass_from_args(DistillConfig, args)
    bb_cfg = dataclass_from_args(BackboneConfig, args)
    validate(cfg, context=1 << 30)  # cheap checks before loading the model
    with claim_file(cfg.out, "distill", overwrite=args.overwrite, inputs=(bb_cfg.base,)):
        backbone = load_backbone(bb_cfg)
        name = Path(cfg.out).name
        with staged_file(cfg.out, CORPUS.kind, "distill") as stage:  # all or nothing, recorded
            summary = distill(backbone, dataclasses.replace(cfg, out=str(stage / name)))
            save_resolved_config(stage / (name + CONFIG_SUFFIX), "distill", cfg, bb_cfg)
    print(json.dumps({**summary, "out": cfg.out}))
