"""Vectorised hash lookups for n-gram counts, built and queried with whole-array numpy ops.

Why not binary search on the sorted key array: a 50^3 mask is 125k dependent searches of
~24 cache misses each (~150 ms against 10M keys). Two structures instead:

* ``HashIndex``: open addressing (linear probing) from uint64 keys to uint64 values. Used to
  find an n-gram's *prefix* (all tokens but the last).
* ``PrefixBlockIndex``: the n-grams sharing a prefix get their own small open-addressing
  block, contiguous in memory. A mask grid asks the same ~50 last tokens under each prefix,
  so the queries of one prefix hit one block (a few cache lines), not 50 random places.

Both insert by rounds: every pending key tries its current slot at once; when several claim
one slot, the one whose write survives wins and the rest probe on. A key therefore sits at
the first slot of its probe sequence that was free when it got there, which is exactly what
lookup (stop at the key or at an empty slot) needs.
"""

from __future__ import annotations

import numpy as np

EMPTY64 = np.uint64(2**64 - 1)          # never a key: keys are < V^order < 2^64 - 1
EMPTY32 = np.uint32(2**32 - 1)          # never a token id (vocabularies are < 2^21 at order 3)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing multiplier
DENSE_PREFIXES = 1 << 22                # one-token prefixes get a dense table up to this vocabulary
PROBE_WINDOW = 8                        # slots a grid lookup probes per round after the first


def _mix(x: np.ndarray) -> np.ndarray:
    """uint64 -> well-mixed uint64 (the high bits of a Fibonacci product)."""
    return (np.asarray(x, np.uint64) * GOLDEN) >> np.uint64(29)


def _place(table: np.ndarray, empty, items: np.ndarray, first_slot: np.ndarray, step) -> np.ndarray:
    """Insert ``items`` (values to store) starting at ``first_slot``; ``step(slot, who)`` probes on.

    Returns the slot of every item.
    """
    claim = np.full(table.size, -1, dtype=np.int64)
    where = np.empty(items.size, dtype=np.intp)
    slot = first_slot.astype(np.intp)
    pending = np.arange(items.size)
    while pending.size:
        s = slot[pending]
        free = table.take(s) == empty
        cand, cs = pending[free], s[free]
        claim[cs] = cand                     # several may claim a slot; one write survives
        won = claim[cs] == cand
        table[cs[won]] = items[cand[won]]
        where[cand[won]] = cs[won]
        pending = np.concatenate([pending[~free], cand[~won]])
        slot[pending] = step(slot[pending], pending)
    return where


class HashIndex:
    """``lookup(keys) -> values`` (``missing`` where absent) for fixed (uint64 key, value) pairs."""

    def __init__(self, keys: np.ndarray, values: np.ndarray, load: float = 0.5):
        keys = np.asarray(keys, np.uint64)
        bits = max(4, int(np.ceil(np.log2(max(keys.size, 1) / load))))
        self.mask = (1 << bits) - 1
        self.keys = np.full(1 << bits, EMPTY64, dtype=np.uint64)
        where = _place(self.keys, EMPTY64, keys, self._home(keys), lambda s, _: (s + 1) & self.mask)
        self.values = np.zeros(1 << bits, dtype=np.asarray(values).dtype)
        self.values[where] = values

    def _home(self, keys: np.ndarray) -> np.ndarray:
        # intp indices: numpy's fast gather path (uint64 indices take a ~10x slower one)
        return (_mix(keys) & np.uint64(self.mask)).astype(np.intp)

    def lookup(self, queries: np.ndarray, missing=0) -> np.ndarray:
        queries = np.asarray(queries, np.uint64).ravel()
        out = np.full(queries.size, missing, dtype=self.values.dtype)
        idx = np.arange(queries.size)
        slot, q = self._home(queries), queries
        while idx.size:
            found = self.keys.take(slot)
            hit = found == q
            out[idx[hit]] = self.values.take(slot[hit])
            more = ~hit & (found != EMPTY64)  # an empty slot ends the probe sequence
            idx, q, slot = idx[more], q[more], (slot[more] + 1) & self.mask
        return out

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)


