"""The sparse DynaMo step against the dense reference: its image operations against opencv bit for
bit, and recorded dynamic decoding of the embedded model (heads, stats) replayed through the
numpy and numba kernels: the same live cells, values, orders and tokens."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import cv2
import numpy as np
import pytest

from multitoken.decoding.dynamo import sparse, step
from multitoken.decoding.config import numba_available, DecodeConfig
from multitoken.decoding.dynamo import Candidates, gaussian_blur, joint_cells, otsu_keep
from multitoken.decoding.engine import generate
from multitoken.base.errors import UsageError

KERNELS = ["numpy", "numba"] if numba_available() else ["numpy"]


def wide_range(rng, shape) -> np.ndarray:
    """Values over 30 binary orders of magnitude, half zeros: any change of operation order
    in a float32 blur shows in the last bits."""
    x = (rng.random(shape) * 2.0 ** rng.integers(-30, 0, shape)).astype(np.float32)
    x[rng.random(shape) < 0.5] = 0
    return x


def blur_numpy(x: np.ndarray) -> np.ndarray:
    for axis in sparse.blur_order(x.ndim):
        x = sparse._blur_axis(x, axis, 0, x.shape[axis])
    return x


def blur_numba(x: np.ndarray) -> np.ndarray:
    from multitoken.decoding.dynamo import numba_otsu

    x3 = np.pad(x.reshape((1,) * (3 - x.ndim) + x.shape), 1)  # the kernel's padded box
    for axis in sparse.blur_order(x.ndim):
        a = axis + 3 - x.ndim
        out = np.empty_like(x3)
        numba_otsu._blur_pass(x3, out, a, 0, x3.shape[a] - 2)
        x3 = out
    return x3[1:-1, 1:-1, 1:-1].reshape(x.shape)


@pytest.mark.parametrize("shape", [(50, 50), (2, 3), (50, 50, 50), (2, 7, 3), (9, 2, 11)])
def test_blur_is_opencvs_to_the_bit(shape):
    rng = np.random.default_rng(len(shape))
    for _ in range(3):
        x = wide_range(rng, shape)
        ref = gaussian_blur(x, 3)
        np.testing.assert_array_equal(blur_numpy(x).view(np.uint32), ref.view(np.uint32))
        if "numba" in KERNELS:
            np.testing.assert_array_equal(blur_numba(x).view(np.uint32), ref.view(np.uint32))


def test_otsu_and_scaling_are_opencvs():
    """convertScaleAbs's rounding and Otsu's threshold, ties included (quantised values)."""
    rng = np.random.default_rng(1)
    for t in range(300):
        x = (rng.random((int(rng.integers(1, 40)), 50)) ** int(rng.integers(1, 8))).astype(np.float32)
        if t % 2:
            x = np.round(x * 4) / 4  # many equal cells, and x * 255 on exact halves
        x[rng.random(x.shape) < rng.random()] = 0
        if not x.max() > 0:
            continue
        img = cv2.convertScaleAbs(x, alpha=255.0 / float(x.max()))
        threshold, _ = cv2.threshold(img, 0, 255, cv2.THRESH_BINARY | cv2.THRESH_OTSU)
        flat = np.flatnonzero(x)
        keep = sparse.otsu_survivors(flat, x.ravel()[flat], x.shape, blur=False)
        np.testing.assert_array_equal(keep, img.ravel()[flat] > threshold)
        hist = np.bincount(img.ravel(), minlength=256)
        assert sparse.otsu_threshold(hist, img.size) == sparse.otsu_cv2(hist) == threshold


def otsu_numba(flat, values, shape, blur):
    from multitoken.decoding.dynamo import numba_step

    cfg = DecodeConfig(static_threshold=False, adaptive_threshold=True, blur_kernel=3 if blur else 0)
    kept_flat, _ = numba_step.live(flat, values, shape, cfg, np.float32(0))
    return np.isin(flat, kept_flat)


@pytest.mark.parametrize("shape", [(30, 30), (12, 12, 12), (2, 9, 5), (50, 50, 50)])
def test_otsu_on_the_pruned_box_equals_otsu_on_the_whole_grid(shape):
    """Only the box around the cells the 8-bit image can show is blurred: the kept cells are
    those of opencv on the whole grid, for sparse cells spread over 40 binary orders of
    magnitude (many far below the image's resolution, some just around it)."""
    rng = np.random.default_rng(len(shape) + shape[-1])
    size = int(np.prod(shape))
    for trial in range(30):
        m = int(rng.integers(1, max(2, size // [3, 20, 200][trial % 3])))
        flat = np.sort(rng.choice(size, m, replace=False))
        values = (rng.random(m) * 2.0 ** -rng.integers(0, 40, m)).astype(np.float32)
        if trial % 4 == 0:
            values[:] = np.float32(0.37)  # ties everywhere
        if trial % 4 == 1:  # around the pruning cut, 1/4080 of the largest cell
            values = (2.0 ** -rng.uniform(8, 14, m)).astype(np.float32)
            values[0] = 1.0
        grid = np.zeros(shape, np.float32)
        grid.flat[flat] = values
        for blur in (True, False):
            image = gaussian_blur(grid, 3) if blur else grid
            ref = otsu_keep(image).ravel()[flat]
            img = cv2.convertScaleAbs(image.reshape(-1, shape[-1]), alpha=255.0 / float(image.max())).reshape(shape)
            outside = np.ones(shape, bool)
            outside[tuple(slice(olo, ohi) for _, _, olo, ohi in sparse.image_box(flat, values, shape, blur))] = False
            assert not img[outside].any(), "a cell outside the box shows in the 8-bit image"
            np.testing.assert_array_equal(sparse.otsu_survivors(flat, values, shape, blur), ref)
            if "numba" in KERNELS:
                np.testing.assert_array_equal(otsu_numba(flat, values, shape, blur), ref)


def otsu_kernel(flat, values, shape, blur, path):
    """The compiled blur + Otsu on a forced path (numba_otsu.SPARSE or BOX) # -> [m] bool."""
    from multitoken.decoding.dynamo import numba_otsu

    shape3 = np.array((1, *shape) if len(shape) == 2 else shape, np.int64)
    axes = np.array([a + 3 - len(shape) for a in sparse.blur_order(len(shape))] if blur else [], np.int64)
    size = int(np.prod(shape3 + 2))
    zeros = np.zeros(size, np.float32)
    scratch = np.full(size, np.nan, np.float32), np.full(size, np.nan, np.float32)  # no read of an unwritten cell
    keep = numba_otsu.otsu_keep(flat, values, shape3, blur, axes, int(np.prod(shape)), *scratch, zeros, path)
    assert not zeros.any(), "the sparse path must leave its input grid zero"
    return keep


def sparse_grid(rng, shape, kind):
    """Cells of a sparse grid # -> flat [m] ascending, values [m] > 0: ``scattered`` (big cells on
    every border and corner: reflect-101), ``cluster`` (a block of big cells at a corner among tiny
    ones: D small in a large box), ``full`` (every cell within 2x: D fills the box)."""
    size = int(np.prod(shape))
    if kind == "full":
        flat = np.arange(size)
        return flat, (1 + rng.random(size)).astype(np.float32)
    m = max(2, size // 6)
    flat = rng.choice(size, m, replace=False)
    values = (rng.random(m) * 2.0 ** -rng.integers(12, 40, m)).astype(np.float32)  # below the cut
    if kind == "scattered":
        corners = [np.ravel_multi_index(tuple(rng.integers(0, 2, len(shape)) * (np.array(shape) - 1)), shape) for _ in range(4)]
        edges = [np.ravel_multi_index(tuple(rng.integers(0, n) if rng.random() < 0.5 else n - 1 for n in shape), shape) for _ in range(6)]
        big = np.array(corners + edges + list(rng.choice(size, 6)))
    else:
        block = np.stack(np.meshgrid(*[np.arange(min(3, n)) for n in shape], indexing="ij"), -1).reshape(-1, len(shape))
        big = np.concatenate([np.ravel_multi_index(block.T, shape), rng.choice(size, 2)])  # the corner block and two outliers
    flat = np.concatenate([flat, big])
    values = np.concatenate([values, (rng.random(big.size) * 2.0 ** -rng.integers(0, 6, big.size)).astype(np.float32)])
    flat, first = np.unique(flat, return_index=True)
    return flat, values[first]


@pytest.mark.skipif("numba" not in KERNELS, reason="needs numba (pip install multitoken[fast])")
@pytest.mark.parametrize("shape", [(50, 50), (2, 9), (37, 3), (50, 50, 50), (2, 7, 3), (9, 2, 11), (13, 17, 19)])
@pytest.mark.parametrize("kind", ["scattered", "cluster", "full"])
def test_sparse_and_box_paths_keep_opencvs_cells(shape, kind):
    """Both paths of the compiled kernel, each forced, keep the cells opencv keeps on the whole
    grid (and that the numpy reference keeps), for 2-D and 3-D grids, blur on and off."""
    from multitoken.decoding.dynamo import numba_otsu

    rng = np.random.default_rng(sum(shape) + len(kind))
    for _ in range(4):
        flat, values = sparse_grid(rng, shape, kind)
        grid = np.zeros(shape, np.float32)
        grid.flat[flat] = values
        for blur in (True, False):
            ref = otsu_keep(gaussian_blur(grid, 3) if blur else grid).ravel()[flat]
            np.testing.assert_array_equal(sparse.otsu_survivors(flat, values, shape, blur), ref)
            for path in (numba_otsu.SPARSE, numba_otsu.BOX, numba_otsu.AUTO):
                np.testing.assert_array_equal(otsu_kernel(flat, values, shape, blur, path), ref)


def test_kernel_setting_is_checked(monkeypatch):
    with pytest.raises(UsageError, match="unknown dynamic kernel"):
        DecodeConfig(dynamic_kernel="fast").validate(vocab_size=100, n_heads=3)
    from multitoken.decoding import config

    monkeypatch.setattr(config, "numba_available", lambda: False)
    assert config.resolve_kernel("auto") == "numpy"
    with pytest.raises(UsageError, match="needs numba"):
        DecodeConfig(dynamic_kernel="numba").validate(vocab_size=100, n_heads=3)


@pytest.fixture(scope="module")
def embedded():
    from multitoken.pipeline.model.loading import BackboneConfig
    from multitoken.embedded import DEFAULT_BASE, EMBEDDED_HEADS, EMBEDDED_STATS
    from multitoken.pipeline.model.model import MultiTokenModel
    from multitoken.stats.table import CooccurrenceTable

    model = MultiTokenModel.from_pretrained(BackboneConfig(base=str(DEFAULT_BASE)), str(EMBEDDED_HEADS)).eval()
    table = CooccurrenceTable.for_tokenizer(EMBEDDED_STATS, model.backbone.tokenizer)
    prompts = [model.backbone.tokenizer.encode(p) for p in ("Once upon a time", "The little dog was sad")]
    return model, table, prompts


SWITCHES = {"default": {}, "adaptive_off": {"adaptive_threshold": False}, "blur0": {"blur_kernel": 0},
            "blur1": {"blur_kernel": 1}}


@pytest.mark.parametrize("switch", list(SWITCHES))
@pytest.mark.parametrize("eps_b", [0.0, 0.3, 0.5, 0.7])
def test_replayed_steps_and_tokens_are_identical(embedded, monkeypatch, eps_b, switch):
    """Dense decoding records every grid's candidates and live cells; each kernel rebuilds the
    same cells bit for bit, and whole generations emit the same tokens, orders and back-offs."""
    model, table, prompts = embedded
    cfg = DecodeConfig(mode="dynamic", eps_b=eps_b, max_new_tokens=20, stop_at_eos=False, **SWITCHES[switch])
    steps = []
    dense_cells = step.joint_cells

    def record(cands, cfg_, table_, seen):
        cells = dense_cells(cands, cfg_, table_, seen)
        steps.append((cands, cfg_, seen.copy(), cells))
        return cells

    monkeypatch.setattr(step, "joint_cells", record)
    runs = {p: generate(model, prompts[p], replace(cfg, dynamic_kernel="dense", seed=p), table=table) for p in range(2)}
    monkeypatch.setattr(step, "joint_cells", dense_cells)
    assert steps and all(c.kernel == "dense" for *_, c in steps)
    for kernel in KERNELS:
        built = Counter()
        for cands, cfg_, seen, cells in steps:
            got = joint_cells(cands, replace(cfg_, dynamic_kernel=kernel), table, seen)
            np.testing.assert_array_equal(got.flat, cells.flat)
            np.testing.assert_array_equal(got.values.view(np.uint32), cells.values.view(np.uint32))
            built[got.kernel] += 1
        assert built[kernel] >= 0.9 * len(steps), built
        for p, ref in runs.items():
            res = generate(model, prompts[p], replace(cfg, dynamic_kernel=kernel, seed=p), table=table)
            assert res.token_ids == ref.token_ids
            assert (res.trace.orders, res.trace.backoffs) == (ref.trace.orders, ref.trace.backoffs)
            assert set(res.trace.dynamic_kernel) <= {kernel, "dense"} and res.trace.dynamic_kernel[kernel] > 0
            assert set(ref.trace.dynamic_kernel) == {"dense"}


@pytest.mark.parametrize("kernel", KERNELS)
def test_joint_drafts_are_identical(embedded, kernel):
    model, table, prompts = embedded
    cfg = DecodeConfig(mode="speculative", drafter="joint", max_new_tokens=24, stop_at_eos=False)
    for greedy in (False, True):
        ref = generate(model, prompts[0], replace(cfg, greedy=greedy, dynamic_kernel="dense"), table=table)
        res = generate(model, prompts[0], replace(cfg, greedy=greedy, dynamic_kernel=kernel), table=table)
        assert res.token_ids == ref.token_ids and res.trace.accepted_lengths == ref.trace.accepted_lengths
        assert res.trace.dynamic_kernel[kernel] > 0 and set(ref.trace.dynamic_kernel) == {"dense"}


def test_masked_grid_of_candidates_without_table_is_dense():
    cands = [Candidates(np.arange(3), np.full(3, 1 / 3, np.float32)) for _ in range(2)]
    assert joint_cells(cands, DecodeConfig(mode="dynamic", eps_b=0.0), None, np.zeros(3, bool)).kernel == "dense"


@pytest.fixture(scope="module")
def markov_table(tmp_path_factory):
    """Stats of a 12-token Markov chain with forbidden transitions: a real table, absent cells 0."""
    import json
    from pathlib import Path

    from multitoken.base.data import DataConfig
    from multitoken.stats.job import BuildConfig, build
    from multitoken.stats.table import CooccurrenceTable

    tmp = tmp_path_factory.mktemp("markov")
    rng = np.random.default_rng(5)
    trans = rng.random((12, 12)) * (rng.random((12, 12)) < 0.6)
    trans /= trans.sum(1, keepdims=True)
    with open(tmp / "c.jsonl", "w") as fh:
        for _ in range(40):
            doc = [int(rng.integers(12))]
            for _ in range(200):
                doc.append(int(rng.choice(12, p=trans[doc[-1]])))
            fh.write(json.dumps({"input_ids": doc}) + "\n")
    tokenizer = Path(__file__).resolve().parents[2] / "assets" / "pythia_tokenizer"
    build(BuildConfig(out=str(tmp / "stats"), tokenizer=str(tokenizer), vocab_size=12),
          DataConfig(data=str(tmp / "c.jsonl")), log=lambda *_: None)
    return CooccurrenceTable(tmp / "stats")


@pytest.mark.parametrize("kernel", ["dense", *KERNELS])
def test_emitted_pairs_follow_the_grid_with_real_stats(markov_table, kernel):
    """The chi-square test of test_step on a real table, through every kernel."""
    from .test_step import V, assert_draws_follow_grid, pair_logps

    logps = pair_logps(np.random.default_rng(3))
    ratio = markov_table.ratio([np.arange(V), np.arange(V)]).astype(np.float64)
    assert (ratio == 0).any(), "the table must have absent pairs"
    assert_draws_follow_grid(logps, ratio, markov_table, kernel)
