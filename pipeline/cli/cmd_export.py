"""``multitoken export``: heads trained here, in the checkpoint layout a serving engine reads.

``--format medusa`` writes medusa heads in vLLM's ``medusa`` speculative-model layout
(``pipeline/model/export_medusa.py``); ``multitoken import`` reads such a checkpoint back.
``--format eagle3`` writes eagle3 drafter heads in EAGLE-3's checkpoint layout, which vLLM,
SGLang and llama.cpp's converter load (``pipeline/model/export_eagle3.py``).
The destination is checked before the heads load, and the export is published all or nothing
with its record, as every command's output is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from multitoken.base.errors import UsageError
from multitoken.base.outputs import claim_output
from multitoken.pipeline.cli import add_command
from multitoken.pipeline.cli.args import dataclass_from_args

FORMATS = ("medusa", "eagle3")
LM_HEADS = ("shared", "copies")  # export_medusa.LM_HEADS (not imported here: it pulls torch)


@dataclass
class ExportConfig:
    format: str = field(default="medusa", metadata={"help": "the layout to write: medusa (vLLM's medusa speculative model) "
                                                            "or eagle3 (EAGLE-3's drafter checkpoint: vLLM, SGLang, llama.cpp)",
                                                    "choices": FORMATS})
    heads: str | None = field(default=None, metadata={"help": "heads dir to export (medusa heads for --format medusa, "
                                                               "eagle3 heads for --format eagle3)"})
    out: str | None = field(default=None, metadata={"help": "directory to write (new or empty, or an export of ours with --overwrite)"})
    base: str | None = field(default=None, metadata={"help": "the base the heads were trained on, when it moved "
                                                              "(default: the base recorded in --heads)"})
    lm_heads: str = field(default="shared", metadata={
        "help": "shared: one copy of the base's unembedding, read by vLLM as every head's lm head (original_lm_head); "
                "copies: one copy per head, for readers without that option (--format medusa only)", "choices": LM_HEADS})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing output of this command in --out (only the files its record lists; others stay)"})


def register(sub) -> None:
    add_command(sub, "export", ExportConfig, run=run)


def run(args) -> None:
    cfg = dataclass_from_args(ExportConfig, args)
    if not cfg.heads:
        raise UsageError("export needs --heads", "pass the heads dir to export, e.g. --heads my-heads/")
    if cfg.format == "eagle3":
        return _eagle3(cfg)
    with claim_output(cfg.out, "medusa-export", overwrite=cfg.overwrite, inputs=(cfg.heads, cfg.base)) as out:
        from multitoken.pipeline.model.export_medusa import check_exportable, write_medusa  # lazy: torch
        from multitoken.pipeline.model.model import MultiTokenModel  # lazy: torch

        check_exportable(cfg.heads)  # before the (slow) base load
        model = MultiTokenModel.from_pretrained(cfg.base, cfg.heads)
        write_medusa(model, out, lm_heads=cfg.lm_heads)
    print(f"exported {model.n_future - 1} medusa heads ({model.config.num_blocks} block(s) each) of {cfg.heads} "
          f"in vLLM's medusa layout -> {out}")


def _eagle3(cfg: ExportConfig) -> None:
    if cfg.lm_heads != "shared":
        raise UsageError("--lm-heads applies to --format medusa only", "leave it out with --format eagle3")
    with claim_output(cfg.out, "eagle3-export", overwrite=cfg.overwrite, inputs=(cfg.heads, cfg.base)) as out:
        from multitoken.pipeline.model.export_eagle3 import check_exportable, write_eagle3  # lazy: torch
        from multitoken.pipeline.model.model import MultiTokenModel  # lazy: torch

        check_exportable(cfg.heads)  # before the (slow) base load
        model = MultiTokenModel.from_pretrained(cfg.base, cfg.heads)
        write_eagle3(model, out)
    heads = model.heads
    print(f"exported the eagle3 drafter of {cfg.heads} (layers {heads.config.aux_layers} fused, draft vocabulary "
          f"{heads.draft_head.out_features} of {model.backbone.vocab_size}) in EAGLE-3's layout -> {out}\n"
          f"llama.cpp: python convert_hf_to_gguf.py {out} --target-model-dir BASE_DIR")
