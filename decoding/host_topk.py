"""``torch.topk`` of CPU rows, exactly, at less than half its cost over a 50k vocabulary.

torch's CPU top-k copies every (value, index) pair of a row and partial-sorts them (~70 us per
50k row on one thread). Here each row's (k + 1)-th largest value is bounded from below by the
(k + 1)-th largest of 2(k + 1) block maxima (k + 1 distinct cells
are >= it), so one vectorised compare leaves a few hundred candidates to sort. The result equals torch's whenever it is unique: when
the row's k + 1 largest values are distinct and not NaN (torch ranks NaN first). Otherwise --
a tie at the top, where torch's order is its partial sort's, or a NaN -- ``exact_topk`` returns
None and the caller runs ``torch.topk``.
"""

from __future__ import annotations

import numpy as np

MIN_VOCAB = 4096  # below, torch's sort costs less than these numpy calls (512 tokens: 44 vs 77 us)


def exact_topk(x: np.ndarray, k: int, min_vocab: int = MIN_VOCAB) -> tuple[np.ndarray, np.ndarray] | None:
    """(values [m, k] float32, ids [m, k] int64) of each row of ``x`` [m, V] float32, largest
    first, as ``torch.topk(x, k)``; None where torch's answer is not determined by the values,
    or where V < ``min_vocab``."""
    m, v = x.shape
    kk = k + 1
    width = v // (2 * kk)
    if k < 1 or width < 2 or v < min_vocab:  # k >= V / 4: little to save
        return None
    blocks = x[:, :2 * kk * width].reshape(m, 2 * kk, width).max(axis=-1)  # [m, 2(k + 1)]; NaN propagates
    if np.isnan(blocks).any() or (v > 2 * kk * width and np.isnan(x[:, 2 * kk * width:]).any()):
        return None
    # the (k + 1)-th largest block maximum: <= the row's (k + 1)-th largest (2(k + 1) blocks leave
    # ~270 candidates on a 50k vocabulary, 3x fewer than k + 1 blocks; more cost more than they save)
    floor = np.partition(blocks, kk, axis=-1)[:, kk]  # [m]; ascending, k + 1 blocks from index kk on
    vals, ids = np.empty((m, k), np.float32), np.empty((m, k), np.int64)
    for row in range(m):
        cand = np.flatnonzero(x[row] >= floor[row])  # >= k + 1 cells, the k + 1 largest among them
        cv = x[row, cand]
        order = np.argsort(-cv)[:kk]  # any order of equal values: ties are refused below
        top = cv[order]
        if not (top[:-1] > top[1:]).all():  # a tie among the k + 1 largest
            return None
        vals[row], ids[row] = top[:k], cand[order[:k]]
    return vals, ids