class PrefixBlockIndex:
    """Counts of n-grams (sorted mixed-radix keys), looked up as a grid prefix x last token."""

    def __init__(self, keys: np.ndarray, counts: np.ndarray, vocab_size: int, order: int):
        v = np.uint64(vocab_size)
        keys = np.asarray(keys, np.uint64)
        prefix, last = keys // v, (keys % v).astype(np.uint32)
        starts = np.flatnonzero(np.concatenate([[True], prefix[1:] != prefix[:-1]])) if keys.size else np.zeros(0, np.intp)
        lengths = np.diff(starts, append=keys.size)
        # a block of 2^ceil(log2(3L)) slots: load <= 1/3, so probe runs for absent n-grams
        # (most cells of a mask grid) stay short; 1/2 costs ~25% more time for ~25% less memory
        self.size = (1 << np.ceil(np.log2(3 * np.maximum(lengths, 1))).astype(np.int64)).astype(np.int64)
        self.base = np.concatenate([[0], np.cumsum(self.size)[:-1]]).astype(np.int64)
        self.last = np.full(int(self.size.sum()), EMPTY32, dtype=np.uint32)
        block = np.repeat(np.arange(starts.size), lengths)
        mask = self.size[block] - 1
        base = self.base[block]
        first = base + (self._h(last) & mask)
        where = _place(self.last, EMPTY32, last, first, lambda s, who: base[who] + ((s - base[who] + 1) & mask[who]))
        self.counts = np.zeros(self.last.size, dtype=np.asarray(counts).dtype)
        self.counts[where] = counts
        block_prefix = prefix[starts]
        if order == 2 and vocab_size <= DENSE_PREFIXES:
            # order 2: a prefix is one token, so a dense token -> block table is one gather
            self.dense = np.full(vocab_size, -1, dtype=np.int64)
            self.dense[block_prefix.astype(np.int64)] = np.arange(starts.size)
        else:
            self.dense = None
            self.prefixes = HashIndex(block_prefix, np.arange(starts.size, dtype=np.int64))

    @staticmethod
    def _h(last: np.ndarray) -> np.ndarray:
        return _mix(last).astype(np.int64) & np.int64(2**62 - 1)

    def grid(self, prefix_keys: np.ndarray, last: np.ndarray, possible: np.ndarray | None = None) -> np.ndarray:
        """Counts ``[P, C]`` of n-grams ``prefix_keys[p] + last[c]`` (0 where absent).

        ``possible [P, C]`` (optional): False where the caller knows the n-gram is absent;
        those cells skip the probe chains, which is where most of the time goes.
        """
        prefix_keys = np.asarray(prefix_keys, np.uint64).ravel()
        last = np.asarray(last).astype(np.uint32).ravel()
        ncol = last.size
        out = np.zeros((prefix_keys.size, ncol), dtype=self.counts.dtype)
        if self.dense is not None:
            blk = self.dense.take(prefix_keys.astype(np.intp))
        else:
            blk = self.prefixes.lookup(prefix_keys, missing=-1)
        rows = np.flatnonzero(blk >= 0)               # prefixes never seen: the whole row is 0
        if rows.size == 0 or ncol == 0:
            return out
        # first probe for every cell at once as [R, C] broadcasts, then flat: a small grid is
        # dominated by per-op overhead, so the cells are handled as few, whole-array ops
        blk = blk.take(rows)
        base = self.base.take(blk)[:, None]                       # [R, 1]
        mask = self.size.take(blk)[:, None] - 1                   # [R, 1]
        slot = (base + (self._h(last)[None, :] & mask)).ravel()   # [R*C]
        found = self.last.take(slot)
        q = np.broadcast_to(last, (rows.size, ncol)).ravel()
        hit = found == q
        # flat output index of each cell (the identity when every prefix was seen)
        cell = None if rows.size == prefix_keys.size else (rows[:, None] * ncol + np.arange(ncol)).ravel()
        flat = out.reshape(-1)
        h = np.flatnonzero(hit)
        flat[h if cell is None else cell.take(h)] = self.counts.take(slot.take(h))
        more = (found != EMPTY32) ^ hit                           # a hit is never empty: xor drops it
        if possible is not None:
            more &= possible[rows].ravel()
        idx = np.flatnonzero(more)
        if idx.size == 0:
            return out
        cell = idx if cell is None else cell.take(idx)
        q, slot = q.take(idx), slot.take(idx)
        base = np.broadcast_to(base, (rows.size, ncol)).ravel().take(idx)
        mask = np.broadcast_to(mask, (rows.size, ncol)).ravel().take(idx)
        # the rest probe PROBE_WINDOW slots per round as one [M, W] gather (neighbouring slots,
        # mostly one cache line): one round instead of ~8 single-slot rounds of a dozen ops each.
        # A probe ends at the key or an empty slot, whichever comes first in the window.
        steps = np.arange(1, PROBE_WINDOW + 1)
        while True:
            win = base[:, None] + (((slot - base)[:, None] + steps) & mask[:, None])   # [M, W]
            found = self.last.take(win)
            hit = found == q[:, None]
            stop = hit | (found == EMPTY32)
            first = stop.argmax(1)
            at = np.arange(first.size)
            ended, got = stop[at, first], hit[at, first]
            h = np.flatnonzero(got)
            if h.size:
                flat[cell.take(h)] = self.counts.take(win[h, first[h]])
            idx = np.flatnonzero(~ended)
            if idx.size == 0:
                return out
            cell, q, base, mask = cell.take(idx), q.take(idx), base.take(idx), mask.take(idx)
            slot = win[idx, -1]

    @property
    def nbytes(self) -> int:
        prefixes = self.dense.nbytes if self.dense is not None else self.prefixes.nbytes
        return int(self.last.nbytes + self.counts.nbytes + self.size.nbytes + self.base.nbytes + prefixes)
