"""A draft vocabulary: draft heads score only the tokens their training text used most (FR-Spec).

Unembedding a draft head's row over the whole vocabulary reads the whole unembedding matrix
again after the base rows' call: on SmolLM2-135M (49,152 x 576, fp32, one CPU thread) a second
call costs about what the one-token base call costs (~7 ms of a ~70 ms step). A draft head's
guesses come almost always from the few thousand tokens its training text was made of, so its
row is scored over those only: a sub-matrix of the unembedding's rows, the other tokens' logits
-inf (never drafted). Verification still reads the base over the whole vocabulary: greedy output
stays the base's own, and sampled verification stays exact (the drafts' distribution is the one
drafts are drawn from, zero outside the set).

``draft_vocab.json`` beside the heads records the ranking: ``{"tokens": [ids, most frequent
first], "counts": [...], "size": N (the size decoding takes unless told), "source": "..."}``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from multitoken.base.errors import CheckpointError, UsageError
from multitoken.kernels.cpu_linear import is_argmax_head

DRAFT_VOCAB_FILE = "draft_vocab.json"


def ranking_record(counts: torch.Tensor, size: int, source: str) -> dict:
    """``draft_vocab.json``'s record from per-token counts ``counts`` [V]: the tokens seen, most
    frequent first (ties by id), with the size decoding takes by default."""
    counts = counts.to(torch.long).cpu()
    seen = (counts > 0).nonzero().squeeze(-1)  # [S] ascending ids
    order = torch.argsort(-counts[seen], stable=True)  # stable: ties keep ascending ids
    tokens = seen[order]
    return {"tokens": tokens.tolist(), "counts": counts[tokens].tolist(), "size": int(size),
            "vocab_size": int(counts.shape[0]), "source": source}


def ranked_ids(record: dict, size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` token ids a draft vocabulary of that many holds: the ranking's first ``size``,
    then (where its text saw fewer tokens) the ids it never saw, ascending # -> [size] long."""
    ids = torch.tensor(record["tokens"][:size], dtype=torch.long)
    if ids.numel() < size:
        unseen = torch.ones(vocab_size, dtype=torch.bool)
        unseen[ids] = False
        ids = torch.cat([ids, unseen.nonzero().squeeze(-1)[:size - ids.numel()]])
    return ids


def owns_draft_vocab(heads) -> bool:
    """Heads that draft over a vocabulary of their own (eagle3: its ``lm_head`` with ``d2t`` /
    ``t2d``, chosen by ``set_draft_vocab``) rather than through the base's unembedding."""
    return callable(getattr(heads, "set_draft_vocab", None)) and getattr(heads, "t2d", None) is not None


def drafter_vocab_ids(heads) -> torch.Tensor:
    """The target ids such heads score now, ascending # -> [Vd] long (CPU)."""
    return heads.t2d.nonzero().squeeze(-1).cpu()


def read_ranking(heads_dir: str | Path | None, vocab_size: int | None = None) -> dict | None:
    """The heads dir's ``draft_vocab.json`` record, or None where it has none. Checked whole:
    ``tokens`` distinct integer ids in [0, ``vocab_size``), ``size`` an integer >= 0 (1.5 is
    refused, not truncated), ``counts`` one integer per token; a damaged record is one line."""
    if heads_dir is None:
        return None
    path = Path(heads_dir) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    fix = f"delete {path} (drafts then score the whole vocabulary) or rebuild the heads"
    _check_recorded_sha(Path(heads_dir), path, fix)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path} is not valid JSON ({str(err).splitlines()[0]})", fix) from None
    if not isinstance(record, dict):
        raise CheckpointError(f"{path} holds a JSON {type(record).__name__}, not an object", fix)
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)
    tokens, size, counts = record.get("tokens"), record.get("size"), record.get("counts")
    if not whole(size) or size < 0:
        raise CheckpointError(f"{path}: size must be an integer >= 0, got {size!r:.40}", fix)
    if not isinstance(tokens, list) or not all(whole(t) for t in tokens):
        raise CheckpointError(f"{path}: tokens must be a list of integer token ids", fix)
    if vocab_size is not None and not all(0 <= t < vocab_size for t in tokens):
        bad = next(t for t in tokens if not 0 <= t < vocab_size)
        raise CheckpointError(f"{path}: token id {bad} is outside the base's vocabulary [0, {vocab_size})", fix)
    if len(set(tokens)) != len(tokens):
        raise CheckpointError(f"{path}: tokens lists {len(tokens) - len(set(tokens))} id(s) twice", fix)
    if counts is not None and (not isinstance(counts, list) or len(counts) != len(tokens) or not all(whole(c) for c in counts)):
        raise CheckpointError(f"{path}: counts must hold one integer per token", fix)
    return record


