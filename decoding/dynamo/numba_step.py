"""The compiled (numba) sparse DynaMo step (``sparse`` holds the numpy reference of each):
its entry points (``masked_cells``, ``live``, ``prepare``) and its lookup kernels: the seen
n-grams over the candidate lists (``sparse.seen_cells``), in ascending flat order of the grid,
and their masked values (``sparse.masked_values``). The blur + Otsu kernels are in
``numba_otsu`` (their row spans in ``numba_rows``).

Compiled on first use and cached on disk (``cache=True``, in ``__pycache__`` or
``NUMBA_CACHE_DIR``): ~15 s once per install (and table count dtype) on a loaded 2-core CPU, then
~0.5-0.9 s per new process to import numba and load them. ``prepare`` (called by ``generate``
before its clock starts) does either, so no decoding step pays for it. float32 values stay
float32 through every operation (numba keeps the operand type, and no fastmath), so results
match numpy's bit for bit.

Per seen prefix of the leading lists, its row of last tokens is scanned when short, else each
last candidate is probed in the prefix's hash block. On a table of hundreds of MB both are
bound by memory (the same lookup runs ~2x faster on a step whose lines are all cached), so:

* scans read ``tokens``, the keys' last tokens as uint16 (uint32 past 65,536 tokens), a
  quarter of the uint64 keys' bytes, built once per table (``scan_arrays``), and
  map them to candidate columns through an int32 table of the vocabulary (it stays in L2); a
  hit sets its column's bit, and the bits are read lowest first: hits come in token order,
  the grid wants column order, and this orders them without a sort;
* the lookup runs in passes of independent loads (every prefix's block, every row's extent,
  a touch of every line each row reads, then the scans and probes), and a probe row loads the
  home slot of every candidate before resolving any: the cache misses overlap instead of each
  waiting for the one before (a scan's or probe run's end is a data-dependent branch that stops
  the CPU from running ahead). On the 18.4M-trigram table: ~2.0 -> ~0.9 ms per order-3 lookup.
"""

from __future__ import annotations

from types import SimpleNamespace

import numba as nb
import numpy as np

from ..config import DecodeConfig
from . import sparse
from .numba_otsu import AUTO, otsu_keep
from .sparse import blur_order, layout

EMPTY64 = np.uint64(2**64 - 1)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
DEBRUIJN_INDEX = np.zeros(64, np.int64)
DEBRUIJN_INDEX[((np.uint64(1) << np.arange(64, dtype=np.uint64)) * DEBRUIJN) >> np.uint64(58)] = np.arange(64)


def scan_arrays(lay) -> tuple[np.ndarray, np.ndarray]:
    """The compiled lookup's per-table arrays, built once per layout: each key's last token
    (uint16 up to 65,536 tokens, else uint32: a quarter or half of the keys' bytes to scan;
    37 MB for 18.4M trigrams) and the token -> candidate column map (int32, reset after use)."""
    got = lay.__dict__.get("scan")
    if got is None:
        dtype = np.uint16 if lay.vocab <= 1 << 16 else np.uint32
        tokens = (np.asarray(lay.arrays["keys"]) % np.uint64(lay.vocab)).astype(dtype)
        got = lay.scan = (tokens, np.full(lay.vocab, -1, np.int32))
    return got


