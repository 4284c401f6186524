"""Self-distilled training text for heads of a real base, with the trunk's hidden states kept.

The Medusa-2 / DynaMo recipe: the base model continues public prompts (lines of the fixtures'
corpora), so the heads learn what the base itself says next. Every prompt is cut to the same
number of tokens, so a batch needs no padding and every row has the same length; a row's
targets end at its first EOS.

While ``generate`` runs, forward hooks keep what the heads read: the output of the trunk
(``layers[:-1]``, the input of the final layer) and the final norm's output (head 1's hidden,
what Medusa heads read). Prefill gives the prompt's positions and each decoding step one more,
so the concatenation covers every position but the last token (never fed back). Training on
these states (``heads_fast.py``) skips the 29-layer trunk pass that dominates a heads-only
step, the way a frozen backbone allows.

Writes ``NAME.pt`` (``torch.save`` of plain tensors: ``ids`` [N, T] int64, ``valid`` [N, T]
bool, where targets may be read, ``trunk`` and ``base`` [N, T, H] bfloat16) and ``NAME.jsonl`` (prompt + continuation
ids and text, one row per line, for ``multitoken eval`` and the stats job).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"

# Public prompt sources (../shared/fixtures, licences there). Held-out prompts come from a
# file no training prompt is drawn from; the sweep's own prompts (DynaMo's Table 7) are in none.
TRAIN_SOURCES = ("wikitext2_tokens/valid.txt", "tinyshakespeare/input.txt",
                 "iwslt2017_de_en_dummy/train.tags.de-en.en")
HELDOUT_SOURCES = ("wikitext2_tokens/test.txt",)


def clean_wikitext(line: str) -> str:
    """Undo wikitext-2's word tokenisation (`` @-@ ``, `` , ``) so prompts read as prose."""
    line = re.sub(r" @(.)@ ", r"\1", line)
    line = re.sub(r" ([,.;:!?)'])", r"\1", line)
    return re.sub(r"\( ", "(", line).replace(" n't", "n't")


def paragraphs(sources: tuple[str, ...]):
    """The sources' prose blocks: wikitext paragraphs and Shakespeare's speeches (blank-line
    separated, joined), headings and markup left out."""
    for rel in sources:
        text = (FIXTURES / rel).read_text(encoding="utf-8", errors="replace")
        for block in text.split("\n\n") if "shakespeare" in rel else text.splitlines():
            block = " ".join(block.split())
            if not block.startswith(("=", "<")):
                yield clean_wikitext(block) if "wikitext" in rel else block


def prompt_lines(sources: tuple[str, ...], min_words: int = 10) -> list[str]:
    """Prose sentences of the sources' paragraphs, split at sentence ends, ``<unk>`` left out."""
    return [s for block in paragraphs(sources) for s in re.split(r"(?<=[.!?])\s+", block)
            if len(s.split()) >= min_words and "<unk>" not in s]


def prompt_ids(tokenizer, lines: list[str], length: int, seed: int) -> torch.Tensor:
    """Distinct prompts of exactly ``length`` tokens, shuffled by ``seed`` # [P, length]."""
    seen, rows = set(), []
    for line in lines:
        ids = tokenizer(line).input_ids[:length]
        if len(ids) == length and tuple(ids) not in seen:
            seen.add(tuple(ids))
            rows.append(ids)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    return torch.tensor(rows, dtype=torch.long)[order]


def window_ids(tokenizer, sources: tuple[str, ...], length: int, stride: int, exclude: torch.Tensor, seed: int,
               offset: int = 0) -> torch.Tensor:
    """More prompts from the same text: ``length``-token windows every ``stride`` tokens from
    ``offset`` on inside each paragraph (cut at ``<unk>`` and headings), none equal to a row of
    ``exclude`` # [P, length]."""
    seen = {tuple(r) for r in exclude.tolist()}
    rows = []
    for block in paragraphs(sources):
        for piece in block.split("<unk>"):
            ids = tokenizer(piece.strip()).input_ids
            for start in range(offset, len(ids) - length + 1, stride):
                window = tuple(ids[start:start + length])
                if window not in seen:
                    seen.add(window)
                    rows.append(window)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    return torch.tensor(rows, dtype=torch.long)[order]


