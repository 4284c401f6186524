"""``multitoken train``'s draft vocabulary: the training data's tokens by frequency.

Written beside the heads as ``draft_vocab.json`` (``pipeline/model/draft_vocab.py``): layer
heads' drafts score its first ``--draft-vocab`` tokens when decoding. Heads with a draft
vocabulary of their own (eagle3's ``lm_head`` with ``d2t`` / ``t2d``) are set to the ranking's
first ``draft_vocab_size`` tokens *before* training, so that what they learn, what the heads dir
records (``draft_vocab_sha256``) and what an export carries are the same vocabulary.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from multitoken.base.data import DataConfig
from multitoken.base.errors import UsageError
from multitoken.base.packing import PackedStream
from multitoken.pipeline.model.draft_vocab import drafter_vocab_ids, owns_draft_vocab, ranked_ids, ranking_record, read_ranking

RANKED_TOKENS = 2_000_000  # tokens of the data counted for draft_vocab.json: ample for a frequency ranking


def draft_vocab_text(cfg, data: DataConfig, model, separator: int) -> str | None:
    """``draft_vocab.json``: the data's tokens by frequency over the first ``RANKED_TOKENS`` of
    its stream (documents joined by ``separator``; the whole data when shorter); None with
    ``--draft-vocab 0``. Its size: a drafter's own where the heads have one, else ``--draft-vocab``."""
    if not cfg.draft_vocab:
        return None
    tok, vocab = model.backbone.tokenizer, model.backbone.vocab_size
    size = len(drafter_vocab_ids(model.heads)) if owns_draft_vocab(model.heads) else cfg.draft_vocab
    counts, seen = np.zeros(vocab, dtype=np.int64), 0
    for seq, _ in PackedStream(data, tok, cfg.seq_len, separator, vocab_size=vocab, loop=False):
        counts += np.bincount(seq, minlength=vocab)
        seen += len(seq)
        if seen >= RANKED_TOKENS:
            break
    record = ranking_record(torch.from_numpy(counts), size, f"the first {seen} tokens of the training data")
    return json.dumps(record) + "\n"


def set_drafter_vocab(cfg, data: DataConfig, model, separator: int) -> str | None:
    """Heads with their own draft vocabulary (eagle3) draft over the data's ranking's first
    ``draft_vocab_size`` tokens (then unseen ids, ascending, where the data saw fewer), set
    before training and before a checkpoint's weights load: ``set_draft_vocab`` restarts the
    drafter's ``lm_head`` from the base's rows, and checkpoints keep parameters only, so a
    resumed run sets it again from the same data. Returns the ranking's text (written beside
    the heads); None for other heads, or with ``--draft-vocab 0`` (the drafter keeps its own)."""
    heads = model.heads
    if not owns_draft_vocab(heads):
        return None
    text = draft_vocab_text(cfg, data, model, separator)
    if text is None:
        return None
    record, vocab = json.loads(text), model.backbone.vocab_size
    want = ranked_ids(record, record["size"], vocab).sort().values  # [Vd]
    if torch.equal(want, drafter_vocab_ids(heads)):
        return text
    if read_ranking(getattr(model, "heads_dir", None), vocab) is not None:  # trained over a ranked vocabulary
        raise UsageError(f"the eagle3 heads in {cfg.heads!r} draft over another vocabulary than this data's ranking "
                         "(re-ranking would restart their lm_head)",
                         "pass --draft-vocab 0 to keep theirs, or train freshly attached heads on this data")
    heads.set_draft_vocab(want)
    return text
