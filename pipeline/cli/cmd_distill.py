"""``multitoken distill``: sample a training corpus from the base model itself."""

from __future__ import annotations

import json

from multitoken.pipeline.model.backbone import BackboneConfig
from multitoken.pipeline.train.distill import DistillConfig


def register(sub) -> None:
    from multitoken.pipeline.cli import add_command
    from multitoken.pipeline.cli.args import set_default
    from multitoken.pipeline.base.threads import THREADS_BATCHES, threads_field

    from multitoken.pipeline.base.outputs import add_overwrite_flag

    parser = add_command(sub, "distill", DistillConfig, BackboneConfig, run=run)
    add_overwrite_flag(parser)
    # distill samples batches, not one sequence
    set_default(parser, "threads", THREADS_BATCHES, threads_field(THREADS_BATCHES).metadata)


def run(args) -> None:
    from multitoken.pipeline.model.backbone import load_backbone
    from multitoken.pipeline.base.config_io import save_resolved_config
    from multitoken.pipeline.cli.args import dataclass_from_args
    from multitoken.pipeline.train.distill import distill, validate
    from multitoken.pipeline.base.outputs import prepare_output_file

    cfg = dataclass_from_args(DistillConfig, args)
    bb_cfg = dataclass_from_args(BackboneConfig, args)
    validate(cfg, context=1 << 30)  # cheap checks before loading the model
    prepare_output_file(cfg.out, overwrite=args.overwrite, inputs=(bb_cfg.base,), sidecars=(".config.json",))
    summary = distill(load_backbone(bb_cfg), cfg)
    save_resolved_config(cfg.out + ".config.json", "distill", cfg, bb_cfg)
    print(json.dumps(summary))
