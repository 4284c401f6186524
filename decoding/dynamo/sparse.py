"""An exact sparse DynaMo step: the dense grid's live cells from only the cells it can reach.

With absent n-grams at ratio 0 (the table's default) and a mask in force (alpha_c > 0), a cell of
the masked grid is non-zero only if its n-gram was seen: a few thousand of the k^n cells. This
module finds them (``seen_cells``: for each seen prefix of the leading candidate lists, its seen
last tokens among the last list; short rows of the sorted key array are scanned, long ones probed
in their hash block), then reproduces ``step.joint_cells`` on them bit for bit:

* grid, ratio and normalisation in the dense path's float32 operation order; the total is the
  float64 numpy sum of the same compact array of non-zero masked cells (ascending flat order)
  that the dense path sums;
* the static threshold;
* blur + Otsu only over the box of cells the 8-bit image can show (``image_box``: around the
  surviving cells within 1/4080 of the largest, grown by the kernel radius; every other cell
  provably scales to 0): opencv's 3-tap arithmetic ``x * 0.5 + (left + right) * 0.25`` with
  reflect-101 borders, axes in opencv's order (2-D: 1, 0; 3-D: 1, 0, 2), then
  ``convertScaleAbs`` (float32 scale, round half to even) and opencv's Otsu on the 256-bin
  histogram, whose bin 0 also counts every cell outside the box.

Where this is not exact (no table or a stand-in without the layout, alpha_c 0, absent != 0, a
blur kernel other than 0 / 1 / 3, an axis shorter than 2 under the blur, more than 512 candidates,
no seen cell), ``joint_cells`` takes the dense path. Kernels: ``numba_step`` (its lookup and
values; its blur and Otsu in ``numba_otsu``: there the blur runs only on the row spans around the
big cells, ``numba_rows``) when numba is installed (``pip install multitoken[fast]``), else the
numpy code here; ``step.sparse_live`` chooses.
"""

from __future__ import annotations

import numpy as np

SCAN_FACTOR = 8  # scan a prefix's row when it holds <= 8 keys per candidate, else probe k times
DENSE_PAIRS = 1 << 20  # two-token prefixes get a dense block map up to a 1024-token vocabulary (8 MB)
_HALF, _QUARTER = np.float32(0.5), np.float32(0.25)


def applies(cands, cfg, table) -> bool:
    """True when the sparse step computes exactly what the dense one does (see the module doc)."""
    order = len(cands)
    if table is None or not hasattr(table, "inv_unigrams") or cfg.dynamo.alpha_c <= 0 or table.absent != 0:
        return False
    if not 2 <= order <= min(3, table.max_order):
        return False
    if cfg.dynamo.adaptive_threshold and cfg.dynamo.blur_kernel > 1:
        if cfg.dynamo.blur_kernel != 3 or min(c.ids.size for c in cands) < 2 or cands[-1].ids.size > 512:
            return False
    return True


