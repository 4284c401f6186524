"""Shared pieces of the training tests: a learnable corpus and heads dirs on tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


def phrase_corpus(path: Path, docs: int = 60, seed: int = 0) -> Path:
    """Documents made of a few fixed 5-token phrases: token t+2 follows from token t, so heads
    beyond the first have something to learn quickly."""
    rng = np.random.default_rng(seed)
    phrases = rng.choice(np.arange(10, 500), size=(8, 5), replace=False)
    lines = []
    for _ in range(docs):
        picks = rng.integers(0, len(phrases), size=int(rng.integers(4, 12)))
        lines.append(json.dumps({"input_ids": phrases[picks].reshape(-1).tolist()}))
    path.write_text("\n".join(lines) + "\n")
    return path


def make_heads_dir(base: Path, out: Path, n: int = 3, head_type: str = "replicated", seed: int = 0, **options) -> Path:
    from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
    from multitoken.pipeline.model.model import MultiTokenModel

    torch.manual_seed(seed)
    backbone = load_backbone(BackboneConfig(base=str(base)))
    MultiTokenModel.attach(backbone, {"head_type": head_type, "n_future": n, **options}).save_heads(out)
    return out


def load_trained(base: Path, heads_dir: Path):
    from multitoken.pipeline.model.model import MultiTokenModel

    return MultiTokenModel.from_pretrained(str(base), heads_dir)


def train_cfg(heads: Path, out: Path, **kw):
    from multitoken.pipeline.train.trainer_config import TrainConfig

    defaults = dict(heads=str(heads), out=str(out), max_steps=6, seq_len=32, batch_size=4, lr=5e-3,
                    eval_every=0, eval_batches=1, save_every=0, progress=False)
    return TrainConfig(**{**defaults, **kw})


def head_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.heads.state_dict().items()}
