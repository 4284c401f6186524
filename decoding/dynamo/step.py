"""DynaMo's joint proposal with dynamic back-off (DynaMo §3.2, Alg. 1).

For order n: top-k of heads 1..n (with temperature), joint grid = outer product, times the
co-occurrence mask ** alpha_c (eq. 6) and renormalised, static threshold, Gaussian blur + Otsu
adaptive threshold, repetition penalty; if no cell exceeds eps_b^(n-1) back off to n-1; order 1 is
ordinary top-k sampling. The grid is small (k^n cells) and lives in numpy (float32); opencv
blurs and thresholds it (2-D and 3-D, same separable kernel; scipy past 512 cells per axis).

Reading of the paper's thresholds (its text says both "eps_b" and "eps_b^(n-1)"): an order-n grid
keeps the cells > eps_b^(n-1) and the order is used iff one exists. So eps_b = 0 never backs off
(n tokens every step) and eps_b = 1 always does (a normalised grid has no cell > 1).

The heads' top-k candidates come from ``decoding/sampling.py``. Also here: DynaMo over conditional drafts
(the joint's rows given the sampled prefix: ``Prefix``, docs/decoding.md), and
the dispatch of the sparse step (``sparse_live``, ``prepare_kernel``): numpy (``sparse``) or the
compiled numba kernels (``numba_step``, the optional ``[fast]`` extra, imported only when chosen).
The dispatch lives here, not in ``sparse``, so that the kernels import the reference module's
helpers without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from multitoken.base.progress import status

from .sparse import applies, layout, live_cells, masked_values, seen_cells
from ..sampling import Candidates, head_candidates


def outer(cands: list[Candidates]) -> np.ndarray:
    """Joint grid of independent heads # n x [k] -> [k, ..., k]."""
    grid = cands[0].probs
    for c in cands[1:]:
        grid = np.multiply.outer(grid, c.probs)
    return grid


def apply_mask(grid: np.ndarray, cands: list[Candidates], table, alpha: float) -> np.ndarray:
    """grid * mask^alpha, renormalised (eq. 6). A mask that would erase every cell (no candidate
    combination seen in the corpus) carries no information: the grid is then left as it is."""
    if table is None or alpha == 0:
        return grid
    masked = grid * _lookup(table, cands, alpha)
    # the float64 sum of the non-zero cells in flat order: the sparse step (sparse.py) sums the
    # very same compact array, so both normalise to the same bits on any numpy
    total = masked[masked != 0].sum(dtype=np.float64)
    return masked / np.float32(total) if total > 0 else grid


def _lookup(table, cands: list[Candidates], alpha: float) -> np.ndarray:
    """The table's mask; ids past the tokenizer's vocabulary (embedding-matrix padding, e.g.
    pythia's 50277..50303) never occur in a corpus, so their cells get the "absent" ratio."""
    limit = getattr(table, "vocab_size", None)
    if limit is None or all(c.ids.max() < limit for c in cands):
        return table.mask([c.ids for c in cands], alpha)
    mask = table.mask([np.where(c.ids < limit, c.ids, 0) for c in cands], alpha)
    absent = np.float32(getattr(table, "absent", 0.0)) ** np.float32(alpha)
    for axis, c in enumerate(cands):
        index = [slice(None)] * len(cands)
        index[axis] = c.ids >= limit
        mask[tuple(index)] = absent
    return mask


def gaussian_blur(grid: np.ndarray, kernel: int) -> np.ndarray:
    """Gaussian blur with opencv's kernel for ``kernel`` (sigma from the size), reflect-101
    borders, separable over every axis. 2-D: one opencv call. 3-D: opencv blurs the first two
    axes treating the last as channels, then the last axis as a 2-D view (about 5x faster than
    scipy's three passes, identical values); scipy serves grids past opencv's channel limit
    (CV_CN_MAX: 512 in opencv 4, 128 in opencv 5)."""
    import cv2

    grid = np.ascontiguousarray(grid, dtype=np.float32)
    if grid.ndim == 2:
        return cv2.GaussianBlur(grid, (kernel, kernel), 0)
    weights = cv2.getGaussianKernel(kernel, 0).ravel()
    # opencv packs (channels - 1) << CV_CN_SHIFT and the depth into a 12-bit type code, so
    # CV_CN_MAX = 4096 >> CV_CN_SHIFT, and the shift is the step between CV_32FC(1) and (2)
    cn_max = 4096 // (cv2.CV_32FC(2) - cv2.CV_32FC(1))
    if grid.ndim == 3 and grid.shape[2] <= cn_max:
        out = cv2.GaussianBlur(grid, (kernel, kernel), 0)  # axes 0 and 1
        flat = out.reshape(-1, grid.shape[2])
        return cv2.sepFilter2D(flat, -1, weights, np.ones(1), borderType=cv2.BORDER_REFLECT_101).reshape(grid.shape)
    from scipy.ndimage import correlate1d

    out = grid
    for axis in range(grid.ndim):
        out = correlate1d(out, weights, axis=axis, mode="mirror")
    return out


