"""The sparse blur of ``numba_otsu``: each pass evaluated only on the rows (of the last axis) it must.

The 8-bit image can be non-zero only on D, the union of the big cells' 3^n neighbourhoods (see
``sparse.CUT``). Walking the P passes backwards, pass p must be evaluated on stage S_p: S_P = D,
and S_{p-1} = S_p grown by one cell along pass p's axis (a 3-tap pass reads its two neighbours;
reflect-101 only re-reads a cell already in that growth, as index -1 mirrors to 1 and n to
n - 2); S_0 is what pass 1 reads of the input grid, into which only S_0's rows of seen cells are
scattered (and zeroed again after). Each stage is kept as one span [lo, hi) per row (i, j) of
the last axis, the hull of its cells in the row: on an 18.4M-trigram table at k = 50 the hulls
hold ~1.3x the cells of D, where the image's box holds ~25x. Stage arrays are indexed by box row
(i - ilo0) * n1 + j - ilo1; every stage lies in the box (each axis grows by at most 2 cells).

Exactness: every value a pass computes is opencv's value on the whole grid at that cell (its
reads are the previous pass's whole-grid values, at the mirrored index on the grid's borders),
with the same float32 operations ``x * 0.5 + (left + right) * 0.25`` in the same order as
``numba_otsu._blur_pass``; the dense box path computes the same whole-grid values on the box's
inner (out) box, and every cell either path leaves out (box cells outside the hulls, hull cells
outside D) scales to 0 in the image by the CUT argument. So the histogram, the top and the kept
cells are the dense path's, bit for bit.

Hot loops are written out in one function each: a numba call taking arrays pays their reference
counts (~15 ns a call), more than a span's work.
"""

from __future__ import annotations

import numba as nb
import numpy as np

ROW_COST = 16  # per-row overhead of a sparse pass, in cells of a dense pass (the size rule's unit)


@nb.njit(cache=True)
def next_row(f, row_hi, i, j, shape):
    """Advance (row end, i, j) to the row of the last axis holding flat index ``f`` (>= the
    current row's start): cells come in ascending order, so a step per row replaces the two
    64-bit divisions per row (~40 cycles each), which cost more than all the per-cell work."""
    while f >= row_hi:
        row_hi += shape[2]
        j += 1
        if j == shape[1]:
            j = 0
            i += 1
    return row_hi, i, j


@nb.njit(cache=True)
def stages(coords, shape, axes, r, ilo, ihi):
    """Stage p = 1..P (P passes) holds pass p's cells, stage 0 the input cells pass 1 reads
    (with no pass, D itself): per stage the spans lo, hi [P + 2, R] over the R box rows (hi 0:
    none), and the listed rows' grid coordinates ri, rj and box rows [P + 2, R], count [P + 2]
    (stage P + 1: the big cells' own spans, a step towards D)."""
    n1 = ihi[1] - ilo[1]
    R, last = (ihi[0] - ilo[0]) * n1, axes.size
    lo, hi = np.empty((last + 2, R), np.int32), np.zeros((last + 2, R), np.int32)
    ri, rj, rows = np.empty((last + 2, R), np.int64), np.empty((last + 2, R), np.int64), np.empty((last + 2, R), np.int64)
    count = np.zeros(last + 2, np.int64)
    B = last + 1
    for u in range(coords.shape[0]):  # the big cells, in ascending order: a row's come together
        i, j, l = coords[u, 0], coords[u, 1], coords[u, 2]
        b = (i - ilo[0]) * n1 + j - ilo[1]
        if hi[B, b] == 0:
            lo[B, b] = l
            ri[B, count[B]], rj[B, count[B]], rows[B, count[B]] = i, j, b
            count[B] += 1
        hi[B, b] = l + 1
    # D = B grown by r along every axis; then stage s - 1 = stage s grown by 1 along pass s's axis
    for s in range(last + 1, 0, -1):
        src, dst = s, s - 1
        g0 = g1 = g2 = 0
        if s == B:
            dst, g0, g1, g2 = last, r, r, r
        elif axes[s - 1] == 0:
            g0 = 1
        elif axes[s - 1] == 1:
            g1 = 1
        else:
            g2 = 1
        for t in range(count[src]):
            b0, i0, j0 = rows[src, t], ri[src, t], rj[src, t]
            a, z = max(lo[src, b0] - g2, 0), min(hi[src, b0] + g2, shape[2])
            for i in range(max(i0 - g0, 0), min(i0 + g0 + 1, shape[0])):
                for j in range(max(j0 - g1, 0), min(j0 + g1 + 1, shape[1])):
                    b = (i - ilo[0]) * n1 + j - ilo[1]
                    if hi[dst, b] == 0:
                        lo[dst, b], hi[dst, b] = a, z
                        ri[dst, count[dst]], rj[dst, count[dst]], rows[dst, count[dst]] = i, j, b
                        count[dst] += 1
                    else:
                        lo[dst, b], hi[dst, b] = min(lo[dst, b], a), max(hi[dst, b], z)
    return lo, hi, ri, rj, rows, count