def _check_recorded_sha(heads_dir: Path, path: Path, fix: str) -> None:
    """The sha256 the heads' config recorded for their draft vocabulary (heads written since it
    does), matched by the file: an edited or swapped ranking is refused, not read."""
    import hashlib

    try:
        want = json.loads((heads_dir / "heads_config.json").read_text(encoding="utf-8")).get("draft_vocab_sha256")
    except (OSError, ValueError, AttributeError):
        return  # the heads' own loader names a damaged config
    if want is not None and hashlib.sha256(path.read_bytes()).hexdigest() != want:
        raise CheckpointError(f"{path} is not the draft vocabulary the heads were saved with (its sha256 differs)", fix)


def resolve_size(requested: int | None, record: dict | None, vocab_size: int) -> int:
    """Tokens the drafts score: ``requested`` (0 = the whole vocabulary), or None = the size the
    heads dir records (the whole vocabulary where it records none). 0 means no draft vocabulary."""
    if requested is None:
        requested = record["size"] if record is not None else 0
    if requested < 0:
        raise UsageError(f"--draft-vocab must be >= 0, got {requested}", "pass 0 for the whole vocabulary")
    if requested == 0 or requested >= vocab_size:
        return 0
    if record is None:
        raise UsageError(f"--draft-vocab {requested} needs the heads' token ranking ({DRAFT_VOCAB_FILE} beside the heads)",
                         "pass --draft-vocab 0, or heads built with one (scripts/build_heads.py writes it)")
    return requested


class DraftUnembedding(nn.Module):
    """Draft rows' logits over ``ids`` [N] only # [..., H] -> [..., V], -inf outside ``ids``.

    ``proj`` holds the unembedding's rows ``ids`` (a copy: the packed CPU linears may pack it
    like any other decoding linear)."""

    def __init__(self, unembedding: nn.Module, ids: torch.Tensor, vocab_size: int):
        super().__init__()
        weight = unembedding.weight  # a packed linear reads its dense values back (one copy)
        if not weight.dtype.is_floating_point:
            raise UsageError("a draft vocabulary needs a float unembedding (this one is quantized)", "pass --draft-vocab 0")
        bias = getattr(unembedding, "bias", None)
        ids = ids.to(device=weight.device, dtype=torch.long)
        # made on "meta" (no random init of a [N, H] matrix about to be replaced), then given the rows
        self.proj = nn.Linear(weight.shape[1], ids.numel(), bias=bias is not None, device="meta", dtype=weight.dtype)
        self.proj.weight = nn.Parameter(weight.detach().index_select(0, ids), requires_grad=False)
        if bias is not None:
            self.proj.bias = nn.Parameter(bias.detach().index_select(0, ids), requires_grad=False)
        self.register_buffer("ids", ids, persistent=False)
        self.vocab_size = vocab_size

    @property
    def size(self) -> int:
        return self.ids.numel()

    def argmax(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The token of the best logit # [..., H] -> [...] long, exactly ``forward(rows).argmax(-1)``
        (``ids`` ascend, so the first index on ties is the same token), from the packed
        projection's argmax screen; None where it has none (then take the logits)."""
        best = self.proj.argmax(rows) if is_argmax_head(self.proj) else None  # packed: cpu_linear.py
        return None if best is None else self.ids[best]

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        part = self.proj(rows)  # [..., N]
        out = part.new_full((*part.shape[:-1], self.vocab_size), float("-inf"))  # [..., V]
        return out.index_copy_(-1, self.ids, part)
