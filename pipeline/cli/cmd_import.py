"""``multitoken import``: a Medusa checkpoint (vLLM's or FasterDecoding's layout) as a heads dir.

The checkpoint's heads become our medusa heads on ``--base``, weight for weight; what they
cannot hold exactly (an lm head other than the base's unembedding, a truncated draft
vocabulary) is refused with one line (``pipeline/model/export_medusa.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from multitoken.pipeline.model.loading import BackboneConfig
from multitoken.base.config_io import resolved_config_text
from multitoken.base.errors import UsageError
from multitoken.base.outputs import claim_output
from multitoken.pipeline.cli import add_command
from multitoken.pipeline.cli.args import dataclass_from_args, set_default

RESOLVED_CONFIG = "import_config.json"


@dataclass
class ImportConfig:
    checkpoint: str = field(default="", metadata={"positional": True, "help": "directory of the Medusa checkpoint"})
    format: str = field(default="medusa", metadata={"help": "the checkpoint's format", "choices": ("medusa",)})
    out: str | None = field(default=None, metadata={"help": "heads directory to create"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing output of this command in --out (only the files its record lists; others stay)"})


def register(sub) -> None:
    parser = add_command(sub, "import", ImportConfig, BackboneConfig, run=run)
    set_default(parser, "base", None, {"help": "Hub id, local directory, or embedded:NAME of the base the heads were "
                                               "trained for (required)"})


def run(args) -> None:
    cfg = dataclass_from_args(ImportConfig, args)
    bb_cfg = dataclass_from_args(BackboneConfig, args)
    if not bb_cfg.base:
        raise UsageError("import needs --base", "pass the base model the Medusa heads were trained for")
    with claim_output(cfg.out, "heads", overwrite=cfg.overwrite, inputs=(cfg.checkpoint, bb_cfg.base)) as out:
        from multitoken.pipeline.model.loading import load_backbone  # lazy: torch
        from multitoken.pipeline.model.export_medusa import heads_from_checkpoint, read_medusa  # lazy: torch

        ckpt = read_medusa(cfg.checkpoint)  # checked before the (slow) base load
        model = heads_from_checkpoint(ckpt, load_backbone(bb_cfg))
        extra = {RESOLVED_CONFIG: resolved_config_text("import", cfg, bb_cfg, model.config, extra={"layout": ckpt.layout})}
        model.save_heads(out, extra=extra, command="import")
    print(f"imported {model.n_future - 1} medusa heads ({model.config.num_blocks} block(s) each, {ckpt.layout} layout) "
          f"onto {bb_cfg.base} -> {out}")