@nb.njit(cache=True)
def work(st):
    """The cells the sparse passes evaluate plus ``ROW_COST`` per row (the size rule's count)."""
    lo, hi, _, _, rows, count = st
    w = 0
    for s in range(1, count.size - 1):
        for t in range(count[s]):
            w += hi[s, rows[s, t]] - lo[s, rows[s, t]] + ROW_COST
    return w


@nb.njit(cache=True)
def row_starts(flat, shape):
    """Index [k0 k1 + 1] of each grid row's first cell in ``flat`` (ascending)."""
    R, k2 = shape[0] * shape[1], shape[2]
    start = np.empty(R + 1, np.int64)
    g, nxt = 0, k2
    start[0] = 0
    for t in range(flat.size):
        while flat[t] >= nxt:
            g += 1
            start[g] = t
            nxt += k2
    start[g + 1:] = flat.size
    return start


@nb.njit(cache=True)
def scatter(x, flat, values, start, st, shape, clear):
    """The cells of stage 0's rows into the zero grid ``x``; ``clear``: those rows back to zero."""
    ri, rj, count = st[2], st[3], st[5]
    for t in range(count[0]):
        g = ri[0, t] * shape[1] + rj[0, t]
        if clear:
            for f in range(g * shape[2], (g + 1) * shape[2]):
                x[f] = np.float32(0.0)
        else:
            for u in range(start[g], start[g + 1]):
                x[flat[u]] = values[u]


@nb.njit(cache=True)
def blur(x, xs, ys, axes, shape, st):
    """The passes over their stages' spans (opencv's 3-tap arithmetic, reflect-101 at the grid's
    borders: index -1 reads 1, n reads n - 2): ``x`` the input grid, ``xs``, ``ys`` scratch of a
    grid or more, all flat # -> the array holding the blurred values on the last stage's spans."""
    lo, hi, ri, rj, rows, count = st
    h, q = np.float32(0.5), np.float32(0.25)
    k0, k1, k2 = shape[0], shape[1], shape[2]
    one = np.uint64(1)
    src = x
    for s in range(1, axes.size + 1):
        dst = xs if s % 2 else ys
        axis = axes[s - 1]
        for t in range(count[s]):
            i, j, b = ri[s, t], rj[s, t], rows[s, t]
            # unsigned indices: numba then drops the negative-index wraparound, and LLVM vectorises
            a, z, base = np.uint64(lo[s, b]), np.uint64(hi[s, b]), np.uint64((i * k1 + j) * k2)
            if axis == 2:
                for l in range(base + max(a, one), base + min(z, np.uint64(k2 - 1))):
                    dst[l] = src[l] * h + (src[l - one] + src[l + one]) * q
                if a == 0:
                    dst[base] = src[base] * h + (src[base + one] + src[base + one]) * q
                if z == k2:
                    e = base + np.uint64(k2 - 1)
                    dst[e] = src[e] * h + (src[e - one] + src[e - one]) * q
                continue
            if axis == 0:
                left = np.uint64(((1 if i == 0 else i - 1) * k1 + j) * k2)
                right = np.uint64(((k0 - 2 if i == k0 - 1 else i + 1) * k1 + j) * k2)
            else:
                left = np.uint64((i * k1 + (1 if j == 0 else j - 1)) * k2)
                right = np.uint64((i * k1 + (k1 - 2 if j == k1 - 1 else j + 1)) * k2)
            for l in range(a, z):
                dst[base + l] = src[base + l] * h + (src[left + l] + src[right + l]) * q
        src = dst
    return src


@nb.njit(cache=True)
def histogram(y, s, shape, st, d):
    """The 8-bit image's histogram over stage ``d``'s (D's) spans, bins > 0 only (cells outside
    D scale to <= 0.4996: bin 0), and how many cells it holds."""
    lo, hi, ri, rj, rows, count = st
    hist = np.zeros(256, np.int64)
    shown = 0
    for t in range(count[d]):
        b = rows[d, t]
        base = (ri[d, t] * shape[1] + rj[d, t]) * shape[2]
        for l in range(lo[d, b], hi[d, b]):
            v = y[base + l] * s
            if v > np.float32(0.5):
                hist[np.int64(min(np.rint(v), np.float32(255.0)))] += 1  # convertScaleAbs (>= 0)
                shown += 1
    return hist, shown


@nb.njit(cache=True)
def keep(y, flat, start, shape, st, d, s, th):
    """Which cells of ``flat`` scale above Otsu's threshold ``th`` # -> [m] bool: only cells in
    stage ``d``'s (D's) spans can (the others scale to 0)."""
    lo, hi, ri, rj, rows, count = st
    out = np.zeros(flat.size, np.bool_)
    thf = np.float32(th)
    for t in range(count[d]):
        b = rows[d, t]
        g = ri[d, t] * shape[1] + rj[d, t]
        a, z = g * shape[2] + lo[d, b], g * shape[2] + hi[d, b]
        for u in range(start[g], start[g + 1]):
            f = flat[u]
            if a <= f < z:
                v = y[f] * s
                # rint is monotone and th an integer: v <= th rounds to <= th
                out[u] = v > thf and min(np.rint(v), np.float32(255.0)) > thf
    return out
