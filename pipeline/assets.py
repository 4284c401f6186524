"""Defaults shared by ``eval`` and ``sweep``: the embedded trained heads and stats, loading."""

from __future__ import annotations

from .embedded import EMBEDDED_HEADS, EMBEDDED_STATS, is_default_base


def default_heads() -> str:
    """The embedded trained heads, when the package ships them ('' otherwise)."""
    return str(EMBEDDED_HEADS) if (EMBEDDED_HEADS / "heads_config.json").is_file() else ""


def default_stats(backbone) -> str:
    """The embedded stats, but only for the embedded base (another tokenizer would not match)."""
    return str(EMBEDDED_STATS) if is_default_base(backbone.name) and EMBEDDED_STATS.is_dir() else ""


def load_model(heads: str, base: str | None, dtype: str = "float32", device: str = "cpu"):
    """``(MultiTokenModel, heads dir)``; ``heads`` '' means the embedded trained heads."""
    from .errors import UsageError
    from .model import MultiTokenModel

    heads = heads or default_heads()
    if not heads:
        raise UsageError("no heads dir given and no embedded heads found",
                         "pass --heads DIR (made by `multitoken attach` or `multitoken train`)")
    return MultiTokenModel.from_pretrained(base, heads, dtype=dtype, device=device), heads


def load_stats(path: str, tokenizer):
    """The co-occurrence table at ``path`` (checked against ``tokenizer``), or None for ''/none."""
    if not path or path == "none":
        return None
    from multitoken.stats.table import CooccurrenceTable

    return CooccurrenceTable.for_tokenizer(path, tokenizer)
