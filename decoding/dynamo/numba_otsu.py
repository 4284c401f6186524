"""numba blur + Otsu of the sparse DynaMo step (``sparse.otsu_survivors`` is the numpy reference).

The grid is seen as 3-D (order 2: a leading axis of 1). Only the cells above ``sparse.CUT``
times the largest ("big" cells: ~1k of ~25k on an 18.4M-trigram table at k = 50) can make a
non-zero pixel, so their coordinates are gathered once. Two paths compute the same image:

* sparse (``numba_rows``): each pass only on the row spans it must evaluate, walking back from
  D, the union of the big cells' 3^n neighbourhoods (median ~5k cells where the box holds the
  whole 125k-cell grid), over a full-grid input kept zero between calls;
* box: zero, fill and blur the whole box around the big cells with dense passes.

Both compute opencv's whole-grid value at every cell they report, with the same float32
operations in the same order, and every cell either leaves out scales to 0 (the CUT argument),
so they agree bit for bit; ``otsu_keep`` takes the box only when the sparse spans' work (cells
plus a per-row overhead) exceeds the box's cells. Per-cell passes over ``flat`` walk it in
ascending order and divide once per row of the last axis. No per-cell coordinate array is
written (on ~25k cells it cost more than the blur).

numba's disk cache keys a function by its own file only: after editing ``numba_rows``, delete
``__pycache__/numba_otsu*.nb*`` or the cached ``otsu_keep`` keeps the old code.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from . import numba_rows as rows_
from .numba_rows import next_row
from .sparse import CUT, TINY, otsu_threshold

_otsu = nb.njit(cache=True)(otsu_threshold)


@nb.njit(cache=True)
def _blur_pass(x, out, axis, lo, full):
    """``sparse._blur_axis`` on a box padded by one cell per side, into ``out``'s interior:
    opencv's 3-tap arithmetic ``x * 0.5 + (left + right) * 0.25``; this axis' margins of ``x``
    are set to the reflect-101 neighbour at the grid's borders, zeros elsewhere (cells past the
    box), so the loops carry no branch. Every loop runs along the contiguous last axis (SIMD);
    ``out``'s margins are left as they are (a pass reads only its own axis' margins)."""
    n = x.shape[axis] - 2
    at_lo, at_hi = lo == 0, lo + n == full
    zero = np.float32(0.0)
    if axis == 0:
        x[0] = zero
        x[n + 1] = zero
        if at_lo:
            x[0] = x[2]
        if at_hi:
            x[n + 1] = x[n - 1]
    elif axis == 1:
        x[:, 0] = zero
        x[:, n + 1] = zero
        if at_lo:
            x[:, 0] = x[:, 2]
        if at_hi:
            x[:, n + 1] = x[:, n - 1]
    else:
        x[:, :, 0] = zero
        x[:, :, n + 1] = zero
        if at_lo:
            x[:, :, 0] = x[:, :, 2]
        if at_hi:
            x[:, :, n + 1] = x[:, :, n - 1]
    h, q = np.float32(0.5), np.float32(0.25)
    n0, n1, n2 = x.shape[0] - 1, x.shape[1] - 1, x.shape[2] - 1
    for i in range(1, n0):
        for j in range(1, n1):
            o, c = out[i, j], x[i, j]
            if axis == 2:
                for l in range(1, n2):
                    o[l] = c[l] * h + (c[l - 1] + c[l + 1]) * q
            else:
                a = x[i - 1, j] if axis == 0 else x[i, j - 1]
                b = x[i + 1, j] if axis == 0 else x[i, j + 1]
                for l in range(1, n2):
                    o[l] = c[l] * h + (a[l] + b[l]) * q


@nb.njit(cache=True)
def _big_cells(flat, values, shape, cut):
    """Grid coordinates [b, 3] and values [b] of the cells > ``cut``, and their bounds lo, hi [3]."""
    b = 0
    for t in range(flat.size):
        if values[t] > cut:
            b += 1
    coords = np.empty((b, 3), np.int64)
    vals = np.empty(b, np.float32)
    row_hi, i, j = shape[2], np.int64(0), np.int64(0)
    lo0 = lo1 = lo2 = np.int64(1 << 62)  # scalars, not arrays: the loop's stores cannot alias them
    hi0 = hi1 = hi2 = np.int64(-1)
    u = 0
    for t in range(flat.size):
        if values[t] > cut:
            row_hi, i, j = next_row(flat[t], row_hi, i, j, shape)
            l = flat[t] - (row_hi - shape[2])
            coords[u, 0], coords[u, 1], coords[u, 2] = i, j, l
            vals[u] = values[t]
            u += 1
            lo0, hi0 = min(lo0, i), max(hi0, i + 1)  # i only grows, but this costs nothing
            lo1, hi1 = min(lo1, j), max(hi1, j + 1)
            lo2, hi2 = min(lo2, l), max(hi2, l + 1)
    return coords, vals, np.array([lo0, lo1, lo2]), np.array([hi0, hi1, hi2])


@nb.njit(cache=True)
def _fill(x, flat, values, shape, ilo):
    """Scatter the cells inside the box into the padded box ``x`` (zeroed): box cell c at c + 1."""
    d0, d1, d2 = x.shape
    xf = x.ravel()
    n0, n1, n2 = np.uint64(d0 - 2), np.uint64(d1 - 2), np.uint64(d2 - 2)
    row_hi, i, j = shape[2], np.int64(0), np.int64(0)
    base, inrow = np.int64(0), False
    for t in range(flat.size):
        f = flat[t]
        if f >= row_hi or t == 0:  # a new row (the first cell's may be row 0)
            row_hi, i, j = next_row(f, row_hi, i, j, shape)
            c0, c1 = i - ilo[0], j - ilo[1]
            inrow = (np.uint64(c0) < n0) & (np.uint64(c1) < n1)  # unsigned: 0 <= c < n in one compare
            base = ((c0 + 1) * d1 + c1 + 1) * d2 + 1 - ilo[2] - (row_hi - shape[2])
        if inrow and np.uint64(f - (row_hi - shape[2]) - ilo[2]) < n2:
            xf[base + f] = values[t]


@nb.njit(cache=True)
def _keep(x, flat, shape, ilo, olo, ohi, s, th):
    """Which cells of the out box [olo, ohi) scale above Otsu's threshold ``th`` # -> [m] bool."""
    d0, d1, d2 = x.shape
    xf = x.ravel()
    w0, w1, w2 = np.uint64(ohi[0] - olo[0]), np.uint64(ohi[1] - olo[1]), np.uint64(ohi[2] - olo[2])
    keep = np.zeros(flat.size, np.bool_)
    row_hi, i, j = shape[2], np.int64(0), np.int64(0)
    base, inrow, lo2 = np.int64(0), False, np.int64(0)
    for t in range(flat.size):
        f = flat[t]
        if f >= row_hi or t == 0:
            row_hi, i, j = next_row(f, row_hi, i, j, shape)
            inrow = (np.uint64(i - olo[0]) < w0) & (np.uint64(j - olo[1]) < w1)
            lo2 = row_hi - shape[2]
            base = ((i - ilo[0] + 1) * d1 + j - ilo[1] + 1) * d2 + 1 - ilo[2] - lo2
        if inrow and np.uint64(f - lo2 - olo[2]) < w2:
            keep[t] = min(np.rint(xf[base + f] * s), np.float32(255.0)) > th
    return keep


