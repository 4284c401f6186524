"""Loading what the commands decode and measure with: heads on their base, the embedded
defaults (trained heads and stats), and co-occurrence stats. One loader for every command."""

from __future__ import annotations

from pathlib import Path

from multitoken.embedded import EMBEDDED_HEADS, default_base, shipped_heads, shipped_stats
from multitoken.base.errors import UsageError
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.pipeline.model.heads_io import read_heads_config
from multitoken.pipeline.model.model import MultiTokenModel
from multitoken.stats.table import CooccurrenceTable


# ``--stats none``: decode / evaluate without a co-occurrence table (no mask), where omitting
# --stats (None) means the default table. The one string value that stands for "no value".
NO_STATS = "none"


def default_heads(base: str | None = None) -> str | None:
    """The trained heads the package ships for ``base`` (None: the embedded default), else None."""
    heads = shipped_heads(base) if base else str(EMBEDDED_HEADS)
    return heads if heads and (Path(heads) / "heads_config.json").is_file() else None


def default_stats(backbone) -> str | None:
    """The stats shipped for this base (the embedded default, the fetched SmolLM2), else None:
    another tokenizer would not match."""
    return shipped_stats(backbone.name)


def backbone_config(heads: str | None, base: str | None = None, **fields):
    """How to load the base of ``heads``: ``base`` when given, else the base recorded in the
    heads dir (else, without heads, the default base). ``fields``: other ``BackboneConfig``
    fields (dtype, device, quantization, threads)."""
    if not base:
        base = read_heads_config(heads)["base"] if heads else default_base()
    return BackboneConfig(base=str(base), **fields)


def load_model(heads: str | None, base: str | None = None, dtype: str = "float32", device: str = "cpu", **fields):
    """``(MultiTokenModel, heads dir)``: the heads on ``base`` (None: the base recorded in the
    heads dir); ``heads`` None means the embedded trained heads. ``fields``: other
    ``BackboneConfig`` fields (quantization, threads)."""
    heads = default_heads(base) if heads is None else heads
    if heads is None:
        raise UsageError(f"no heads dir given and the package ships none for {base or 'the embedded base'}",
                         "pass --heads DIR (made by `multitoken attach` or `multitoken train`)")
    config = backbone_config(heads, base, dtype=dtype, device=device, **fields)
    return MultiTokenModel.from_pretrained(config, heads), heads


def load_base_only(config):
    """The base model alone, as a one-head model: one token per forward pass in every mode."""
    return MultiTokenModel.attach(load_backbone(config), {"head_type": "medusa", "n_future": 1})


def load_stats(path: str | None, tokenizer):
    """The co-occurrence table at ``path`` (checked against ``tokenizer``), or None for None
    (no stats found) and ``NO_STATS``."""
    if path is None or path == NO_STATS:
        return None
    return CooccurrenceTable.for_tokenizer(path, tokenizer)
