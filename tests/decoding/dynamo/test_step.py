"""DynaMo dynamic decoding (Alg. 1): back-off extremes, the emitted distribution at n = 2,
and the image operations (opencv for 2-D, scipy + numpy Otsu for 3-D agree with opencv)."""

from __future__ import annotations

from collections import Counter

import cv2
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from multitoken.decoding.config import DecodeConfig
from multitoken.decoding.dynamo import dynamic_step, gaussian_blur, otsu_keep
from multitoken.decoding.engine import generate

from ..conftest import RatioTable, attach


@pytest.mark.parametrize("eps_b,expected", [(0.0, "n"), (1.0, 1)])
def test_eps_b_extremes(tiny_backbones, arch, eps_b, expected):
    model = attach(tiny_backbones[arch], "replicated", n_future=3)
    for seed in range(2):
        res = generate(model, [1, 5, 9], DecodeConfig(mode="dynamic", eps_b=eps_b, max_new_tokens=15, seed=seed,
                                                      stop_at_eos=False), table=RatioTable())
        want = 3 if expected == "n" else 1
        assert set(res.trace.orders) == {want}
        assert len(res.token_ids) == 15
        assert res.trace.forward_passes == 15 // want  # the last step's tokens are never fed


def test_eps_b_one_backs_off_every_step_and_zero_never(tiny_backbones):
    model = attach(tiny_backbones["llama"], "medusa", n_future=3)
    res = generate(model, [1, 2], DecodeConfig(mode="dynamic", eps_b=1.0, max_new_tokens=6, stop_at_eos=False))
    assert res.trace.backoffs == Counter({3: 6, 2: 6}) and res.trace.tokens_per_forward == 1.0
    res = generate(model, [1, 2], DecodeConfig(mode="dynamic", eps_b=0.0, max_new_tokens=6, stop_at_eos=False))
    assert not res.trace.backoffs and res.trace.orders == Counter({3: 2})


def reference_grid(logps, cfg, ratio, seen):
    """Alg. 1 at n = 2 written out directly: the distribution the sampler must follow."""
    k, t, thr = cfg.sampling.top_k, cfg.sampling.temperature, cfg.dynamo.eps_b
    tops = [torch.topk(lp, k) for lp in logps]
    probs = [torch.softmax(v.double() / t, -1).numpy() for v, _ in tops]
    ids = [i.numpy() for _, i in tops]
    grid = np.outer(*probs) * ratio[np.ix_(*ids)] ** cfg.dynamo.alpha_c
    grid = grid / grid.sum()
    grid[grid <= thr] = 0
    blurred = cv2.GaussianBlur(grid, (3, 3), 0)
    img = cv2.convertScaleAbs(blurred.astype(np.float32), alpha=255.0 / blurred.max())
    otsu, _ = cv2.threshold(img, 0, 255, cv2.THRESH_BINARY | cv2.THRESH_OTSU)
    grid = np.where(img > otsu, grid, 0)
    rep = seen[ids[0]][:, None] | seen[ids[1]][None, :] | (ids[0][:, None] == ids[1][None, :])
    grid = np.where(rep, grid / cfg.sampling.repetition_penalty, grid)
    return ids, grid / grid.sum()


def test_emitted_pairs_follow_the_masked_thresholded_grid():
    rng = np.random.default_rng(3)
    logps = pair_logps(rng)
    ratio = rng.uniform(0.2, 3.0, size=(V, V))
    assert_draws_follow_grid(logps, ratio, RatioTable(ratio))


V = 12  # vocabulary of the chi-square tests


def pair_logps(rng) -> list[torch.Tensor]:
    """Two heads' log-probabilities over ``V`` tokens # 2 x [V]."""
    return [torch.log_softmax(torch.tensor(rng.normal(0, 0.5, V)), -1).float() for _ in range(2)]


def assert_draws_follow_grid(logps, ratio: np.ndarray, table, kernel: str | None = None) -> None:
    """3000 dynamic steps (tokens 2 and 5 seen) emit only the reference grid's live cells, in
    its proportions (chi-square); ``kernel``: the one that must have built every grid."""
    seen = np.zeros(V, dtype=bool)
    seen[[2, 5]] = True
    cfg = DecodeConfig(mode="dynamic", top_k=6, temperature=1.0, eps_b=0.01, repetition_penalty=1.5,
                       **({"dynamic_kernel": kernel} if kernel else {}))
    ids, grid = reference_grid(logps, cfg, ratio, seen)
    assert (grid > 0).sum() >= 4, "the test needs several live cells"
    sampler = np.random.default_rng(0)
    draws = Counter()
    runs = 3000
    for _ in range(runs):
        choice = dynamic_step(logps, cfg, table, seen, sampler)
        assert choice.order == 2 and (kernel is None or choice.kernels == [kernel])
        draws[tuple(choice.tokens)] += 1
    cells = [(int(ids[0][i]), int(ids[1][j])) for i, j in zip(*np.nonzero(grid))]
    assert set(draws) <= set(cells), "a thresholded-away cell was emitted"
    obs = np.array([draws[c] for c in cells], dtype=float)
    exp = np.array([grid[i, j] for i, j in zip(*np.nonzero(grid))]) * runs
    assert chisquare(obs, exp).pvalue > 1e-3


