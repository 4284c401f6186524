"""Assets shipped inside the package so that every command runs without downloads.

``stories260K/`` is Andrej Karpathy's tiny pretrained Llama from llama2.c (MIT, see the
LICENSE file beside it), converted to a Hugging Face checkpoint by ``multitoken convert-llama2c``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from multitoken.base.errors import UsageError

EMBEDDED_DIR = Path(__file__).resolve().parent
DEFAULT_BASE = EMBEDDED_DIR / "stories260K"
EMBEDDED_HEADS = EMBEDDED_DIR / "stories260K-heads"  # trained heads for DEFAULT_BASE
EMBEDDED_STATS = EMBEDDED_DIR / "stories260K-stats"  # co-occurrence stats of its tokenizer
# The real model (``multitoken fetch smollm2``): heads and stats trained for it ship here too.
SMOLLM2 = "SmolLM2-135M-Instruct"
SMOLLM2_HEADS = EMBEDDED_DIR / f"{SMOLLM2}-heads"  # 3 replicated heads (bf16)
SMOLLM2_MEDUSA = EMBEDDED_DIR / f"{SMOLLM2}-medusa"  # 3 Medusa heads (bf16)
SMOLLM2_CONDITIONED = EMBEDDED_DIR / f"{SMOLLM2}-conditioned"  # 3 token-conditioned heads (bf16)
SMOLLM2_EAGLE3 = EMBEDDED_DIR / f"{SMOLLM2}-eagle3"  # an EAGLE-3 drafter, 4 draft steps (bf16)
SMOLLM2_STATS = EMBEDDED_DIR / f"{SMOLLM2}-stats"  # co-occurrence stats of its tokenizer


def default_base() -> str:
    """Path of the embedded default base model (the value of every ``--base`` default)."""
    return str(DEFAULT_BASE)


EMBEDDED_PREFIX = "embedded:"


FETCHED_PREFIX = "fetched:"

# Every form --base (and BackboneConfig.base) takes, in the words of every command's --help.
BASE_FORMS = ("a Hub id (EleutherAI/pythia-70m), a local checkpoint dir, embedded:NAME (a model the package "
              "ships: embedded:stories260K), fetched:NAME (one `multitoken fetch` converted: "
              "fetched:SmolLM2-135M-Instruct) or a .gguf file")


def cache_dir() -> Path:
    """Where ``multitoken fetch`` keeps converted models: ``$MULTITOKEN_CACHE``, else
    ``$XDG_CACHE_HOME/multitoken``, else ``~/.cache/multitoken``."""
    import os

    root = os.environ.get("MULTITOKEN_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multitoken"
    return Path(root).expanduser()


def fetched_dir(name: str) -> Path:
    """The checkpoint directory ``multitoken fetch NAME`` writes (it may not exist yet)."""
    return cache_dir() / "models" / name


def resolve_base(name: str) -> str:
    """``embedded:NAME`` -> the packaged model's directory; ``fetched:NAME`` -> the checkpoint
    ``multitoken fetch NAME`` converted into the cache. Heads shipped in the package name their
    base this way, since the install and cache paths differ between machines. NAME is one
    folder of that root, never a path (``embedded:../../..`` is refused, as ``--heads`` refuses it)."""
    if name.startswith(EMBEDDED_PREFIX):
        folder = _one_folder(name, EMBEDDED_PREFIX, "the package's own folders")
        if folder not in packaged_dirs():
            raise UsageError(f"{name}: the package ships no folder of that name",
                             f"use one of: {', '.join(EMBEDDED_PREFIX + n for n in packaged_dirs())}")
        return str(EMBEDDED_DIR / folder)
    if name.startswith(FETCHED_PREFIX):
        return str(fetched_dir(_one_folder(name, FETCHED_PREFIX, f"the fetched models in {cache_dir() / 'models'}")))
    return name


def _one_folder(name: str, prefix: str, root: str) -> str:
    """NAME of ``prefix``NAME: one folder's name (no separator, not hidden, not ``..``)."""
    folder = name[len(prefix):]
    if not folder or folder.startswith(".") or any(c in folder for c in "/\\\0:"):
        example = "stories260K" if prefix == EMBEDDED_PREFIX else SMOLLM2
        raise UsageError(f"{name!r}: {prefix}NAME takes the name of one of {root}, not a path",
                         f"pass {prefix}NAME (e.g. {prefix}{example}), or the folder's own path without the prefix")
    return folder


def packaged_dirs() -> list[str]:
    """The folders shipped in the package (models, heads, stats): the NAMEs ``embedded:NAME`` takes."""
    return sorted(p.name for p in EMBEDDED_DIR.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))


def portable_base(name: str) -> str:
    """Inverse of ``resolve_base``: a packaged model's directory -> ``embedded:NAME``, so that
    files recording their base (heads dirs) stay valid on every install."""
    path = Path(name).expanduser()
    if path.exists() and path.resolve().parent == EMBEDDED_DIR:
        return EMBEDDED_PREFIX + path.resolve().name
    if path.exists() and path.resolve().parent == fetched_dir("x").resolve().parent:
        return FETCHED_PREFIX + path.resolve().name
    return name


@dataclass(frozen=True)
class ShippedAssets:
    """The directories the package ships for one base."""

    heads: Path  # the heads of every mode that has no heads of its own (DynaMo's)
    stats: Path  # co-occurrence stats of the base's tokenizer
    drafting_heads: Path  # the heads of the modes whose drafts the base verifies


def shipped_assets(name: str) -> ShippedAssets | None:
    """What the package ships for the base ``name`` (the embedded default, or the fetched
    SmolLM2 checkpoint), None for any other base: they fit no other. SmolLM2's drafting heads
    are its token-conditioned ones, which draft more accurately and so get more tokens
    accepted per forward; its replicated ones serve DynaMo, whose text repeats less with them
    (the shipped heads' accuracies: docs/training.md)."""
    path = Path(resolve_base(str(name))).expanduser()
    if not path.exists():
        return None
    if path.resolve() == DEFAULT_BASE:
        return ShippedAssets(heads=EMBEDDED_HEADS, stats=EMBEDDED_STATS, drafting_heads=EMBEDDED_HEADS)
    if path.resolve() == fetched_dir(SMOLLM2).resolve():
        return ShippedAssets(heads=SMOLLM2_HEADS, stats=SMOLLM2_STATS, drafting_heads=SMOLLM2_CONDITIONED)
    return None


def _present(path: Path | None) -> str | None:
    """``path`` as a string when the package holds that directory, else None."""
    return str(path) if path is not None and path.is_dir() else None


def shipped_stats(name: str) -> str | None:
    """The stats directory shipped for the base ``name``; None for any other base."""
    assets = shipped_assets(name)
    return _present(assets.stats if assets else None)


def shipped_heads(name: str, drafting: bool = False) -> str | None:
    """The heads shipped for the base ``name``: its drafting heads for a mode whose drafts the
    base verifies (``drafting``: ``DecodeConfig.verifies`` decides which modes), else its heads; None for any other base."""
    assets = shipped_assets(name)
    if assets is None:
        return None
    return _present(assets.drafting_heads if drafting else assets.heads)