class Layout:
    """What a sparse lookup of one order reads, gathered once per table and order."""

    def __init__(self, table, order: int):
        index = table.index(order)
        self.order, self.vocab = order, table.vocab_size
        self.arrays = index.layout()
        self.index = index
        self.inv = table.inv_unigrams
        self.scale = table.ratio_scale(order)
        self.pos = np.full(self.vocab, -1, dtype=np.int64)  # token -> index in the last list (reset after use)
        a = self.arrays
        if order == 3 and self.vocab ** 2 <= DENSE_PAIRS:
            # small vocabularies: a dense (a, b) -> block map (one gather, no probe chain) for
            # the compiled lookup; the sentinel block's row is empty
            blocks = a["row_start"].size - 2
            dense = np.full(self.vocab ** 2, a["sentinel"], dtype=np.int64)
            dense[np.asarray(a["keys"])[a["row_start"][:blocks]] // np.uint64(self.vocab)] = np.arange(blocks)
            self.arrays = dict(a, dense=dense)


def layout(table, order: int) -> Layout:
    cache = table.__dict__.setdefault("_sparse_layouts", {})
    if order not in cache:
        cache[order] = Layout(table, order)
    return cache[order]


def _valid(ids: np.ndarray, vocab: int) -> np.ndarray:
    """Ids past the table's vocabulary (embedding padding) never occur: their cells stay absent."""
    return np.flatnonzero(ids < vocab)


def seen_cells(lay: Layout, ids: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Flat grid indices [m] (ascending) and counts [m] of the seen n-grams over the candidate
    lists ``ids`` (numpy: vectorised scan of short rows, block probes of long ones)."""
    v, a = np.uint64(lay.vocab), lay.arrays
    lead = [_valid(x, lay.vocab) for x in ids[:-1]]  # candidate indices on the leading axes
    pidx = lead[0]
    pkey = ids[0][pidx].astype(np.uint64)
    for axis in range(1, len(lead)):  # row-major combos of the leading axes, as the grid's flat order
        col = lead[axis]
        pidx = (pidx[:, None] * ids[axis].size + col[None, :]).ravel()
        pkey = (pkey[:, None] * v + ids[axis][col].astype(np.uint64)[None, :]).ravel()
    blk = a["dense"][pkey.astype(np.int64)] if a["dense"].size else lay.index.blocks(pkey)
    hit = blk != a["sentinel"]
    pidx, pkey, blk = pidx[hit], pkey[hit], blk[hit]
    last = ids[-1]
    k = last.size
    start = a["row_start"][blk]
    length = a["row_start"][blk + 1] - start
    short = length <= SCAN_FACTOR * k
    flats, counts = [], []
    if short.any():
        s, n, p = start[short], length[short], pidx[short]
        total = int(n.sum())
        offsets = np.repeat(s - np.cumsum(n) + n, n) + np.arange(total)  # each row's key indices
        rows = np.repeat(p, n)
        tok = (a["keys"][offsets] % v).astype(np.int64)
        ok = _valid(last, lay.vocab)
        lay.pos[last[ok]] = ok
        col = lay.pos[tok]
        lay.pos[last[ok]] = -1
        keep = col >= 0
        flats.append(rows[keep] * k + col[keep])
        counts.append(a["counts"][offsets[keep]].astype(np.uint64))
    if (~short).any():
        p = pidx[~short]
        grid = lay.index.grid(pkey[~short], np.where(last < lay.vocab, last, 0))  # [P, k] uint64
        grid[:, last >= lay.vocab] = 0
        r, c = np.nonzero(grid)
        flats.append(p[r] * k + c)
        counts.append(grid[r, c])
    if not flats:
        return np.zeros(0, np.int64), np.zeros(0, np.uint64)
    flat, count = np.concatenate(flats), np.concatenate(counts)
    order = np.argsort(flat, kind="stable")
    return flat[order], count[order]


def masked_values(lay: Layout, cands, flat: np.ndarray, count: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """grid * ratio^alpha on the seen cells, the dense path's float32 operations in its order;
    the cells whose product is 0 (underflow) dropped, as the dense path's sum skips nothing
    but adds nothing for them either # -> flat [m'], masked [m'] float32."""
    shape = tuple(c.ids.size for c in cands)
    axes = np.unravel_index(flat, shape)
    grid = cands[0].probs[axes[0]]
    for c, i in zip(cands[1:], axes[1:]):
        grid = grid * c.probs[i]  # float32, as np.multiply.outer
    r = np.multiply(count, lay.scale, dtype=np.float32)
    for c, i in zip(cands, axes):
        r *= lay.inv[c.ids[i]]
    if alpha != 1:
        np.power(r, np.float32(alpha), out=r)
    masked = grid * r
    nz = masked != 0
    return flat[nz], masked[nz]


def _blur_axis(x: np.ndarray, axis: int, lo: int, full: int) -> np.ndarray:
    """One 3-tap pass of opencv's Gaussian over ``axis`` of a box starting at ``lo`` of a grid
    axis of ``full`` cells: reflect-101 at the grid's borders, zeros past the box's edges."""
    nb = x.shape[axis]
    g = lo + np.arange(nb)
    left = np.where(g == 0, 1, g - 1) - lo
    right = np.where(g == full - 1, full - 2, g + 1) - lo
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, 1)
    ext = np.pad(x, pad)  # index nb is a zero slab: a neighbour outside the box
    left = np.where((left >= 0) & (left < nb), left, nb)
    right = np.where((right >= 0) & (right < nb), right, nb)
    return x * _HALF + (ext.take(left, axis) + ext.take(right, axis)) * _QUARTER


def blur_order(ndim: int) -> tuple[int, ...]:
    """opencv's pass order in ``step.gaussian_blur``: rows (axis 1) then columns (axis 0),
    then for a 3-D grid the channel axis 2."""
    return (1, 0) if ndim == 2 else (1, 0, 2)


def otsu_cv2(hist: np.ndarray) -> int:
    """opencv's Otsu threshold of the 8-bit image with histogram ``hist`` [256]: Otsu reads only
    the histogram, so an image of the same cells in bin order gives it (numpy has no loop as
    cheap as this call; the compiled kernel runs ``otsu_threshold`` instead)."""
    import cv2

    img = np.repeat(np.arange(256, dtype=np.uint8), hist).reshape(1, -1)
    return int(cv2.threshold(img, 0, 255, cv2.THRESH_BINARY | cv2.THRESH_OTSU)[0])


def otsu_threshold(hist, total: int) -> int:
    """opencv's ``getThreshVal_Otsu_8u`` on a 256-bin histogram of ``total`` cells (same double
    arithmetic, same skips, first maximum wins on ties)."""
    scale = 1.0 / total
    mu = 0.0
    for i in range(256):
        mu += i * float(hist[i])
    mu *= scale
    mu1 = q1 = max_sigma = 0.0
    best = 0
    eps = 1.1920928955078125e-07  # FLT_EPSILON
    for i in range(256):
        p = float(hist[i]) * scale
        mu1 *= q1
        q1 += p
        q2 = 1.0 - q1
        if min(q1, q2) < eps or max(q1, q2) > 1.0 - eps:
            continue
        mu1 = (mu1 + i * p) / q1
        mu2 = (mu - q1 * mu1) / q2
        sigma = q1 * q2 * (mu1 - mu2) * (mu1 - mu2)
        if sigma > max_sigma:
            max_sigma, best = sigma, i
    return best


# Cells that Otsu's 8-bit image can show. The blur never exceeds the largest input cell in a
# cell's 3^n neighbourhood (each float pass rounds a convex combination, so <= its max), and the
# image's top is >= xmax / 8 (the largest cell keeps 1/2 per pass). So a cell whose neighbourhood
# holds only cells <= CUT * xmax scales to <= 0.4996 (float32 margins included): 0 in the image.
CUT = 0.999 / (8 * 510)
TINY = 1e-30  # below this xmax / 8 could be subnormal: no pruning (the whole box is blurred)


def image_box(flat, values, shape, blur: bool):
    """Per axis (in_lo, in_hi, out_lo, out_hi): the box the blur reads (every surviving cell in it)
    and, one cell inside, the box holding every non-zero cell of the 8-bit image."""
    axes = np.unravel_index(flat, shape)
    xmax = float(values.max())
    big = values > (CUT * xmax if blur and xmax > TINY else 0.0)
    out = []
    for i, n in zip(axes, shape):
        lo, hi = int(i[big].min()), int(i[big].max()) + 1
        r = 1 if blur else 0
        out.append((max(lo - 2 * r, 0), min(hi + 2 * r, n), max(lo - r, 0), min(hi + r, n)))
    return out


def otsu_survivors(flat: np.ndarray, values: np.ndarray, shape: tuple[int, ...], blur: bool) -> np.ndarray:
    """Which surviving cells (``flat`` [m] ascending, ``values`` [m] > 0) Otsu keeps on the
    (blurred) grid they span # -> [m] bool."""
    box = image_box(flat, values, shape, blur)
    axes = np.unravel_index(flat, shape)
    inside = np.ones(flat.size, bool)
    for i, (lo, hi, _, _) in zip(axes, box):
        inside &= (i >= lo) & (i < hi)
    x = np.zeros(tuple(hi - lo for lo, hi, _, _ in box), dtype=np.float32)
    x[tuple(i[inside] - b[0] for i, b in zip(axes, box))] = values[inside]
    if blur:
        for axis in blur_order(len(shape)):
            x = _blur_axis(x, axis, box[axis][0], shape[axis])
    x = x[tuple(slice(olo - lo, ohi - lo) for lo, _, olo, ohi in box)]  # the exact part
    top = float(x.max())
    img = np.minimum(np.rint(x * np.float32(255.0 / top)), 255).astype(np.uint8)  # convertScaleAbs
    hist = np.bincount(img.ravel(), minlength=256)
    total = int(np.prod(shape))
    hist[0] += total - img.size  # the zeros outside the box
    threshold = otsu_cv2(hist)
    keep = np.ones(flat.size, bool)
    for i, (_, _, lo, hi) in zip(axes, box):
        keep &= (i >= lo) & (i < hi)
    kept = np.flatnonzero(keep)
    local = tuple(i[kept] - b[2] for i, b in zip(axes, box))
    keep[kept] = img[local] > threshold
    return keep


def live_cells(flat: np.ndarray, values: np.ndarray, shape, cfg, threshold: np.float32):
    """Static threshold then Otsu on normalised seen cells, as ``step._live`` # -> flat, values."""
    if cfg.dynamo.static_threshold and threshold > 0:
        keep = values > threshold
        flat, values = flat[keep], values[keep]
    if cfg.dynamo.adaptive_threshold and flat.size:
        kept = otsu_survivors(flat, values, shape, cfg.dynamo.blur_kernel > 1)
        if kept.any():
            return flat[kept], values[kept]
    return flat, values
