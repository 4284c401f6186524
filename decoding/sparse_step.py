"""The sparse DynaMo step's dispatch: numpy (``sparse``) or the compiled numba kernels
(``sparse_numba``, the optional ``[fast]`` extra, imported only when chosen). Kept apart from
``sparse`` so that the kernels can import the reference module's helpers without a cycle."""

from __future__ import annotations

import numpy as np

from .sparse import layout, live_cells, masked_values, resolve_kernel, seen_cells


def sparse_live(cands, cfg, table, kernel: str):
    """The live cells (flat [m] ascending, values [m] float32, before the penalty) of the
    order-len(cands) grid, or None when no seen cell carries mass (the dense path then leaves the
    grid unmasked). ``kernel``: "numpy" or "numba"."""
    lay = layout(table, len(cands))
    shape = tuple(c.ids.size for c in cands)
    threshold = np.float32(cfg.eps_b ** (len(cands) - 1))
    ids = [c.ids for c in cands]
    if kernel == "numba":
        from . import sparse_numba  # lazy: numba is the optional [fast] extra, and importing it costs ~1 s

        flat, masked = sparse_numba.masked_cells(lay, cands, cfg.alpha_c)
    else:
        flat, count = seen_cells(lay, ids)
        flat, masked = masked_values(lay, cands, flat, count, cfg.alpha_c)
    total = masked.sum(dtype=np.float64)  # the array the dense path sums: same numpy, same bits
    if not total > 0:
        return None
    values = masked / np.float32(total)
    if kernel == "numba":
        return sparse_numba.live(flat, values, shape, cfg, threshold)
    return live_cells(flat, values, shape, cfg, threshold)


def prepare_kernel(cfg, table, order: int) -> None:
    """Before a generation's clock: build the table's lookup layouts and, for numba, compile (or
    load from its disk cache) the kernels, so that no step pays for either."""
    kernel = resolve_kernel(getattr(cfg, "dynamic_kernel", "dense"))
    if kernel == "dense" or table is None or not hasattr(table, "inv_unigrams") or table.absent != 0:
        return
    for n in range(2, min(order, table.max_order, 3) + 1):
        layout(table, n)
        if kernel == "numba":
            from . import sparse_numba  # lazy: numba is the optional [fast] extra, and importing it costs ~1 s

            sparse_numba.prepare(table, n)