def otsu_keep(image: np.ndarray) -> np.ndarray:
    """Boolean map of the cells above Otsu's threshold of ``image`` scaled to 8 bits. Otsu reads
    only the histogram, so a grid of any rank is thresholded through a 2-D view (opencv)."""
    import cv2

    top = float(image.max())
    if top <= 0:
        return np.ones(image.shape, dtype=bool)
    flat = np.ascontiguousarray(image, dtype=np.float32).reshape(-1, image.shape[-1])
    img = cv2.convertScaleAbs(flat, alpha=255.0 / top)  # rounds to uint8
    t, _ = cv2.threshold(img, 0, 255, cv2.THRESH_BINARY | cv2.THRESH_OTSU)
    return (img > t).reshape(image.shape)


def repetition_cells(cands: list[Candidates], seen: np.ndarray, cells: tuple[np.ndarray, ...]) -> np.ndarray:
    """Which of the ``cells`` (per-axis candidate indices, each [m]) repeat the context (``seen``
    [V] bool) or themselves (x_a == x_b) # -> [m] bool."""
    tokens = [c.ids[i] for c, i in zip(cands, cells)]  # n x [m] token ids
    rep = np.zeros(tokens[0].shape, dtype=bool)
    for a, x in enumerate(tokens):
        rep |= seen[x]
        for y in tokens[a + 1:]:
            rep |= x == y
    return rep


@dataclass
class Cells:
    """The live (non-zero) cells of a joint grid: after thresholding few of the k^n remain, so
    the penalty, the back-off test and sampling run on them alone."""

    shape: tuple[int, ...]
    flat: np.ndarray  # [m] flat indices into the grid
    values: np.ndarray  # [m] float32 weights (unnormalised)
    kernel: str = "dense"  # the path that built them: dense | numpy | numba (sparse.py)

    def dense(self) -> np.ndarray:
        grid = np.zeros(self.shape, dtype=np.float32)
        grid.flat[self.flat] = self.values
        return grid


def joint_cells(cands: list[Candidates], cfg, table=None, seen: np.ndarray | None = None,
                threshold: float | None = None) -> Cells:
    """Alg. 1 lines 6-10 for order len(cands): outer product, co-occurrence mask, static
    threshold, blur + Otsu, repetition penalty. Returns the live cells (unnormalised).
    ``threshold``: the static threshold (default eps_b^(n-1); the conditional joint scales it,
    ``Prefix``)."""
    shape = tuple(c.ids.size for c in cands)
    threshold = np.float32(cfg.dynamo.eps_b ** (len(cands) - 1) if threshold is None else threshold)
    live, kernel = None, cfg.dynamo.kernel
    if kernel != "dense" and applies(cands, cfg, table):
        live = sparse_live(cands, cfg, table, kernel, threshold)  # None: no seen cell carries mass
    if live is None:
        flat, values = _dense_live(cands, cfg, table, threshold)
        kernel = "dense"
    else:
        flat, values = live
    if cfg.sampling.penalty != 1 and seen is not None and flat.size:
        values[repetition_cells(cands, seen, np.unravel_index(flat, shape))] /= np.float32(cfg.sampling.penalty)
    return Cells(shape, flat, values, kernel)


