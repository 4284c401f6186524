"""DynaMo's joint proposal with dynamic back-off (seed 003 §3.2, Alg. 1).

For order n: top-k of heads 1..n (with temperature), joint grid = outer product, times the
co-occurrence mask ** alpha_c (eq. 6) and renormalised, static threshold, Gaussian blur + Otsu
adaptive threshold, repetition penalty; if no cell exceeds eps_b^(n-1) back off to n-1; order 1 is
ordinary top-k sampling. The grid is small (k^n cells) and lives in numpy; opencv blurs and
thresholds 2-D grids, scipy blurs 3-D ones (same separable kernel, Otsu on the same histogram).

Reading of the paper's thresholds (its text says both "eps_b" and "eps_b^(n-1)"): an order-n grid
keeps the cells > eps_b^(n-1) and the order is used iff one exists. So eps_b = 0 never backs off
(n tokens every step) and eps_b = 1 always does (a normalised grid has no cell > 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Candidates:
    """Top-k of one head: token ids and their renormalised probabilities (decreasing)."""

    ids: np.ndarray  # [k] int64
    probs: np.ndarray  # [k] float64, sums to 1


def top_candidates(logp: torch.Tensor, k: int, temperature: float) -> Candidates:
    """Top-k of a log-distribution with temperature # [V] -> k ids + probs."""
    vals, idx = torch.topk(logp, k)  # sorted: the grid's axes run from most to least likely
    probs = torch.softmax(vals.double() / temperature, dim=-1)
    return Candidates(idx.cpu().numpy(), probs.cpu().numpy())


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
    masked = grid * table.mask([c.ids for c in cands], alpha)
    total = masked.sum()
    return masked / total if total > 0 else grid


def gaussian_blur(grid: np.ndarray, kernel: int) -> np.ndarray:
    """Gaussian blur, opencv's kernel for ``kernel`` (sigma from the size), reflect-101 borders."""
    import cv2

    if grid.ndim == 2:
        return cv2.GaussianBlur(grid, (kernel, kernel), 0)
    from scipy.ndimage import correlate1d

    weights = cv2.getGaussianKernel(kernel, 0).ravel()
    out = grid
    for axis in range(grid.ndim):  # separable: one 1-D pass per axis
        out = correlate1d(out, weights, axis=axis, mode="mirror")
    return out


def otsu_keep(image: np.ndarray) -> np.ndarray:
    """Boolean map of the cells above Otsu's threshold of ``image`` scaled to 8 bits."""
    top = image.max()
    if top <= 0:
        return np.ones(image.shape, dtype=bool)
    img = np.rint(image * (255.0 / top)).astype(np.uint8)
    if img.ndim == 2:
        import cv2

        t, _ = cv2.threshold(img, 0, 255, cv2.THRESH_BINARY | cv2.THRESH_OTSU)
    else:
        t = otsu_threshold(np.bincount(img.ravel(), minlength=256))
    return img > t


def otsu_threshold(hist: np.ndarray) -> int:
    """Otsu (1979) on a 256-bin histogram: the level maximising between-class variance."""
    p = hist / hist.sum()
    levels = np.arange(hist.size)
    w0 = np.cumsum(p)  # class "<= t" weight
    mu = np.cumsum(p * levels)
    with np.errstate(divide="ignore", invalid="ignore"):
        between = (mu[-1] * w0 - mu) ** 2 / (w0 * (1 - w0))
    between[~np.isfinite(between)] = -1.0
    return int(np.argmax(between))  # first maximum, like opencv


def repetition_cells(cands: list[Candidates], seen: np.ndarray) -> np.ndarray:
    """Cells whose tokens repeat the context (``seen`` [V] bool) or each other # -> [k]*n bool."""
    n = len(cands)
    rep = np.zeros([len(c.ids) for c in cands], dtype=bool)
    for axis, c in enumerate(cands):
        shape = [1] * n
        shape[axis] = len(c.ids)
        rep |= seen[c.ids].reshape(shape)
        for other in range(axis + 1, n):  # the cell repeats itself: x_a == x_b
            eq = np.equal.outer(c.ids, cands[other].ids)  # [k_a, k_b]
            shape = [1] * n
            shape[axis], shape[other] = eq.shape
            rep |= eq.reshape(shape)
    return rep


def joint_grid(cands: list[Candidates], cfg, table=None, seen: np.ndarray | None = None) -> np.ndarray:
    """The thresholded, masked, penalised joint grid of order len(cands) (unnormalised)."""
    order = len(cands)
    threshold = cfg.eps_b ** (order - 1)
    grid = apply_mask(outer(cands), cands, table, cfg.alpha_c)
    if cfg.static_threshold:
        grid = np.where(grid > threshold, grid, 0.0)
    if cfg.adaptive_threshold and grid.max() > 0:
        blurred = gaussian_blur(grid, cfg.blur_kernel) if cfg.blur_kernel > 1 else grid
        kept = np.where(otsu_keep(blurred), grid, 0.0)
        grid = kept if kept.max() > 0 else grid  # never let the filter erase the whole grid
    if cfg.repetition_penalty != 1 and seen is not None:
        grid = np.where(repetition_cells(cands, seen), grid / cfg.repetition_penalty, grid)
    return grid


def sample_cell(grid: np.ndarray, rng: np.random.Generator | None) -> tuple[int, ...]:
    """A cell drawn proportionally to ``grid`` (argmax when ``rng`` is None)."""
    flat = grid.ravel()
    if rng is None:
        index = int(flat.argmax())
    else:
        cdf = np.cumsum(flat)
        index = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), flat.size - 1)
    return np.unravel_index(index, grid.shape)


@dataclass
class DynamicChoice:
    tokens: list[int]
    order: int  # tokens emitted (n after back-off)
    backed_off: list[int]  # orders tried and rejected, e.g. [3, 2]


def dynamic_propose(head_logps: list[torch.Tensor], cfg, table, seen: np.ndarray, rng) -> DynamicChoice:
    """Alg. 1: try order n, n-1, ..., 2 and fall back to top-k sampling of head 1.

    head_logps: n x [V] log-distributions at the anchor position (head i predicts t+i).
    ``rng`` None = greedy (argmax cell).
    """
    temperature = cfg.temperature if cfg.temperature > 0 else 1.0
    k = min(cfg.top_k, head_logps[0].shape[-1])
    cands = [top_candidates(lp, k, temperature) for lp in head_logps]
    backed_off = []
    for order in range(len(cands), 1, -1):
        grid = joint_grid(cands[:order], cfg, table, seen)
        if (grid > cfg.eps_b ** (order - 1)).any():
            cell = sample_cell(grid, rng)
            return DynamicChoice([int(cands[a].ids[i]) for a, i in enumerate(cell)], order, backed_off)
        backed_off.append(order)
    first = cands[0]
    probs = np.where(seen[first.ids], first.probs / cfg.repetition_penalty, first.probs)
    (i,) = sample_cell(probs, rng)
    return DynamicChoice([int(first.ids[i])], 1, backed_off)
