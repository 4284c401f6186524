"""Vectorised hash lookups for n-gram counts, built and queried with whole-array numpy ops.

Why not binary search on the sorted key array: a 50^3 mask is 125k dependent searches of
log2(keys) cache misses each, which would cost more than the forward pass the mask serves. Two
structures instead:

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

from multitoken.base.errors import DataError

EMPTY64 = np.uint64(2**64 - 1)          # never a key: keys are < V^order < 2^64 - 1
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing multiplier
DENSE_PREFIXES = 1 << 22                # one-token prefixes get a dense table up to this vocabulary
PROBE_WINDOW = 8                        # slots a grid lookup probes per round after the first


def _fib(x: np.ndarray, shift) -> np.ndarray:
    """Home slot of ``x`` in a table of ``2^(64 - shift)`` slots: the top bits of ``x * GOLDEN``.

    Top bits: Fibonacci hashing spreads runs of ids evenly only there. Middle bits clump (bits
    29 and up put ids 0..50k, the frequent tokens, on 10k of a 256k-slot block's slots, so
    most lookups probed on). int64 (a view): numpy's fast gather path (uint64 indices take a
    converting, slower one), and ``base + home`` stays integer.
    """
    return ((np.asarray(x, np.uint64) * GOLDEN) >> shift).view(np.int64)


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
        self.shift = np.uint64(64 - bits)
        self.keys = np.full(1 << bits, EMPTY64, dtype=np.uint64)
        where = _place(self.keys, EMPTY64, keys, self._home(keys), lambda s, _: (s + 1) & self.mask)
        self.values = np.zeros(1 << bits, dtype=np.asarray(values).dtype)
        self.values[where] = values

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return _fib(keys, self.shift)

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
    """Counts of n-grams (sorted mixed-radix keys), looked up as a grid prefix x last token.

    A slot packs the n-gram's last token (high bits) and its count (low ``count_bits``) in one
    uint64, so a probe reads both with one gather, one cache miss (separate uint32 token and
    count arrays took as many bytes and two misses per hit). All-ones token bits are never a
    token id, so the all-ones word marks an empty slot.
    """

    def __init__(self, keys: np.ndarray, counts: np.ndarray, vocab_size: int, order: int):
        v = np.uint64(vocab_size)
        keys = np.asarray(keys, np.uint64)
        prefix, last = keys // v, keys % v
        self.count_bits = np.uint64(64 - int(vocab_size).bit_length())
        self.count_mask = np.uint64((1 << int(self.count_bits)) - 1)
        counts = np.asarray(counts)
        if counts.size and int(counts.max()) > int(self.count_mask):
            raise DataError(
                f"an n-gram count of {int(counts.max())} does not fit the lookup index ({int(self.count_bits)} bits beside the token id)",
                "counts this large need a wider index slot; prune or sample the corpus",
            )
        starts = np.flatnonzero(np.concatenate([[True], prefix[1:] != prefix[:-1]])) if keys.size else np.zeros(0, np.intp)
        lengths = np.diff(starts, append=keys.size)
        # per block (= per prefix, in key order): its row range in the sorted key / count arrays,
        # for readers that scan a short row instead of probing (decoding/sparse.py)
        self.keys, self.counts = keys, counts
        # block b's row is [row_start[b], row_start[b + 1]); the sentinel's row is empty
        self.row_start = np.append(starts, [keys.size, keys.size]).astype(np.int64)
        # plus one empty block that unseen prefixes point to: their rows probe like the others
        # (and find nothing), so a grid needs no per-row seen/unseen bookkeeping
        self.sentinel = starts.size
        # a block of 2^ceil(log2(3L)) slots: load <= 1/3, so probe runs for absent n-grams
        # (most cells of a mask grid) stay short: lookups are the hot path, memory is not
        bits = np.ceil(np.log2(3 * np.maximum(np.append(lengths, 0), 1))).astype(np.int64)
        size = np.int64(1) << bits
        self.mask = size - 1
        self.shift = (64 - bits).astype(np.uint64)
        self.base = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.int64)
        self.slots = np.full(int(size.sum()), EMPTY64, dtype=np.uint64)
        block = np.repeat(np.arange(starts.size), lengths)
        mask, base = self.mask[block], self.base[block]
        first = base + _fib(last, self.shift[block])
        packed = (last << self.count_bits) | counts.astype(np.uint64)
        _place(self.slots, EMPTY64, packed, first, lambda s, who: base[who] + ((s - base[who] + 1) & mask[who]))
        block_prefix = prefix[starts]
        if order == 2 and vocab_size <= DENSE_PREFIXES:
            # order 2: a prefix is one token, so a dense token -> block table is one gather
            self.dense = np.full(vocab_size, self.sentinel, dtype=np.int64)
            self.dense[block_prefix.astype(np.int64)] = np.arange(starts.size)
        else:
            self.dense = None
            self.prefixes = HashIndex(block_prefix, np.arange(starts.size, dtype=np.int64))

    def blocks(self, prefix_keys: np.ndarray) -> np.ndarray:
        """Block of each prefix key # [P] -> [P] int64 (``sentinel`` where the prefix is unseen)."""
        return self._blocks(np.asarray(prefix_keys, np.uint64).ravel())

    def layout(self) -> dict:
        """The raw arrays behind lookups, for compiled readers: sorted keys / counts, per-block
        row start, hash block (base, mask, shift) and slots, and the prefix -> block map (dense
        for one-token prefixes, else the open-addressing table's keys / values / shift)."""
        dense = self.dense is not None
        return dict(keys=self.keys, counts=self.counts, row_start=self.row_start,
                    base=self.base, mask=self.mask, shift=self.shift, slots=self.slots,
                    count_bits=self.count_bits, count_mask=self.count_mask, sentinel=self.sentinel,
                    dense=self.dense if dense else np.zeros(0, np.int64),
                    prefix_keys=np.zeros(0, np.uint64) if dense else self.prefixes.keys,
                    prefix_values=np.zeros(0, np.int64) if dense else self.prefixes.values,
                    prefix_shift=np.uint64(0) if dense else self.prefixes.shift,
                    prefix_mask=0 if dense else self.prefixes.mask)

    def _blocks(self, prefix_keys: np.ndarray) -> np.ndarray:
        if self.dense is not None:
            return self.dense.take(prefix_keys.astype(np.intp, copy=False))
        return self.prefixes.lookup(prefix_keys, missing=self.sentinel)

    def grid(self, prefix_keys: np.ndarray, last: np.ndarray, possible: np.ndarray | None = None) -> np.ndarray:
        """Counts ``[P, C]`` (uint64) of n-grams ``prefix_keys[p] + last[c]`` (0 where absent).

        ``possible [P, C]`` (optional): False where the caller knows the n-gram is absent;
        those cells skip the probe chains, which is where most of the time goes.
        """
        blk = self._blocks(np.asarray(prefix_keys).ravel())[:, None]   # [P, 1]
        last = np.asarray(last).ravel().astype(np.uint64)
        # the first probe of every cell as [P, C] broadcasts: a small grid is dominated by
        # per-op overhead, so the cells are handled as few, whole-array ops
        slot = _fib(last, self.shift.take(blk))
        slot += self.base.take(blk)
        found = self.slots.take(slot)
        # a slot holding the queried token minus (token << count_bits) is its count; any other
        # slot minus it is larger (a higher token) or wraps around (a lower one)
        out = found - (last << self.count_bits)
        hit = out <= self.count_mask
        out *= hit
        more = (found != EMPTY64) ^ hit  # a hit is never empty: xor drops it
        if possible is not None:
            more &= possible
        cell = np.flatnonzero(more)
        if cell.size:
            self._probe_on(out.reshape(-1), cell, slot.take(cell), last, blk.ravel())
        return out

    def _probe_on(self, flat: np.ndarray, cell: np.ndarray, slot: np.ndarray, last: np.ndarray, blk: np.ndarray) -> None:
        """Finish the flat ``cell``s whose first probe, ``slot``, held another key."""
        row, col = np.divmod(cell, last.size)
        q = last.take(col) << self.count_bits
        b = blk.take(row)
        base, mask = self.base.take(b), self.mask.take(b)
        # PROBE_WINDOW slots per round as one gather (neighbouring slots, mostly one cache line):
        # one round instead of ~8 single-slot rounds of a dozen ops each. Laid out [W, M], not
        # [M, W]: per-cell values then broadcast along the long axis (numpy loops poorly over a
        # short inner axis), and the per-cell reductions run over the short one.
        off = (slot - base) + np.arange(1, PROBE_WINDOW + 1)[:, None]
        while True:
            found = self.slots.take((off & mask) + base)
            found -= q  # as in grid: the count where the token is q
            hit = found <= self.count_mask
            # the slots before a key in its probe sequence are all taken (no deletions), so a
            # hit anywhere in the window is the key's; a cell with an empty slot and no hit is absent
            h = np.flatnonzero(hit)
            if h.size:
                flat[cell.take(h % cell.size)] = found.take(h)
            live = np.flatnonzero(~(hit | (found == EMPTY64 - q)).any(0))
            if live.size == 0:
                return
            cell, q, base, mask = cell.take(live), q.take(live), base.take(live), mask.take(live)
            off = off.take(live, 1) + PROBE_WINDOW

    @property
    def nbytes(self) -> int:
        prefixes = self.dense.nbytes if self.dense is not None else self.prefixes.nbytes
        return int(self.slots.nbytes + self.mask.nbytes + self.shift.nbytes + self.base.nbytes + self.row_start.nbytes + prefixes)
