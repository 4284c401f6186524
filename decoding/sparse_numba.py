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
from .sparse import blur_order, layout
from .sparse_otsu import AUTO, otsu_keep


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
    if cfg.static_threshold and threshold > 0:
        keep = values > threshold
        flat, values = flat[keep], values[keep]
    if cfg.adaptive_threshold and flat.size:
        blur = cfg.blur_kernel > 1
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
    # candidate lists as the kernels read them (.ids, .probs): no import of dynamic, which imports us
    cands = [SimpleNamespace(ids=ids, probs=np.full(ids.size, 0.5, np.float32)) for _ in range(order)]
    masked_cells(lay, cands, 1.0)  # one specialisation per count dtype; alpha is a runtime value
    cfg = SimpleNamespace(static_threshold=False, adaptive_threshold=True, blur_kernel=3)
    live(np.arange(2, dtype=np.int64), np.ones(2, np.float32), (2, 2, 2), cfg, np.float32(0))  # any order
