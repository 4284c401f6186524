"""``multitoken distill``: sample a training corpus from the base model itself."""

from __future__ import annotations

import json

from multitoken.pipeline.model.backbone import BackboneConfig
from multitoken.pipeline.train.distill import DistillConfig
from multitoken.base.config_io import save_resolved_config
from multitoken.base.outputs import add_overwrite_flag, prepare_output_file
from multitoken.pipeline.cli import add_command, threads_for_batches
from multitoken.pipeline.cli.args import dataclass_from_args


def register(sub) -> None:
    parser = add_command(sub, "distill", DistillConfig, BackboneConfig, run=run)
    add_overwrite_flag(parser)
    threads_for_batches(parser)  # distill samples batches, not one sequence


def run(args) -> None:
    from multitoken.pipeline.model.backbone import load_backbone  # lazy: torch
    from multitoken.pipeline.train.distill import distill, validate  # lazy: torch

    cfg = dataclass_from_args(DistillConfig, args)
    bb_cfg = dataclass_from_args(BackboneConfig, args)
    validate(cfg, context=1 << 30)  # cheap checks before loading the model
    prepare_output_file(cfg.out, overwrite=args.overwrite, inputs=(bb_cfg.base,), sidecars=(".config.json",))
    summary = distill(load_backbone(bb_cfg), cfg)
    save_resolved_config(cfg.out + ".config.json", "distill", cfg, bb_cfg)
    print(json.dumps(summary))
