"""``multitoken build-heads``: distil the base, train every head type, measure, write heads dirs.

Rerunning the same command on the same ``--out`` resumes it: finished shards and heads dirs are
kept, the rest is done (the output's record lists the folders it may manage). Under
``torchrun --nproc-per-node N $(which multitoken) build-heads ...`` the processes share the
shards and every step's rows (gloo on the CPU, NCCL with one GPU per process)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

from multitoken.base.config_io import resolved_config_text, save_resolved_config
from multitoken.base.errors import UsageError
from multitoken.base.outputs import RECIPE, claim_output
from multitoken.base.publish import claim_work
from multitoken.pipeline.cli import add_command, threads_for_batches
from multitoken.pipeline.cli.args import dataclass_from_args
from multitoken.pipeline.model.loading import BackboneConfig
from multitoken.pipeline.train.recipe import RecipeConfig

CONFIG = "report/build_config.json"
BEFORE = {"distill_dtype": "float32"}  # what a build recorded before a setting existed did (its resume passes it)


def register(sub) -> None:
    threads_for_batches(add_command(sub, "build-heads", RecipeConfig, BackboneConfig, run=run))


def run(args) -> None:
    import torch  # lazy: torch

    from multitoken.pipeline.model.loading import load_backbone  # lazy: torch
    from multitoken.pipeline.train.recipe import _barrier, build, join_ranks, validate  # lazy: torch

    cfg = dataclass_from_args(RecipeConfig, args)
    bb_cfg = dataclass_from_args(BackboneConfig, args)
    validate(cfg)
    if bb_cfg.device == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # one GPU per process
        bb_cfg = dataclasses.replace(bb_cfg, device=f"cuda:{os.environ.get('LOCAL_RANK', '0')}")
        torch.cuda.set_device(torch.device(bb_cfg.device))
    ranks = join_ranks(torch.device(bb_cfg.device))
    # rank 0 checks, locks and records the output; the others start once it has
    claim = claim_output(cfg.out, RECIPE.kind, resume=True, inputs=(bb_cfg.base, *cfg.data, *cfg.heldout)) \
        if ranks.rank == 0 else contextlib.nullcontext()
    with claim:
        out = Path(cfg.out)
        if ranks.rank == 0:
            claim_work(out, RECIPE.kind, "build-heads", ("distill", "report", *(f"heads-{k}" for k in cfg.heads)))
            _same_build(out, cfg, bb_cfg)
            (out / "report").mkdir(exist_ok=True)
            save_resolved_config(out / CONFIG, "build-heads", cfg, bb_cfg)
        _barrier(ranks)
        report = build(load_backbone(bb_cfg), cfg, log=lambda m: print(m, flush=True))
    if report is not None:
        print(json.dumps({"out": cfg.out, "text": report["text"], "heldout": report["heldout"], "seconds": report["seconds"]}))


def _same_build(out: Path, cfg: RecipeConfig, bb_cfg: BackboneConfig) -> None:
    """A resumed build must be the same build: the settings that shape its shards and heads."""
    path = out / CONFIG
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    new = json.loads(resolved_config_text("build-heads", cfg, bb_cfg))
    shaping = ("data", "heldout", "heldout_prompts", "prompt_len", "prompt_stride", "new_tokens", "sample_every",
               "shard_rows", "distill_batch", "distill_engine", "distill_dtype", "seed", "n_future", "draft_vocab")  # draft_vocab: eagle3's lm_head
    recorded = {**BEFORE, **old.get("RecipeConfig", {})}
    changed = [k for k in shaping if recorded.get(k) != new.get("RecipeConfig", {}).get(k)]
    if old.get("BackboneConfig", {}).get("base") != new.get("BackboneConfig", {}).get("base"):
        changed.insert(0, "base")
    if changed:
        raise UsageError(f"--out {cfg.out} holds a build with another {changed[0]}",
                         "rerun with the same settings to resume it, or pass another --out")