def _dense_live(cands: list[Candidates], cfg, table, threshold: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """The reference: the whole k^n grid, masked, thresholded, blurred and Otsu'd."""
    grid = apply_mask(outer(cands), cands, table, cfg.dynamo.alpha_c)  # [k]*order, cells >= 0
    if cfg.dynamo.static_threshold and threshold > 0:  # cells are >= 0: a zero threshold zeroes nothing
        grid[grid <= threshold] = 0.0
    return _live(grid, cfg)


def _live(grid: np.ndarray, cfg) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices [m] and values [m] (a copy) of the non-zero cells Otsu keeps; all non-zero
    cells when Otsu is off or would keep none. Indexing through Otsu's boolean map is ~30x
    cheaper than np.flatnonzero on the float grid, and yields the same ascending indices."""
    if cfg.dynamo.adaptive_threshold and grid.max() > 0:
        blurred = gaussian_blur(grid, cfg.dynamo.blur_kernel) if cfg.dynamo.blur_kernel > 1 else grid
        flat = np.flatnonzero(otsu_keep(blurred))
        values = grid.ravel()[flat]
        nonzero = values != 0  # a kept cell may have been zeroed by the static threshold
        if nonzero.any():  # never let the filter erase the whole grid
            return flat[nonzero], values[nonzero]
    flat = np.flatnonzero(grid)
    return flat, grid.ravel()[flat]


def joint_grid(cands: list[Candidates], cfg, table=None, seen: np.ndarray | None = None) -> np.ndarray:
    """``joint_cells`` as a dense [k]*n grid (unnormalised, float32)."""
    return joint_cells(cands, cfg, table, seen).dense()


# The sparse step's dispatch ------------------------------------------------------------------
# numpy (``sparse``) or the compiled kernels (``numba_step``), by ``DecodeConfig.dynamic_kernel``.

def sparse_live(cands, cfg, table, kernel: str, threshold: np.float32):
    """The live cells (flat [m] ascending, values [m] float32, before the penalty) of the
    order-len(cands) grid at the static ``threshold``, or None when no seen cell carries mass
    (the dense path then leaves the grid unmasked). ``kernel``: "numpy" or "numba"."""
    lay = layout(table, len(cands))
    shape = tuple(c.ids.size for c in cands)
    ids = [c.ids for c in cands]
    if kernel == "numba":
        from . import numba_step  # lazy: numba is the optional [fast] extra, and importing it costs ~1 s

        flat, masked = numba_step.masked_cells(lay, cands, cfg.dynamo.alpha_c)
    else:
        flat, count = seen_cells(lay, ids)
        flat, masked = masked_values(lay, cands, flat, count, cfg.dynamo.alpha_c)
    total = masked.sum(dtype=np.float64)  # the array the dense path sums: same numpy, same bits
    if not total > 0:
        return None
    values = masked / np.float32(total)
    if kernel == "numba":
        return numba_step.live(flat, values, shape, cfg, threshold)
    return live_cells(flat, values, shape, cfg, threshold)


def prepare_kernel(cfg, table, order: int) -> None:
    """Before a generation's clock: build the table's lookup layouts and, for numba, compile (or
    load from its disk cache) the kernels, so that no step pays for either."""
    kernel = cfg.dynamo.kernel
    if kernel == "dense" or table is None or not hasattr(table, "inv_unigrams") or table.absent != 0:
        return
    top = min(order, table.max_order, 3)
    if kernel == "numba" and top >= 2:
        status("loading the DynaMo kernels (numba)")
    for n in range(2, top + 1):
        layout(table, n)
        if kernel == "numba":
            from . import numba_step  # lazy: numba is the optional [fast] extra, and importing it costs ~1 s

            numba_step.prepare(table, n)


def sample_index(weights: np.ndarray, rng: np.random.Generator | None) -> int:
    """An index drawn proportionally to ``weights`` [m] (argmax when ``rng`` is None)."""
    if rng is None:
        return int(weights.argmax())
    cdf = np.cumsum(weights, dtype=np.float64)
    return min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), weights.size - 1)


@dataclass
class DynamicChoice:
    tokens: list[int]
    order: int  # tokens emitted (n after back-off)
    backed_off: list[int]  # orders tried and rejected, e.g. [3, 2]
    kernels: list[str] = field(default_factory=list)  # the path of each grid built (sparse.py)


def always_backs_off(cfg) -> bool:
    """eps_b = 1: no cell of any order's grid exceeds 1 = eps_b^(n-1) (a masked grid is
    renormalised, an unmasked one is a product of probabilities, the penalty only lowers cells,
    and the static threshold would zero them all anyway), so only head 1 is ever read."""
    return cfg.dynamo.eps_b >= 1 and (cfg.sampling.penalty >= 1 or cfg.dynamo.static_threshold)


def cannot_reach(cands, order: int, cfg, table) -> bool:
    """True when no cell of the order-``order`` grid can exceed eps_b^(order-1), so building it
    is wasted work (the result is the same back-off). Exact bounds, because the repetition
    penalty (>= 1) only lowers cells and the thresholds only drop cells: a masked grid is
    renormalised, so every cell is <= 1; an unmasked grid's largest cell is the float32 product
    of the heads' top-1 probabilities (its [0, ..., 0] cell, computed in the same order).
    ``cands`` is called lazily (head index -> Candidates) so eps_b = 1 needs no top-k at all."""
    if always_backs_off(cfg):
        return True
    threshold = np.float32(cfg.dynamo.eps_b ** (order - 1))
    if cfg.sampling.penalty < 1 or (threshold < 1 and table is not None and cfg.dynamo.alpha_c != 0):
        return threshold >= 1 and cfg.dynamo.static_threshold  # >= 1 zeroes every cell of a masked grid
    if threshold >= 1:
        return True
    top = np.float32(1.0)
    for head in range(order):
        top = top * cands(head).probs[0]  # float32 * float32, as np.multiply.outer does
    return bool(top <= threshold)


def heads_needed(cfg, n: int) -> int:
    """Heads a step reads out of ``n``: the first order tried reads them all (in ``cannot_reach``'s
    product or in its grid), unless every order backs off unread (``always_backs_off``)."""
    return 1 if always_backs_off(cfg) else n


def dynamic_propose(candidates: list[Candidates], n: int, cfg, table, seen: np.ndarray, rng) -> DynamicChoice:
    """Alg. 1: try order n, n-1, ..., 2 and fall back to top-k sampling of head 1.

    ``candidates``: the top-k (at the temperature) of the heads the step reads at the anchor
    (head i predicts t+i): all n of them, or only head 1's when every order backs off unread
    (``heads_needed``), read for every row of a batch in one transfer (``head_candidates``).
    ``seen`` [V] bool: the context (repetition penalty); ``rng`` None = greedy (argmax cell).
    """
    if len(candidates) < heads_needed(cfg, n):
        raise ValueError(f"dynamic_propose reads {heads_needed(cfg, n)} heads' candidates, got {len(candidates)}")
    cand = candidates.__getitem__

    backed_off, kernels = [], []
    for order in range(n, 1, -1):
        if cannot_reach(cand, order, cfg, table):
            backed_off.append(order)
            continue
        cands = [cand(h) for h in range(order)]
        cells = joint_cells(cands, cfg, table, seen)
        kernels.append(cells.kernel)
        if (cells.values > np.float32(cfg.dynamo.eps_b ** (order - 1))).any():
            cell = np.unravel_index(cells.flat[sample_index(cells.values, rng)], cells.shape)
            return DynamicChoice([int(cands[a].ids[i]) for a, i in enumerate(cell)], order, backed_off, kernels)
        backed_off.append(order)
    first = cand(0)
    return DynamicChoice([int(first.ids[first_index(first, cfg, seen, rng)])], 1, backed_off, kernels)


def first_index(first: Candidates, cfg, seen: np.ndarray, rng) -> int:
    """Alg. 1 line 19, order 1: a candidate of head 1 drawn by top-k sampling with the
    repetition penalty (argmax when ``rng`` is None) # -> its index in ``first``."""
    probs = np.where(seen[first.ids], first.probs / cfg.sampling.penalty, first.probs)
    return sample_index(probs, rng)


