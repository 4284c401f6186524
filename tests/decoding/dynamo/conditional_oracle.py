"""The exact distribution of one step of DynaMo over conditional drafts, written from its
definition (docs/decoding.md, DynaMo over conditional drafts) over a vocabulary small enough to
enumerate: every x_1, every cell of every row, with its probability. Independent of the code under
test but for the blur and Otsu primitives (step.gaussian_blur, step.otsu_keep: the dense
reference's own)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from multitoken.decoding.dynamo import gaussian_blur, otsu_keep


def tempered(logits: np.ndarray, k: int, temperature: float) -> np.ndarray:
    """Top-k of ``logits`` [V] at ``temperature``, as probabilities over the whole vocabulary [V]
    (0 outside the top k)."""
    logits = np.asarray(logits, dtype=np.float64)
    top = np.argsort(-logits, kind="stable")[:k]
    out = np.zeros(logits.size)
    z = logits[top] / temperature
    out[top] = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    return out


def _row(prefix, value, q, cfg, table, seen):
    """The order-(len(prefix)+1) row J(prefix, .) after mask, thresholds and penalty # -> ([V]
    penalised cells, [V] masked conditional q~, its bound eps_b^m)."""
    d, v = cfg.dynamo, q.size
    bound = d.eps_b ** len(prefix)
    cond = q.copy()
    if table is not None and d.alpha_c > 0:
        ratio = np.asarray(table.mask([np.array([x]) for x in prefix] + [np.arange(v)], d.alpha_c), dtype=np.float64).ravel()
        masked = q * ratio
        if masked.sum() > 0:  # an unseen prefix keeps its conditional
            cond = masked / masked.sum()
    joint = value * cond  # [V]
    if d.static_threshold:
        joint = np.where(joint <= bound, 0.0, joint)
    if d.adaptive_threshold and joint.max() > 0:  # the image's axis: the drafter's top-k, most likely first
        rank = np.argsort(-q, kind="stable")[:np.count_nonzero(q)]
        image = joint[rank].astype(np.float32)[None]
        if d.blur_kernel > 1:
            image = gaussian_blur(image, d.blur_kernel)
        keep = np.zeros(v, dtype=bool)
        keep[rank] = otsu_keep(image)[0]
        keep &= joint > 0
        if keep.any():
            joint = np.where(keep, joint, 0.0)
    repeats = seen[list(prefix)].any() or len(set(prefix)) < len(prefix)
    rep = np.array([repeats or seen[x] or x in prefix for x in range(v)])
    return np.where(rep, joint / cfg.sampling.penalty, joint), cond, bound


def exact_step(p1: np.ndarray, conditional, n: int, cfg, table, seen: np.ndarray) -> dict[tuple, float]:
    """{tokens emitted: probability} of one step. ``p1`` [V]: head 1's tempered top-k
    probabilities; ``conditional(prefix)`` [V]: the drafter's tempered top-k for the next token."""
    out: dict[tuple, float] = defaultdict(float)
    first = np.where(seen, p1 / cfg.sampling.penalty, p1)
    first = first / first.sum()

    def extend(prefix: tuple, value: float, prob: float) -> None:
        if len(prefix) == n or value <= cfg.dynamo.eps_b ** len(prefix):
            out[prefix] += prob
            return
        joint, cond, bound = _row(prefix, value, conditional(prefix), cfg, table, seen)
        if not (joint > bound).any():
            out[prefix] += prob
            return
        for x in np.flatnonzero(joint):
            extend(prefix + (int(x),), value * cond[x], prob * joint[x] / joint.sum())

    for x1 in np.flatnonzero(first):
        extend((int(x1),), float(p1[x1]), float(first[x1]))
    return dict(out)
