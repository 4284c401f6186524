"""The shipped stats dir: opens for the embedded model's tokenizer, masks sensibly."""

from __future__ import annotations

import numpy as np
import pytest

from multitoken.base.tokenizer import load_tokenizer
from multitoken.base.errors import MismatchError
from multitoken.embedded import EMBEDDED_STATS
from multitoken.stats.table import CooccurrenceTable
from multitoken.stats.info import summary


def test_embedded_stats_match_the_embedded_tokenizer(stories_dir):
    tok = load_tokenizer(str(stories_dir))
    table = CooccurrenceTable.for_tokenizer(EMBEDDED_STATS, tok)
    assert table.max_order == 3 and table.vocab_size == len(tok)
    once, upon, a = (tok.convert_tokens_to_ids(t) for t in ("▁Once", "▁upon", "▁a"))
    cands = [np.array([once, a]), np.array([upon, once]), np.array([a, upon])]
    grid = table.mask(cands)
    assert grid.shape == (2, 2, 2)
    assert grid[0, 0, 0] > 10          # "Once upon a" is far likelier than chance
    assert grid[0, 1, 0] == 0          # "Once Once a" never occurs: absent -> 0 by default
    assert "Once" in summary(EMBEDDED_STATS, tokenizer=tok)


def test_embedded_stats_refuse_another_tokenizer():
    from .stats_helpers import PYTHIA_TOKENIZER

    with pytest.raises(MismatchError):
        CooccurrenceTable.for_tokenizer(EMBEDDED_STATS, load_tokenizer(PYTHIA_TOKENIZER))