def dynamic_step(scores, cfg, table, seen: np.ndarray, rng) -> DynamicChoice:
    """``dynamic_propose`` from the n heads' scores at the anchor # n x [V] (log-probs or raw
    logits: only their top-k is read), the heads it reads stacked and read in one transfer."""
    n = len(scores)
    k = min(cfg.sampling.top_k, scores[0].shape[-1])
    rows = torch.stack([scores[h] for h in range(heads_needed(cfg, n))])  # [m, V]
    return dynamic_propose(head_candidates(rows, k, cfg.sampling.grid_temperature), n, cfg, table, seen, rng)


# DynaMo over conditional drafts ---------------------------------------------------------------
# J(x_1..x_n) = p(x_1) * q~(x_2 | x_1) * ... with a drafter that reads the sampled tokens, q~ its
# top-k masked (eq. 6) and renormalised per prefix; Alg. 1 runs forwards on the slice of J the
# sampled prefix leaves: x_1 by the order-1 step, then per order the row J(x_1..x_m, .), which is
# ``joint_cells`` over one-cell axes [x_1], .., [x_m] and q's top-k with the static threshold
# eps_b^m / J(x_1..x_m) on q~. The reading of the paper: docs/decoding.md.

def reachable(value: float, order: int, cfg) -> bool:
    """Whether the order-``order`` row of a prefix whose joint value is ``value`` can hold a cell
    > eps_b^(order-1): its cells are at most ``value`` (q~ <= 1; the penalty, >= 1, only lowers)."""
    return value > cfg.dynamo.eps_b ** (order - 1)


