"""Count n-grams of one chunk of documents, and merge sorted count runs.

A chunk is a flat token array made of *pieces*, each a contiguous slice of one document.
A piece may begin with up to ``order - 1`` *context* tokens already counted in an earlier
chunk (a long document split across chunks, or a resumed one): they are not counted
again, but n-grams that start in them and end in the new tokens are. No n-gram crosses a
piece start unless the piece carries that context, so documents never join.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np



def sorted_unique_counts(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unsorted keys ``[m]`` -> (distinct sorted keys ``[u]``, counts ``[u]`` uint64). Sorts in place."""
    if keys.size == 0:
        return keys, np.zeros(0, np.uint64)
    keys.sort()
    starts = np.empty(keys.size, dtype=bool)
    starts[0] = True
    np.not_equal(keys[1:], keys[:-1], out=starts[1:])
    idx = np.flatnonzero(starts)
    counts = np.diff(idx, append=keys.size).astype(np.uint64)
    return keys[idx], counts


def merge_runs(runs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (keys, counts) runs -> one sorted run with counts of equal keys summed.

    Empties ``runs`` once they are concatenated, so callers that pass their only reference
    free the inputs before the sort (this is what keeps merging within the memory bound).
    """
    nonempty = [r for r in runs if r[0].size]
    runs.clear()
    if not nonempty:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    if len(nonempty) == 1:
        return np.asarray(nonempty[0][0]), np.asarray(nonempty[0][1], dtype=np.uint64)
    keys = np.concatenate([r[0] for r in nonempty])
    counts = np.concatenate([r[1] for r in nonempty]).astype(np.uint64, copy=False)
    del nonempty
    return _merge_argsort(keys, counts)


def _reduce_sorted(keys: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted keys with duplicates -> distinct keys, summed counts."""
    starts = np.empty(keys.size, dtype=bool)
    starts[0] = True
    np.not_equal(keys[1:], keys[:-1], out=starts[1:])
    idx = np.flatnonzero(starts)
    del starts
    return keys[idx], np.add.reduceat(counts, idx).astype(np.uint64, copy=False)


def _merge_argsort(keys: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # a stable argsort of concatenated sorted runs is a timsort: O(m log runs)
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    counts = counts[order]
    del order
    return _reduce_sorted(keys, counts)


@dataclass
class ChunkCounts:
    """Counts of one chunk: dense unigrams, sorted (keys, counts) per order >= 2, totals."""

    unigrams: np.ndarray                      # [V] uint64
    runs: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    totals: list[int] = field(default_factory=list)  # n-gram occurrences counted, per order 1..n


def count_chunk(tokens: np.ndarray, piece_starts: np.ndarray, context: np.ndarray, order: int, vocab_size: int) -> ChunkCounts:
    """Count a chunk.

    tokens       [L]  int64 token ids of all pieces, concatenated
    piece_starts [P]  index in ``tokens`` where each piece begins
    context      [P]  how many leading tokens of each piece were counted before
    """
    n = tokens.size
    has_ctx = bool(context.any())
    new = np.ones(n, dtype=bool)        # token is counted here for the first time
    for start, ctx in zip(piece_starts.tolist(), context.tolist()):
        if ctx:
            new[start:start + ctx] = False
    boundary = np.zeros(n, dtype=bool)  # token starts a piece (nothing joins across it)
    boundary[piece_starts] = True
    uni = np.bincount(tokens[new] if has_ctx else tokens, minlength=vocab_size).astype(np.uint64)
    out = ChunkCounts(unigrams=uni, totals=[int(new.sum())])
    tu = tokens.astype(np.uint64)
    keys = tu                           # keys of order k at every start position, built incrementally
    for k in range(2, order + 1):
        m = n - k + 1
        if m <= 0:
            out.runs[k] = (np.zeros(0, np.uint64), np.zeros(0, np.uint64))
            out.totals.append(0)
            continue
        keys = keys[:m] * np.uint64(vocab_size)
        keys += tu[k - 1:]
        valid = new[k - 1:].copy()      # [m] the n-gram ends on a new token ...
        for j in range(1, k):           # ... and no piece starts inside it
            valid &= ~boundary[j:j + m]
        counted = int(valid.sum())
        run = keys[valid] if counted < m else keys.copy()  # a copy: sorting must not disturb `keys`
        out.runs[k] = sorted_unique_counts(run)
        out.totals.append(counted)
    return out


class ChunkBuilder:
    """Collects document pieces until a chunk holds ``chunk_tokens`` new tokens.

    ``add`` splits long documents into pieces so a chunk never far exceeds the budget, and
    remembers where the last piece ended: ``(doc_index, offset)`` is the resume point.
    """

    def __init__(self, order: int, chunk_tokens: int):
        self.ctx = order - 1
        self.chunk_tokens = chunk_tokens
        self.pieces: list[np.ndarray] = []
        self.contexts: list[int] = []
        self.new_tokens = 0
        self.position: tuple[int, int] | None = None  # (doc index, tokens of it consumed)

    def add(self, doc_index: int, ids: np.ndarray, offset: int = 0):
        """Add document ``ids`` from token ``offset`` on; yields each chunk that fills up."""
        pos = offset
        self.position = (doc_index, offset)
        while pos < ids.size:
            end = min(ids.size, pos + max(self.chunk_tokens - self.new_tokens, 1))
            ctx = min(self.ctx, pos)
            self.pieces.append(ids[pos - ctx:end])
            self.contexts.append(ctx)
            self.new_tokens += end - pos
            self.position = (doc_index, end)
            pos = end
            if self.new_tokens >= self.chunk_tokens:
                yield self.take()

    def take(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The collected chunk as ``count_chunk`` arguments (None if empty); resets."""
        if not self.pieces:
            return None
        lengths = np.array([p.size for p in self.pieces], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        tokens = np.concatenate(self.pieces).astype(np.int64, copy=False)
        contexts = np.array(self.contexts, dtype=np.int64)
        self.pieces, self.contexts, self.new_tokens = [], [], 0
        return tokens, starts, contexts
