"""Load a base model's tokenizer (local dir, ``embedded:NAME`` or Hub id) and fingerprint it."""

from __future__ import annotations

import json

from multitoken.base.errors import CheckpointError
from multitoken.base.hub import custom_code_error, locate
from multitoken.embedded import resolve_base


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    base, hub_kwargs = locate(resolve_base(str(path)))
    try:
        return AutoTokenizer.from_pretrained(base, trust_remote_code=False, **hub_kwargs)
    except (OSError, ValueError) as err:
        refused = custom_code_error(str(path), err)
        if refused is not None:
            raise refused from None
        raise CheckpointError(
            f"could not load a tokenizer from {path!r}: {str(err).splitlines()[0] if str(err) else type(err).__name__}",
            "the checkpoint needs tokenizer.json (or tokenizer.model) and tokenizer_config.json",
        ) from err


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the token -> id map (special tokens included); equal iff ids mean the same."""
    import hashlib

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
