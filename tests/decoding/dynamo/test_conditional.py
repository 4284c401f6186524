"""DynaMo over conditional drafts (decoding/dynamo/step.py: conditional_propose): one step's tokens follow the
definition's exact distribution (chi-square against an exhaustive enumeration), eps_b keeps its
meaning (0: n tokens, 1: one, the drafter never asked), a prefix that cannot pass never asks the
drafter, and the rows' sparse kernels equal the dense reference bit for bit."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from scipy.stats import chisquare

from multitoken.decoding.config import DecodeConfig, numba_available
from multitoken.decoding.dynamo import Candidates
from multitoken.decoding.dynamo.step import conditional_propose, first_token, row_cells

from ..conftest import RatioTable
from ...stats.test_stats_sparse import VOCAB, zipf_table  # noqa: F401  (a fixture)
from .conditional_oracle import exact_step

V = 6
KERNELS = ["numpy", "numba"] if numba_available() else ["numpy"]


class Drafter:
    """Fixed random conditionals for every prefix (a drafter that reads the whole prefix), and
    how often each prefix was asked."""

    def __init__(self, seed: int, k: int = V, temperature: float = 0.8, scale: float = 1.5):
        self.rng, self.k, self.temperature, self.scale = np.random.default_rng(seed), k, temperature, scale
        self.logits: dict[tuple, np.ndarray] = {}
        self.asked: list[tuple] = []

    def scores(self, prefix) -> np.ndarray:
        key = tuple(prefix)
        if key not in self.logits:
            self.logits[key] = self.rng.normal(0, self.scale, V)
        return self.logits[key]

    def probs(self, prefix) -> np.ndarray:
        """[V] the tempered top-k (what the oracle reads)."""
        z = self.scores(prefix)
        top = np.argsort(-z, kind="stable")[:self.k]
        out = np.zeros(V)
        e = np.exp((z[top] - z[top].max()) / self.temperature)
        out[top] = e / e.sum()
        return out

    def candidates(self, prefix) -> Candidates:
        """The top-k as ``head_candidates`` gives them (ids most likely first, float32 probs)."""
        self.asked.append(tuple(prefix))
        p = self.probs(prefix)
        ids = np.argsort(-p, kind="stable")[:self.k]
        return Candidates(ids.astype(np.int64), p[ids].astype(np.float32))


def first_of(p1: np.ndarray) -> Candidates:
    ids = np.argsort(-p1, kind="stable")
    return Candidates(ids.astype(np.int64), p1[ids].astype(np.float32))


def sample_steps(p1, drafter, n, cfg, table, seen, runs: int) -> dict[tuple, int]:
    counts: dict[tuple, int] = {}
    for seed in range(runs):
        rng = np.random.default_rng(seed)
        first = first_token(first_of(p1), cfg, seen, rng)
        tokens = tuple(conditional_propose(first, drafter.candidates, n, cfg, table, seen, rng).tokens)
        counts[tokens] = counts.get(tokens, 0) + 1
    return counts


def assert_follows(counts: dict, exact: dict) -> None:
    """Chi-square of the sampled tokens against the exact distribution (cells expected < 5 pooled)."""
    assert set(counts) <= set(exact), set(counts) - set(exact)
    keys = sorted(exact)
    obs = np.array([counts.get(key, 0) for key in keys], dtype=float)
    exp = np.array([exact[key] for key in keys]) * obs.sum()
    small = exp < 5
    o = np.append(obs[~small], obs[small].sum()) if small.any() else obs
    e = np.append(exp[~small], exp[small].sum()) if small.any() else exp
    assert chisquare(o, e * o.sum() / e.sum()).pvalue > 1e-3, (counts, exact)


@pytest.mark.parametrize("settings", [{}, {"blur_kernel": 0}, {"adaptive_threshold": False}, {"alpha_c": 0.0},
                                      {"static_threshold": False}, {"eps_b": 0.05}, {"repetition_penalty": 1.0}])
def test_one_step_follows_its_exhaustive_definition(settings):
    """x_1 from the base (penalised), then every order's row of the conditional joint, masked,
    thresholded, blurred + Otsu'd, penalised, backed off: the sampled steps' frequencies match
    the enumeration of the definition, with one- to three-token steps all present."""
    cfg = DecodeConfig(mode="dynamic", **{"eps_b": 0.1, "temperature": 0.8, "top_k": V, **settings}).resolved()
    p1 = np.array([0.45, 0.25, 0.12, 0.08, 0.06, 0.04])
    seen = np.zeros(V, dtype=bool)
    seen[[1, 4]] = True  # the penalty bites on x_1 and on the rows
    drafter = Drafter(seed=1)
    exact = exact_step(p1, drafter.probs, 3, cfg, RatioTable(), seen)
    assert abs(sum(exact.values()) - 1) < 1e-9
    counts = sample_steps(p1, drafter, 3, cfg, RatioTable(), seen, 2000)
    assert_follows(counts, exact)
    assert {1, 3} <= {len(t) for t in counts} and len(counts) >= 8  # backed off and full steps, many outcomes


def test_eps_b_keeps_its_meaning():
    """eps_b = 0: n tokens every step; eps_b = 1: one token, and the drafter is never asked."""
    p1, seen = np.full(V, 1 / V), np.zeros(V, dtype=bool)
    for eps_b, length in ((0.0, 3), (1.0, 1)):
        cfg = DecodeConfig(mode="dynamic", eps_b=eps_b, top_k=V).resolved()
        drafter = Drafter(seed=3)
        counts = sample_steps(p1, drafter, 3, cfg, RatioTable(), seen, 200)
        assert {len(t) for t in counts} == {length}
        assert bool(drafter.asked) == (eps_b < 1)


def test_a_prefix_that_cannot_pass_never_asks_the_drafter():
    """Every cell of J(x_1, .) is at most p(x_1): with p(x_1) <= eps_b the step backs off to one
    token without running the drafter; above it, the drafter is asked for that prefix."""
    cfg = DecodeConfig(mode="dynamic", eps_b=0.4, top_k=V).resolved()
    p1 = np.array([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])
    seen = np.zeros(V, dtype=bool)
    for seed in range(60):
        drafter, rng = Drafter(seed=seed), np.random.default_rng(seed)
        first = first_token(first_of(p1), cfg, seen, rng)
        x1, value = first.tokens[0], first.value
        choice = conditional_propose(first, drafter.candidates, 3, cfg, None, seen, rng)
        asked = [p for p in drafter.asked if len(p) == 1]
        assert bool(asked) == (value > 0.4), (x1, value, drafter.asked)
        if not asked:
            assert choice.tokens == [x1] and choice.backed_off == [2]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("settings", [{"blur_kernel": 0}, {"adaptive_threshold": False}, {}])
def test_rows_match_the_dense_reference(zipf_table, kernel, settings):  # noqa: F811
    """A row is ``joint_cells`` over one-cell prefix axes with the scaled static threshold: the
    sparse kernels give the dense reference's cells bit for bit where they apply (no blur over a
    one-cell axis), and the dense path computes the row where they do not."""
    rng = np.random.default_rng(5)
    cfg = DecodeConfig(mode="dynamic", eps_b=0.2, **settings).resolved()
    sparse = not (cfg.dynamo.adaptive_threshold and cfg.dynamo.blur_kernel > 1)
    seen = np.zeros(VOCAB, dtype=bool)
    seen[rng.choice(VOCAB, 6, replace=False)] = True
    kernels = set()
    for trial in range(40):
        prefix = [int(x) for x in rng.choice(VOCAB, 1 + trial % 2, replace=False)]
        ids = rng.choice(VOCAB, 20, replace=False).astype(np.int64)
        cand = Candidates(ids, np.sort(rng.dirichlet(np.full(20, 0.4)).astype(np.float32))[::-1].copy())
        value = float(rng.uniform(0.2, 1.0))
        ref = row_cells(prefix, value, cand, replace(cfg, dynamic_kernel="dense"), zipf_table, seen)
        got = row_cells(prefix, value, cand, replace(cfg, dynamic_kernel=kernel), zipf_table, seen)
        np.testing.assert_array_equal(got[0].flat, ref[0].flat)
        np.testing.assert_array_equal(got[0].values.view(np.uint32), ref[0].values.view(np.uint32))
        np.testing.assert_array_equal(got[1].view(np.uint32), ref[1].view(np.uint32))
        assert got[2] == ref[2]
        kernels.add(got[0].kernel)
    assert kernels == ({kernel, "dense"} if sparse else {"dense"}) or (sparse and kernels == {kernel})