AUTO, SPARSE, BOX = 0, 1, 2  # otsu_keep's ``path``: by the size rule, or forced (tests)


@nb.njit(cache=True)
def _top(y, coords, big, near, r, shape):
    """The blurred grid's (flat ``y``) largest cell: it lies next to a cell >= xmax / 8 (see
    sparse.CUT), so only the neighbourhoods of the big cells >= ``near`` are searched."""
    top = np.float32(0.0)
    for u in range(big.size):
        if big[u] >= near:
            i0, j0, l0 = coords[u, 0], coords[u, 1], coords[u, 2]
            for i in range(max(i0 - r, 0), min(i0 + r + 1, shape[0])):
                for j in range(max(j0 - r, 0), min(j0 + r + 1, shape[1])):
                    base = (i * shape[1] + j) * shape[2]
                    for l in range(max(l0 - r, 0), min(l0 + r + 1, shape[2])):
                        top = max(top, y[base + l])
    return top


@nb.njit(cache=True)
def _sparse(flat, values, shape, axes, total, xs, ys, zs, coords, big, near, r, ilo, ihi, st):
    """The image on the stages' spans only (``numba_rows``); ``zs``: a zero grid, left zero."""
    start = rows_.row_starts(flat, shape)
    rows_.scatter(zs, flat, values, start, st, shape, False)
    y = rows_.blur(zs, xs, ys, axes, shape, st)
    s = np.float32(255.0 / np.float64(_top(y, coords, big, near, r, shape)))
    hist, shown = rows_.histogram(y, s, shape, st, axes.size)
    hist[0] += total - shown
    kept = rows_.keep(y, flat, start, shape, st, axes.size, s, _otsu(hist, total))
    rows_.scatter(zs, flat, values, start, st, shape, True)  # zs back to zero
    return kept