def seen_cells(lay, ids: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``sparse.seen_cells`` compiled # -> flat [m] ascending, counts [m] (views of scratch buffers)."""
    a = lay.arrays
    cap = int(np.prod([x.size for x in ids])) + 1  # + the lookup's scratch cell
    buf = lay.__dict__.get("buffers")
    if buf is None or buf[0].size < cap:
        buf = lay.buffers = (np.empty(cap, np.int64), np.empty(cap, np.uint64))
    tokens, pos = scan_arrays(lay)
    ids1 = ids[1] if len(ids) == 3 else np.zeros(0, np.int64)
    scan = int(sparse.SCAN_FACTOR * ids[-1].size)  # read per call: tests switch scan / probe
    m = cells(ids[0], ids1, ids[-1], lay.vocab, scan, pos, tokens, a["counts"],
              a["row_start"], a["base"], a["mask"], a["shift"], a["slots"], a["count_bits"],
              a["count_mask"], a["dense"], a["prefix_keys"], a["prefix_values"], a["prefix_shift"], a["prefix_mask"],
              a["sentinel"], buf[0], buf[1])
    return buf[0][:m], buf[1][:m]


def masked_values(lay, cands, flat: np.ndarray, count: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """``sparse.masked_values`` compiled # -> flat [m'] (a new array), masked [m'] float32."""
    m = flat.size
    out, grid = np.empty(m, np.int64), np.empty(m, np.float32)
    ratio = grid if alpha == 1 else np.empty(m, np.float32)
    p = [c.probs for c in cands] + [np.zeros(0, np.float32)]
    ids = [c.ids for c in cands] + [np.zeros(0, np.int64)]
    k1 = cands[-2].ids.size  # the 3-D view's middle axis (order 2: the first axis)
    keep = values(flat, count, k1, cands[-1].ids.size, p[0], p[1], p[2], ids[0], ids[1], ids[2],
                  lay.scale, lay.inv, alpha == 1, out, grid, ratio)
    if alpha == 1:
        return out[:keep], grid[:keep]
    np.power(ratio, np.float32(alpha), out=ratio)
    masked = grid * ratio
    nz = masked != 0
    return out[nz], masked[nz]


def masked_cells(lay, cands, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """``seen_cells`` + ``masked_values`` # -> flat [m], masked [m] float32."""
    flat, count = seen_cells(lay, [c.ids for c in cands])
    return masked_values(lay, cands, flat, count, alpha)


_SCRATCH: list[np.ndarray] = []


def _scratch(size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two float32 buffers of >= ``size`` cells for the blur and a third of zeros (the sparse
    path's input grid; ``otsu_keep`` leaves it zero), kept between calls: fresh ones of ~0.5 MB
    each (k = 50, n = 3) cost more in page faults than the whole blur."""
    if not _SCRATCH or _SCRATCH[0].size < size:
        _SCRATCH[:] = [np.empty(size, np.float32), np.empty(size, np.float32), np.zeros(size, np.float32)]
    return _SCRATCH[0], _SCRATCH[1], _SCRATCH[2]


def live(flat: np.ndarray, values: np.ndarray, shape, cfg, threshold: np.float32):
    """``sparse.live_cells`` with the blur and Otsu compiled."""
    if cfg.dynamo.static_threshold and threshold > 0:
        keep = values > threshold
        flat, values = flat[keep], values[keep]
    if cfg.dynamo.adaptive_threshold and flat.size:
        blur = cfg.dynamo.blur_kernel > 1
        shape3 = np.array((1, *shape) if len(shape) == 2 else shape, np.int64)
        # opencv's axis order, in the 3-D view's numbering (order 2's axes are 1 and 2 there)
        axes = np.array([a + 3 - len(shape) for a in blur_order(len(shape))] if blur else [], np.int64)
        scratch = _scratch(int(np.prod(shape3 + 2)))
        kept = otsu_keep(flat, values, shape3, blur, axes, int(np.prod(shape)), *scratch, AUTO)
        if kept.any():
            return flat[kept], values[kept]
    return flat, values


def prepare(table, order: int) -> None:
    """Compile (or load from the cache) every kernel for this table's arrays, outside any clock."""
    lay = layout(table, order)
    ids = np.arange(min(2, table.vocab_size), dtype=np.int64)
    # candidate lists as the kernels read them (.ids, .probs): no import of step, which imports us
    cands = [SimpleNamespace(ids=ids, probs=np.full(ids.size, 0.5, np.float32)) for _ in range(order)]
    masked_cells(lay, cands, 1.0)  # one specialisation per count dtype; alpha is a runtime value
    cfg = DecodeConfig(static_threshold=False, adaptive_threshold=True, blur_kernel=3)
    live(np.arange(2, dtype=np.int64), np.ones(2, np.float32), (2, 2, 2), cfg, np.float32(0))  # any order


# Lookup kernels ------------------------------------------------------------------------------

@nb.njit(cache=True)
def _home(x, shift):
    return np.int64((np.uint64(x) * GOLDEN) >> shift)


@nb.njit(cache=True)
def _prefix_blocks(keys, dense, pkeys, pvalues, pshift, pmask, sentinel):
    """Block of each prefix key # -> [P] (``sentinel``: unseen), from the dense map (one-token
    prefixes, small vocabularies) or open-addressing probes in the index's prefix table. Every
    key's home slot is loaded before any probe run is resolved, so that the (~2,500 at k = 50)
    cache misses in a prefix table of ~130 MB overlap (a run's end is a data-dependent branch:
    one key at a time, they do not; ~0.08 -> ~0.04 ms)."""
    out = np.empty(keys.size, np.int64)
    if dense.size:
        for t in range(keys.size):
            out[t] = dense[np.int64(keys[t])]
        return out
    home = np.empty(keys.size, np.int64)
    found = np.empty(keys.size, np.uint64)
    for t in range(keys.size):
        home[t] = _home(keys[t], pshift)
        found[t] = pkeys[home[t]]
    for t in range(keys.size):
        key, slot, f = keys[t], home[t], found[t]
        while f != key and f != EMPTY64:
            slot = (slot + 1) & pmask
            f = pkeys[slot]
        out[t] = pvalues[slot] if f == key else sentinel
    return out


@nb.njit(cache=True)
def _lowest_bit(x):
    """Index of the lowest set bit of ``x`` (de Bruijn multiply: no count-trailing-zeros in numba)."""
    return np.int64(DEBRUIJN_INDEX[((x & (~x + np.uint64(1))) * DEBRUIJN) >> np.uint64(58)])


@nb.njit(cache=True)
def _scan_row(first, length, tokens, counts, pos, row, k, hit_at, bits, out_flat, out_count, m):
    """Append the row's tokens that are candidates, in column order: the row is in token order,
    the grid in candidate order, so each hit sets its column's bit (and where it was found) and
    the set bits are then read lowest first (no sort)."""
    for t in range(first, first + length):
        c = pos[np.int64(tokens[t])]
        if c >= 0:
            hit_at[c] = t
            bits[c >> 6] |= np.uint64(1) << np.uint64(c & 63)
    base = row * k
    for w in range(bits.size):
        x = bits[w]
        while x:
            c = w * 64 + _lowest_bit(x)
            out_flat[m] = base + c
            out_count[m] = counts[hit_at[c]]
            m += 1
            x &= x - np.uint64(1)
        bits[w] = 0
    return m


@nb.njit(cache=True)
def _probe_row(blk, cols, hashed, queries, base, mask, shift, slots, count_mask, row, k, home, found,
               out_flat, out_count, m):
    """Append the counts of the candidates ``cols`` found in block ``blk``: every home slot is
    loaded first (independent loads), then each probe run is finished."""
    b, sh, mk = base[blk], shift[blk], mask[blk]
    for t in range(cols.size):
        s = np.int64(hashed[t] >> sh)
        home[t] = s
        found[t] = slots[b + s]
    for t in range(cols.size):
        f = found[t]
        q = queries[t]
        s = home[t]
        while True:
            d = f - q  # the count where the slot holds this token; anything else is larger or wraps
            if d <= count_mask:
                out_flat[m] = row * k + cols[t]
                out_count[m] = d
                m += 1
                break
            if f == EMPTY64:
                break
            s = (s + 1) & mk
            f = slots[b + s]
    return m


@nb.njit(cache=True)
def cells(ids0, ids1, last, vocab, scan_max, pos, tokens, counts, row_start, base, mask, shift, slots,
          count_bits, count_mask, dense, pkeys, pvalues, pshift, pmask, sentinel, out_flat, out_count):
    """Seen n-grams over the candidate lists (order 2: ``ids1`` empty) in ascending flat order
    # -> m, the cells written to out_flat / out_count [m] (both hold k^n + 1 cells: the last
    is scratch)."""
    k = last.size
    v = np.uint64(vocab)
    cols = np.empty(k, np.int64)  # the last list's columns of ids in the table's vocabulary
    n = 0
    for c in range(k):
        if last[c] < vocab:
            pos[last[c]] = c
            cols[n] = c
            n += 1
    cols = cols[:n]
    hashed = np.empty(n, np.uint64)
    queries = np.empty(n, np.uint64)
    for t in range(n):
        hashed[t] = np.uint64(last[cols[t]]) * GOLDEN
        queries[t] = np.uint64(last[cols[t]]) << count_bits
    home = np.empty(n, np.int64)
    found = np.empty(n, np.uint64)
    hit_at = np.empty(k, np.int64)
    bits = np.zeros((k + 63) // 64, np.uint64)
    n1 = max(ids1.size, 1)
    rows = np.empty(ids0.size * n1, np.int64)  # grid row (flat prefix index) of each prefix, then each seen one
    keys = np.empty(ids0.size * n1, np.uint64)
    r = 0
    for i in range(ids0.size):
        if ids0[i] >= vocab:
            continue
        for j in range(n1):
            key = np.uint64(ids0[i])
            if ids1.size:
                if ids1[j] >= vocab:
                    continue
                key = key * v + np.uint64(ids1[j])
            rows[r] = i * n1 + j
            keys[r] = key
            r += 1
    blks = _prefix_blocks(keys[:r], dense, pkeys, pvalues, pshift, pmask, sentinel)
    seen = 0
    for t in range(r):  # keep the seen prefixes, in row order
        if blks[t] != sentinel:
            rows[seen], blks[seen] = rows[t], blks[t]
            seen += 1
    r = seen
    firsts = np.empty(r, np.int64)
    lengths = np.empty(r, np.int64)
    for t in range(r):
        firsts[t] = row_start[blks[t]]
        lengths[t] = row_start[blks[t] + 1] - firsts[t]
    # touch the lines each row reads first (a scan row's ends and its counts, a probe row's home
    # slots): loops of independent loads, so that these misses overlap rather than come one per
    # row in the loop below, whose long row bodies keep the CPU from running ahead (~10%)
    acc = np.uint64(0)
    for t in range(r):
        first, length = firsts[t], lengths[t]
        if length <= scan_max:
            for at in range(first, first + length, 16):  # every line of the row's tokens and counts
                acc += np.uint64(tokens[at]) + np.uint64(counts[at])
            acc += np.uint64(tokens[first + length - 1]) + np.uint64(counts[first + length - 1])
        else:
            b, sh = base[blks[t]], shift[blks[t]]
            for c in range(n):
                acc += slots[b + np.int64(hashed[c] >> sh)]
    out_count[out_count.size - 1] = acc  # a use, so that the loads stay (the buffer's spare cell)
    m = 0
    for t in range(r):
        if lengths[t] <= scan_max:
            m = _scan_row(firsts[t], lengths[t], tokens, counts, pos, rows[t], k, hit_at, bits, out_flat, out_count, m)
        else:
            m = _probe_row(blks[t], cols, hashed, queries, base, mask, shift, slots, count_mask, rows[t], k,
                           home, found, out_flat, out_count, m)
    for t in range(n):
        pos[last[cols[t]]] = -1
    return m


@nb.njit(cache=True)
def values(flat, count, k1, k2, probs0, probs1, probs2, ids0, ids1, ids2, scale, inv, fuse, out_flat, grid, ratio):
    """Grid value and ratio of each seen cell (``flat`` ascending over a [k0, k1, k2] grid;
    order 2: ``probs2`` empty, the grid [k1, k2]) in the dense path's float32 operation order
    # -> cells written. ``fuse`` (alpha 1): their product into ``grid``, zero products dropped;
    else both, for numpy's power. The axes' indices are divided out once per row, not per cell."""
    k = k2
    last_ids, last_probs = (ids2, probs2) if probs2.size else (ids1, probs1)
    inv_last = np.empty(k, np.float32)  # the last axis' 1 / count, gathered once
    for c in range(k):
        inv_last[c] = inv[last_ids[c]]
    row_hi = np.int64(-1)
    i = j = np.int64(0)
    g01 = inv_i = inv_j = np.float32(0.0)
    keep = 0
    for t in range(flat.size):
        f = flat[t]
        if f >= row_hi:  # a new row (prefix) of the grid
            row = f // k
            row_hi = (row + 1) * k
            i, j = row // k1, row % k1
            if probs2.size:
                g01, inv_i, inv_j = probs0[i] * probs1[j], inv[ids0[i]], inv[ids1[j]]
            else:
                g01, inv_j = probs0[j], inv[ids0[j]]
        c = f - (row_hi - k)
        # the same float32 operations in the same order as the dense path
        g = g01 * last_probs[c]
        r = np.float32(count[t]) * scale
        if probs2.size:  # order 3
            r = r * inv_i
        r = r * inv_j
        r = r * inv_last[c]
        if fuse:
            x = g * r
            if x != 0:
                out_flat[keep] = f
                grid[keep] = x
                keep += 1
        else:
            out_flat[t] = f
            grid[t] = g
            ratio[t] = r
    return keep if fuse else flat.size
