"""Bounds checked before decoding starts: the k^n grid, seeds, finite floats, and the blur past
opencv's channel limit (CV_CN_MAX: 128 in opencv 5, 512 in opencv 4)."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from scipy.ndimage import correlate1d

from multitoken.decoding.config import MAX_GRID_CELLS, DecodeConfig, check_grid
from multitoken.decoding.dynamo import gaussian_blur
from multitoken.base.config_io import MAX_RANGE_VALUES, expand_range
from multitoken.base.errors import UsageError


@pytest.mark.parametrize("channels", [127, 128, 129, 256, 512])
def test_3d_blur_matches_scipy_at_and_past_opencvs_channel_limit(channels):
    grid = np.random.default_rng(channels).random((5, 6, channels)).astype(np.float32)
    ref = grid
    for axis in range(3):
        ref = correlate1d(ref, cv2.getGaussianKernel(3, 0).ravel(), axis=axis, mode="mirror")
    np.testing.assert_allclose(gaussian_blur(grid, 3), ref, atol=1e-6)


def test_grid_bound_names_k_and_n_and_what_fits():
    check_grid(256, 3)  # 2**24 cells: the largest cube allowed
    assert 256 ** 3 == MAX_GRID_CELLS
    with pytest.raises(UsageError, match=r"--top-k 512 and n = 3 tokens per step builds a 512\^3 grid") as err:
        check_grid(512, 3)
    assert err.value.fix == "lower --top-k to 256 or less, or pass --n 2"
    with pytest.raises(UsageError, match=r"about 10\^169 cells") as err:
        check_grid(50, 100)
    assert err.value.fix == "pass --n 4"


def test_dynamic_grid_counts_the_stats_order_cap():
    cfg = DecodeConfig(mode="dynamic", top_k=50)
    cfg.validate(vocab_size=512, n_heads=5, max_order=3)  # 50^3 with order-3 stats
    with pytest.raises(UsageError, match=r"50\^5 grid"):
        cfg.validate(vocab_size=512, n_heads=5)
    DecodeConfig(mode="speculative", top_k=512).validate(vocab_size=512, n_heads=5)  # no grid there


@pytest.mark.parametrize("field, value, message", [
    ("seed", -1, r"--seed must be in \[0, 2\*\*63 - 1\]"), ("seed", 2**63, r"--seed must be in"),
    ("temperature", float("inf"), "--temperature must be a finite number"),
    ("repetition_penalty", float("nan"), "--repetition-penalty must be a finite number"),
    ("blur_kernel", -3, "--blur-kernel must be 0 or 1"), ("n", 0, "--n must be >= 1"),
])
def test_flags_alone_are_checked_without_a_model(field, value, message):
    with pytest.raises(UsageError, match=message):
        DecodeConfig(**{field: value}).validate()


def test_ranges_are_counted_before_they_are_built():
    assert len(expand_range("0:1:0.001")) == MAX_RANGE_VALUES
    with pytest.raises(ValueError, match="gives 1,000,000,000,001 values"):
        expand_range("0:1:1e-12")
    for bad in ("nan", "inf", "0:inf:0.1", "nan:1:0.1"):
        with pytest.raises(ValueError, match="finite|not a number"):
            expand_range(bad)


def test_alpha_c_is_bounded_by_float32_and_by_the_stats_largest_ratio():
    from multitoken.decoding.config import FLOAT32_LOG_ROOM, MAX_ALPHA_C, max_ratio
    from multitoken.embedded import EMBEDDED_STATS
    from multitoken.stats.table import CooccurrenceTable

    with pytest.raises(UsageError, match=r"--alpha-c must be in \[0, 64\], got 1e\+300"):
        DecodeConfig(alpha_c=1e300).validate()
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(4.0) ** np.float32(MAX_ALPHA_C))  # no larger exponent is meaningful
    table = CooccurrenceTable(EMBEDDED_STATS)
    top = max_ratio(table)
    limit = FLOAT32_LOG_ROOM / np.log(top)
    DecodeConfig(mode="dynamic", alpha_c=1.0).validate(table=table)  # DynaMo's own setting
    with pytest.raises(UsageError, match="overflows float32 with these stats") as err:
        DecodeConfig(mode="dynamic", alpha_c=float(limit) + 0.1).validate(table=table)
    assert err.value.fix.startswith(f"pass --alpha-c {np.floor(limit * 100) / 100:g} or less")
    # the bound is real: the largest ratio to the refused power overflows float32, to the allowed one it does not
    f32_max = float(np.finfo(np.float32).max)
    assert float(top) ** (limit + 0.1) * (1 << 24) > f32_max  # a full grid of such cells overflows
    assert float(top) ** limit * (1 << 24) < f32_max


def test_threads_past_the_cores_are_capped_with_a_warning(monkeypatch, capsys):
    import torch

    from multitoken.base import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    try:
        threads.set_threads(10000)
        assert torch.get_num_threads() == 2
        assert "warning: --threads 10000 is more than the 2 cores this process may use: using 2" in capsys.readouterr().err
        threads.set_threads(1)
        assert torch.get_num_threads() == 1 and capsys.readouterr().err == ""
    finally:
        torch.set_num_threads(before)
