"""numba kernels of the sparse DynaMo step (``sparse.py`` holds the numpy reference of each).

Compiled on first use and cached on disk (``cache=True``, in ``__pycache__`` or
``NUMBA_CACHE_DIR``): ~15 s once per install (and table count dtype) on a loaded 2-core CPU, then
~0.5-0.9 s per new process to import numba and load them. ``prepare`` (called by ``generate``
before its clock starts) does either, so no decoding step pays for it. float32 values stay float32 through every operation (numba keeps the
operand type, and no fastmath), so results match numpy's bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import numba as nb
import numpy as np

from . import sparse
from . import sparse_lookup as lookup
from .sparse import CUT, TINY, blur_order, layout, otsu_threshold

_otsu = nb.njit(cache=True)(otsu_threshold)


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
    m = lookup.cells(ids[0], ids1, ids[-1], lay.vocab, scan, pos, tokens, a["counts"],
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
    keep = lookup.values(flat, count, k1, cands[-1].ids.size, p[0], p[1], p[2], ids[0], ids[1], ids[2],
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
def _neighbourhood_max(x, coords, values, big, ilo, b0, b1, b2, e0, e1, e2, r):
    """Largest cell of the out box [b, e) of padded box ``x`` within ``r`` of a cell >= ``big``."""
    top = np.float32(0.0)
    for t in range(values.size):
        if values[t] >= big:
            i0, j0, l0 = coords[t, 0] - ilo[0] + 1, coords[t, 1] - ilo[1] + 1, coords[t, 2] - ilo[2] + 1
            for i in range(max(i0 - r, b0), min(i0 + r + 1, e0)):
                for j in range(max(j0 - r, b1), min(j0 + r + 1, e1)):
                    for l in range(max(l0 - r, b2), min(l0 + r + 1, e2)):
                        top = max(top, x[i, j, l])
    return top


@nb.njit(cache=True)
def _otsu_keep(flat, values, shape, blur, axes, total, xs, ys):
    """``sparse.otsu_survivors`` on a 3-D view of the grid (order 2: a leading axis of 1);
    ``xs``, ``ys``: float32 scratch of (k0 + 2)(k1 + 2)(k2 + 2) cells or more."""
    m = flat.size
    coords = np.empty((m, 3), np.int64)
    xmax = np.float32(0.0)
    row_hi, i, j = np.int64(-1), np.int64(0), np.int64(0)
    for t in range(m):  # flat is ascending: divide once per row of the last axis, not per cell
        f = flat[t]
        if f >= row_hi:
            row = f // shape[2]
            row_hi = (row + 1) * shape[2]
            i, j = row // shape[1], row % shape[1]
        coords[t, 0], coords[t, 1], coords[t, 2] = i, j, f - (row_hi - shape[2])
        xmax = max(xmax, values[t])
    cut = CUT * np.float64(xmax) if blur and xmax > TINY else 0.0
    lo0 = lo1 = lo2 = np.int64(1 << 62)  # scalars, not arrays: the loops' stores cannot alias them
    hi0 = hi1 = hi2 = np.int64(-1)
    for t in range(m):
        if values[t] > cut:
            lo0, hi0 = min(lo0, coords[t, 0]), max(hi0, coords[t, 0] + 1)
            lo1, hi1 = min(lo1, coords[t, 1]), max(hi1, coords[t, 1] + 1)
            lo2, hi2 = min(lo2, coords[t, 2]), max(hi2, coords[t, 2] + 1)
    lo, hi = np.array([lo0, lo1, lo2]), np.array([hi0, hi1, hi2])
    r = 1 if blur else 0
    ilo, ihi, olo, ohi = np.empty(3, np.int64), np.empty(3, np.int64), np.empty(3, np.int64), np.empty(3, np.int64)
    for a in range(3):
        ilo[a], ihi[a] = max(lo[a] - 2 * r, 0), min(hi[a] + 2 * r, shape[a])
        olo[a], ohi[a] = max(lo[a] - r, 0), min(hi[a] + r, shape[a])
    # the blur's box, padded by one cell per side (box cell c sits at c + 1); each cell's flat
    # index in it (-1 outside the box) and whether it lies in the out box
    d0, d1, d2 = ihi[0] - ilo[0] + 2, ihi[1] - ilo[1] + 2, ihi[2] - ilo[2] + 2
    at = np.empty(m, np.int64)
    shows = np.empty(m, np.bool_)
    xf = xs[:d0 * d1 * d2]
    xf[:] = 0
    i0, i1, i2, o0, o1, o2 = ilo[0], ilo[1], ilo[2], olo[0], olo[1], olo[2]
    n0, n1, n2 = np.uint64(d0 - 2), np.uint64(d1 - 2), np.uint64(d2 - 2)
    w0, w1, w2 = np.uint64(ohi[0] - o0), np.uint64(ohi[1] - o1), np.uint64(ohi[2] - o2)
    for t in range(m):
        c0, c1, c2 = coords[t, 0] - i0, coords[t, 1] - i1, coords[t, 2] - i2
        # unsigned compares: 0 <= c < n without a branch per bound
        inside = (np.uint64(c0) < n0) & (np.uint64(c1) < n1) & (np.uint64(c2) < n2)
        p = ((c0 + 1) * d1 + c1 + 1) * d2 + c2 + 1
        at[t] = p if inside else -1
        if inside:
            xf[p] = values[t]
        e0, e1, e2 = coords[t, 0] - o0, coords[t, 1] - o1, coords[t, 2] - o2
        shows[t] = (np.uint64(e0) < w0) & (np.uint64(e1) < w1) & (np.uint64(e2) < w2)
    yf = ys[:d0 * d1 * d2]  # ping-pong: each pass writes the other buffer's interior
    for a in axes:
        _blur_pass(xf.reshape((d0, d1, d2)), yf.reshape((d0, d1, d2)), a, ilo[a], shape[a])
        xf, yf = yf, xf
    x = xf.reshape((d0, d1, d2))
    b0, b1, b2 = olo[0] - ilo[0] + 1, olo[1] - ilo[1] + 1, olo[2] - ilo[2] + 1
    e0, e1, e2 = ohi[0] - ilo[0] + 1, ohi[1] - ilo[1] + 1, ohi[2] - ilo[2] + 1
    # the image's top lies next to a cell >= xmax / 8 (see sparse.CUT): search only there
    big = xmax * np.float32(0.125) if xmax > TINY else np.float32(0.0)
    top = _neighbourhood_max(x, coords, values, big, ilo, b0, b1, b2, e0, e1, e2, r)
    s = np.float32(255.0 / np.float64(top))
    hist = np.zeros(256, np.int64)
    shown = 0  # cells of the out box in a bin > 0; rint(y) is 0 for y <= 0.5
    if 27 * m < (e0 - b0) * (e1 - b1) * (e2 - b2):  # few cells: visit their neighbourhoods only
        seen = np.zeros(x.shape, np.bool_)
        for t in range(m):
            if values[t] > cut:  # the only neighbourhoods the image shows
                i0, j0, l0 = coords[t, 0] - ilo[0] + 1, coords[t, 1] - ilo[1] + 1, coords[t, 2] - ilo[2] + 1
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
    t = _otsu(hist, total)
    keep = np.zeros(m, np.bool_)
    for c in range(m):
        if shows[c]:  # the out box lies inside the blur's box
            keep[c] = min(np.rint(xf[at[c]] * s), np.float32(255.0)) > t
    return keep


_SCRATCH: list[np.ndarray] = []


def _scratch(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Two float32 buffers of >= ``size`` cells for the blur, kept between calls: fresh ones of
    ~0.5 MB each (k = 50, n = 3) cost more in page faults than the whole blur."""
    if not _SCRATCH or _SCRATCH[0].size < size:
        _SCRATCH[:] = [np.empty(size, np.float32), np.empty(size, np.float32)]
    return _SCRATCH[0], _SCRATCH[1]