def row_cells(prefix: list[int], value: float, cand: Candidates, cfg, table=None,
              seen: np.ndarray | None = None) -> tuple[Cells, np.ndarray, bool]:
    """The order-(len(prefix)+1) row of J given the sampled ``prefix`` (joint value ``value``)
    and the drafter's top-k ``cand`` for the next token # -> its live cells (values penalised,
    on the scale of q~), q~ at them [m], and whether a cell passes (else the order backs off)."""
    order = len(prefix) + 1
    scale = np.float32(cfg.dynamo.eps_b ** (order - 1) / value)  # J > eps_b^m  <=>  q~ > eps_b^m / J(prefix)
    fixed = [Candidates(np.array([x], dtype=np.int64), np.ones(1, dtype=np.float32)) for x in prefix]
    cands = fixed + [cand]
    cells = joint_cells(cands, cfg, table, None, threshold=scale)  # [m] live cells of the [1]*m + [k] grid
    conditional = cells.values.copy()
    if cfg.sampling.penalty != 1 and seen is not None and cells.flat.size:
        rep = repetition_cells(cands, seen, np.unravel_index(cells.flat, cells.shape))
        cells.values[rep] /= np.float32(cfg.sampling.penalty)
    return cells, conditional, bool((cells.values > scale).any())


@dataclass
class Prefix:
    """One row's draw from the conditional joint so far: its tokens x_1..x_m, their joint value
    J(x_1..x_m) (before the penalty), and where it stopped."""

    tokens: list[int]
    value: float
    stopped: bool = False
    backed_off: list[int] = field(default_factory=list)  # the order whose row held no passing cell
    kernels: list[str] = field(default_factory=list)  # the path of each row built

    def wants(self, n: int, cfg) -> bool:
        """Whether it tries order m + 1 <= ``n``; an order it cannot pass (``reachable``) stops it
        unread (the drafter is not asked)."""
        order = len(self.tokens) + 1
        if self.stopped or order > n:
            return False
        if not reachable(self.value, order, cfg):
            self.stopped, self.backed_off = True, [order]
        return not self.stopped

    def extend(self, cand: Candidates, cfg, table, seen: np.ndarray, rng) -> None:
        """Order m + 1 with the drafter's top-k ``cand`` for the token after the prefix: draws
        x_{m+1} from the row's kept cells (``rng`` None: the largest), or backs off."""
        cells, q, passes = row_cells(self.tokens, self.value, cand, cfg, table, seen)
        self.kernels.append(cells.kernel)
        if not passes:
            self.stopped, self.backed_off = True, [len(self.tokens) + 1]
            return
        pick = sample_index(cells.values, rng)
        self.tokens.append(int(cand.ids[cells.flat[pick]]))  # one-cell leading axes: the flat index is the row's
        self.value *= float(q[pick])

    def choice(self) -> DynamicChoice:
        return DynamicChoice(self.tokens, len(self.tokens), self.backed_off, self.kernels)


def first_token(first: Candidates, cfg, seen: np.ndarray, rng) -> Prefix:
    """x_1 by DynaMo's order-1 step from head 1's top-k ``first``: the one-token prefix, whose
    joint value is x_1's tempered probability (before the penalty)."""
    i = first_index(first, cfg, seen, rng)
    return Prefix([int(first.ids[i])], float(first.probs[i]))


def conditional_propose(first: Prefix, conditional: Callable[[list[int]], Candidates], n: int, cfg,
                        table, seen: np.ndarray, rng) -> DynamicChoice:
    """Up to ``n`` tokens from J, one row alone. ``first``: x_1 (``first_token``);
    ``conditional(prefix)``: the drafter's top-k for the token after ``prefix`` (token ids),
    asked only for an order that can pass; ``seen`` [V] bool: the context. A batch runs the same
    ``Prefix`` steps order by order for all its rows (``drafts.conditional_dynamo``)."""
    while first.wants(n, cfg):
        first.extend(conditional(first.tokens), cfg, table, seen, rng)
    return first.choice()
