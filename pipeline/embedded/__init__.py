"""Assets shipped inside the package so that every command runs without downloads.

``stories260K/`` is Andrej Karpathy's tiny pretrained Llama from llama2.c (MIT, see the
LICENSE file beside it), converted to a Hugging Face checkpoint by ``multitoken convert-llama2c``.
"""

from __future__ import annotations

from pathlib import Path

EMBEDDED_DIR = Path(__file__).resolve().parent
DEFAULT_BASE = EMBEDDED_DIR / "stories260K"
EMBEDDED_HEADS = EMBEDDED_DIR / "stories260K-heads"  # trained heads for DEFAULT_BASE
EMBEDDED_STATS = EMBEDDED_DIR / "stories260K-stats"  # co-occurrence stats of its tokenizer


def default_base() -> str:
    """Path of the embedded default base model (the value of every ``--base`` default)."""
    return str(DEFAULT_BASE)


EMBEDDED_PREFIX = "embedded:"


def resolve_base(name: str) -> str:
    """``embedded:NAME`` -> the packaged model's directory. Heads shipped in the package name
    their base this way, since the install path differs between machines."""
    if name.startswith(EMBEDDED_PREFIX):
        return str(EMBEDDED_DIR / name[len(EMBEDDED_PREFIX):])
    return name


def is_default_base(name: str) -> bool:
    """True when ``name`` (a path or ``embedded:NAME``) is the embedded default base."""
    return Path(resolve_base(str(name))).resolve() == DEFAULT_BASE


def portable_base(name: str) -> str:
    """Inverse of ``resolve_base``: a packaged model's directory -> ``embedded:NAME``, so that
    files recording their base (heads dirs) stay valid on every install."""
    path = Path(name).expanduser()
    if path.exists() and path.resolve().parent == EMBEDDED_DIR:
        return EMBEDDED_PREFIX + path.resolve().name
    return name