def live(flat: np.ndarray, values: np.ndarray, shape, cfg, threshold: np.float32):
    """``sparse.live_cells`` with the blur and Otsu compiled."""
    if cfg.static_threshold and threshold > 0:
        keep = values > threshold
        flat, values = flat[keep], values[keep]
    if cfg.adaptive_threshold and flat.size:
        blur = cfg.blur_kernel > 1
        shape3 = np.array((1, *shape) if len(shape) == 2 else shape, np.int64)
        # opencv's axis order, in the 3-D view's numbering (order 2's axes are 1 and 2 there)
        axes = np.array([a + 3 - len(shape) for a in blur_order(len(shape))] if blur else [], np.int64)
        kept = _otsu_keep(flat, values, shape3, blur, axes, int(np.prod(shape)), *_scratch(int(np.prod(shape3 + 2))))
        if kept.any():
            return flat[kept], values[kept]
    return flat, values


def prepare(table, order: int) -> None:
    """Compile (or load from the cache) every kernel for this table's arrays, outside any clock."""
    lay = layout(table, order)
    ids = np.arange(min(2, table.vocab_size), dtype=np.int64)
    # candidate lists as the kernels read them (.ids, .probs): no import of dynamic, which imports us
    cands = [SimpleNamespace(ids=ids, probs=np.full(ids.size, 0.5, np.float32)) for _ in range(order)]
    masked_cells(lay, cands, 1.0)  # one specialisation per count dtype; alpha is a runtime value
    cfg = SimpleNamespace(static_threshold=False, adaptive_threshold=True, blur_kernel=3)
    live(np.arange(2, dtype=np.int64), np.ones(2, np.float32), (2, 2, 2), cfg, np.float32(0))  # any order