class HiddenTap:
    """Forward hooks collecting the trunk output and the final norm output of every call."""

    def __init__(self, backbone):
        self.trunk: list[torch.Tensor] = []
        self.base: list[torch.Tensor] = []
        self.handles = [
            backbone.layers[-2].register_forward_hook(lambda m, a, out: self.trunk.append(_first(out).to(torch.bfloat16))),
            backbone.final_norm.register_forward_hook(lambda m, a, out: self.base.append(out.to(torch.bfloat16))),
        ]

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        trunk, base = torch.cat(self.trunk, dim=1), torch.cat(self.base, dim=1)  # [B, T - 1, H]
        self.trunk, self.base = [], []
        return trunk, base

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@torch.inference_mode()
def continue_batch(backbone, prompts: torch.Tensor, new_tokens: int, sample: bool, tap: HiddenTap):
    """Continue ``prompts`` [B, P] by ``new_tokens``; returns ids [B, T], valid [B, T] and the
    tapped states [B, T, H] (T = P + new; the last position's states are zero and invalid)."""
    tok = backbone.tokenizer
    eos = tok.eos_token_id
    options = dict(do_sample=True, temperature=0.7, top_k=50) if sample else dict(do_sample=False)
    ids = backbone.model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, pad_token_id=eos, **options)  # [B, T]
    trunk, base = tap.take()
    pad = torch.zeros(trunk.shape[0], 1, trunk.shape[2], dtype=trunk.dtype)
    trunk, base = torch.cat([trunk, pad], dim=1), torch.cat([base, pad], dim=1)  # [B, T, H]
    valid = torch.ones_like(ids, dtype=torch.bool)
    if eos is not None:  # a row's text ends at its first EOS after the prompt
        after = (ids == eos) & (torch.arange(ids.shape[1]) >= prompts.shape[1])
        valid &= after.cumsum(1) == 0
    return ids, valid, trunk, base


def targets_mask(valid: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Where a head's loss may look: the base model's own text, from the prompt's last token on
    (its earlier positions hold the public text, which heads that learn what the base says
    next should not be fitted to); every position stays visible to the head layers."""
    mask = valid.clone()
    mask[:, : prompt_len - 1] = False
    return mask


def build(backbone, out: Path, prompts: torch.Tensor, new_tokens: int, batch: int, sample_every: int) -> Path:
    """Continue every prompt (every ``sample_every``-th batch sampled at temperature 0.7 /
    top-k 50, the others greedy) and save ``out.pt`` and ``out.jsonl``."""
    from tqdm import tqdm

    if out.with_suffix(".pt").is_file():
        return out.with_suffix(".pt")
    tap = HiddenTap(backbone)
    parts: dict[str, list[torch.Tensor]] = {"ids": [], "valid": [], "trunk": [], "base": []}
    lines = []
    try:
        for k, start in enumerate(tqdm(range(0, len(prompts), batch), desc=out.name)):
            sample = sample_every > 0 and k % sample_every == sample_every - 1
            got = continue_batch(backbone, prompts[start:start + batch], new_tokens, sample, tap)
            for name, value in zip(parts, got):
                parts[name].append(value)
            for row, ok in zip(got[0].tolist(), got[1].tolist()):
                kept = [t for t, v in zip(row, ok) if v]
                lines.append(json.dumps({"input_ids": kept, "text": backbone.tokenizer.decode(kept), "sampled": sample}))
    finally:
        tap.close()
    data = {name: torch.cat(values) for name, values in parts.items()}
    data["valid"] = targets_mask(data["valid"], prompts.shape[1])
    tmp = out.with_suffix(".pt.tmp")
    torch.save(data, tmp)
    out.with_suffix(".jsonl").write_text("\n".join(lines) + "\n")
    tmp.rename(out.with_suffix(".pt"))
    return out.with_suffix(".pt")