def test_order_one_is_top_k_sampling_with_penalty():
    logp = torch.log_softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]), -1)
    cfg = DecodeConfig(mode="dynamic", top_k=3, temperature=1.0, eps_b=1.0, repetition_penalty=2.0)
    seen = np.array([True, False, False, False, False])
    rng = np.random.default_rng(0)
    draws = Counter(dynamic_step([logp, logp], cfg, None, seen, rng).tokens[0] for _ in range(4000))
    p = torch.softmax(logp[:3], -1).numpy()
    p[0] /= 2.0
    assert set(draws) <= {0, 1, 2}
    assert chisquare([draws[i] for i in range(3)], p / p.sum() * 4000).pvalue > 1e-3


def test_greedy_dynamic_takes_the_best_cell():
    logps = [torch.log_softmax(torch.tensor([0.0, 3.0, 1.0]), -1), torch.log_softmax(torch.tensor([2.0, 0.0, 1.0]), -1)]
    cfg = DecodeConfig(mode="dynamic", greedy=True, top_k=3, eps_b=0.0, repetition_penalty=1.0)
    assert dynamic_step(logps, cfg, None, np.zeros(3, dtype=bool), None).tokens == [1, 0]


def test_3d_blur_equals_scipy_separable_filter_and_2d_kernel():
    from scipy.ndimage import correlate1d

    rng = np.random.default_rng(0)
    cube = rng.random((6, 7, 9)).astype(np.float32)
    ref = cube
    for axis in range(3):
        ref = correlate1d(ref, cv2.getGaussianKernel(3, 0).ravel(), axis=axis, mode="mirror")
    np.testing.assert_allclose(gaussian_blur(cube, 3), ref, atol=1e-6)
    plane = rng.random((7, 9)).astype(np.float32)
    flat = np.repeat(plane[:, :, None], 5, axis=2)  # constant along the third axis
    np.testing.assert_allclose(gaussian_blur(flat, 3)[:, :, 2], cv2.GaussianBlur(plane, (3, 3), 0), atol=1e-6)


def test_otsu_on_a_3d_grid_equals_otsu_of_its_histogram():
    rng = np.random.default_rng(1)
    cube = rng.gamma(0.5, 1.0, size=(8, 8, 8)).astype(np.float32)
    keep = otsu_keep(cube)
    img = cv2.convertScaleAbs(cube.reshape(64, 8), alpha=255.0 / cube.max())
    t, _ = cv2.threshold(img.reshape(-1, 1), 0, 255, cv2.THRESH_BINARY | cv2.THRESH_OTSU)
    np.testing.assert_array_equal(keep, (img > t).reshape(cube.shape))
    assert 0 < keep.sum() < keep.size


@pytest.mark.parametrize("masked", [False, True])
def test_skipping_unreachable_orders_changes_nothing(monkeypatch, masked):
    """``cannot_reach`` only saves work: with it disabled (every grid built) each proposal, its
    order and its back-offs are the same, for sampled and greedy draws alike."""
    from multitoken.decoding.dynamo import step

    gen = torch.Generator().manual_seed(0)
    seen = np.random.default_rng(0).random(300) < 0.1
    table = RatioTable() if masked else None
    # per-head logit scales: a flat third head makes order 3 unreachable but order 2 not
    cases = [([torch.log_softmax(torch.randn(300, generator=gen) * s, -1) for s in scales], eps)
             for scales in ((0.5,) * 3, (2.0,) * 3, (6.0,) * 3, (12.0, 12.0, 0.5)) for eps in (0.0, 0.2, 0.5, 0.8, 1.0)]

    def run():
        out = []
        for logps, eps in cases:
            cfg = DecodeConfig(mode="dynamic", top_k=20, eps_b=eps)
            for rng in (None, np.random.default_rng(1)):
                c = dynamic_step(logps, cfg, table, seen, rng)
                out.append((c.tokens, c.order, c.backed_off))
        return out

    fast = run()
    monkeypatch.setattr(step, "cannot_reach", lambda *a: False)
    monkeypatch.setattr(step, "heads_needed", lambda cfg, n: n)  # every grid built needs every head read
    assert run() == fast
    orders = {o for _, o, _ in fast}
    assert orders == {1, 2, 3}, "the cases must exercise every order"