@nb.njit(cache=True)
def otsu_keep(flat, values, shape, blur, axes, total, xs, ys, zs, path):
    """``sparse.otsu_survivors`` on a 3-D view of the grid (order 2: a leading axis of 1);
    ``xs``, ``ys``: float32 scratch of (k0 + 2)(k1 + 2)(k2 + 2) cells or more; ``zs``: float32
    zeros of k0 k1 k2 cells or more, left zero. ``path``: AUTO (the cheaper by a count of cells),
    SPARSE (each pass on its needed rows' spans) or BOX (dense passes over the box)."""
    xmax = np.float32(0.0)
    for t in range(values.size):
        xmax = max(xmax, values[t])
    cut = CUT * np.float64(xmax) if blur and xmax > TINY else 0.0
    # the only cells whose neighbourhoods the image shows; values are > 0 (masked != 0, then
    # normalised) or underflowed to 0, whose neighbourhoods blur to exactly 0 unless a cell > 0
    # is near, so with cut 0 the cells > 0 still reach every non-zero pixel
    coords, big, lo, hi = _big_cells(flat, values, shape, cut)
    r = 1 if blur else 0
    ilo, ihi, olo, ohi = np.empty(3, np.int64), np.empty(3, np.int64), np.empty(3, np.int64), np.empty(3, np.int64)
    for a in range(3):
        ilo[a], ihi[a] = max(lo[a] - 2 * r, 0), min(hi[a] + 2 * r, shape[a])
        olo[a], ohi[a] = max(lo[a] - r, 0), min(hi[a] + r, shape[a])
    # the image's top lies next to a cell >= xmax / 8 (see sparse.CUT): search only there
    near = xmax * np.float32(0.125) if xmax > TINY else np.float32(0.0)
    # the blur's box, padded by one cell per side (box cell c sits at c + 1)
    d0, d1, d2 = ihi[0] - ilo[0] + 2, ihi[1] - ilo[1] + 2, ihi[2] - ilo[2] + 2
    if path != BOX:
        st = rows_.stages(coords, shape, axes, r, ilo, ihi)
        # measured (k = 50, n = 3): the box path costs ~2 ns per box cell (zeroing, fill, passes,
        # histogram), the sparse path ~2.2 ns per unit of ``work`` (spans plus per-row overhead)
        if path == SPARSE or rows_.work(st) < (d0 - 2) * (d1 - 2) * (d2 - 2):
            return _sparse(flat, values, shape, axes, total, xs, ys, zs, coords, big, near, r, ilo, ihi, st)
    xf, yf = xs[:d0 * d1 * d2], ys[:d0 * d1 * d2]  # ping-pong: each pass writes the other's interior
    xf[:] = 0
    _fill(xf.reshape((d0, d1, d2)), flat, values, shape, ilo)
    for a in axes:
        _blur_pass(xf.reshape((d0, d1, d2)), yf.reshape((d0, d1, d2)), a, ilo[a], shape[a])
        xf, yf = yf, xf
    x = xf.reshape((d0, d1, d2))
    b0, b1, b2 = olo[0] - ilo[0] + 1, olo[1] - ilo[1] + 1, olo[2] - ilo[2] + 1
    e0, e1, e2 = ohi[0] - ilo[0] + 1, ohi[1] - ilo[1] + 1, ohi[2] - ilo[2] + 1
    top = np.float32(0.0)
    for u in range(big.size):
        if big[u] >= near:
            i0, j0, l0 = coords[u, 0] - ilo[0] + 1, coords[u, 1] - ilo[1] + 1, coords[u, 2] - ilo[2] + 1
            for i in range(max(i0 - r, b0), min(i0 + r + 1, e0)):
                for j in range(max(j0 - r, b1), min(j0 + r + 1, e1)):
                    for l in range(max(l0 - r, b2), min(l0 + r + 1, e2)):
                        top = max(top, x[i, j, l])
    s = np.float32(255.0 / np.float64(top))
    hist = np.zeros(256, np.int64)
    shown = 0  # cells of the out box in a bin > 0; rint(y) is 0 for y <= 0.5
    if 27 * big.size < (e0 - b0) * (e1 - b1) * (e2 - b2):  # few big cells: visit their neighbourhoods only
        seen = np.zeros(x.shape, np.bool_)
        for u in range(big.size):
            i0, j0, l0 = coords[u, 0] - ilo[0] + 1, coords[u, 1] - ilo[1] + 1, coords[u, 2] - ilo[2] + 1
            for i in range(max(i0 - r, b0), min(i0 + r + 1, e0)):
                for j in range(max(j0 - r, b1), min(j0 + r + 1, e1)):
                    for l in range(max(l0 - r, b2), min(l0 + r + 1, e2)):
                        if not seen[i, j, l]:
                            seen[i, j, l] = True
                            y = x[i, j, l] * s
                            if y > np.float32(0.5):
                                hist[np.int64(min(np.rint(y), np.float32(255.0)))] += 1
                                shown += 1
    else:
        for i in range(b0, e0):
            for j in range(b1, e1):
                for l in range(b2, e2):
                    y = x[i, j, l] * s
                    if y > np.float32(0.5):
                        hist[np.int64(min(np.rint(y), np.float32(255.0)))] += 1  # convertScaleAbs (>= 0)
                        shown += 1
    hist[0] += total - shown
    return _keep(x, flat, shape, ilo, olo, ohi, s, _otsu(hist, total))
