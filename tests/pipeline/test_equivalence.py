"""The sweep's same-quality test: paired cluster bootstrap over prompts, verdicts, their power."""

import math
import random

import numpy as np
import pytest

from multitoken.pipeline.eval import equivalence as E


def _runs(values: dict[str, list[float]]) -> list[dict]:
    """Run dicts from per-metric value lists (all of one length)."""
    n = len(next(iter(values.values())))
    return [{k: v[i] for k, v in values.items()} for i in range(n)]


def _ar_like(prompts: int, seeds: int, rng: random.Random) -> tuple[list[dict], list[int]]:
    """Noisy ar runs in prompt-major order (like the sweep's) and each run's prompt index."""
    clusters = [p for p in range(prompts) for _ in range(seeds)]
    runs = [{"nll": 1.2 + 0.3 * rng.gauss(0, 1), "repetition": max(0.0, 0.01 + 0.01 * rng.gauss(0, 1)),
             "distinct2": 0.95 + 0.02 * rng.gauss(0, 1), "distinct3": 0.98 + 0.01 * rng.gauss(0, 1)} for _ in clusters]
    return runs, clusters


def test_identical_to_ar_is_same_on_every_metric():
    ar, clusters = _ar_like(10, 2, random.Random(0))
    vs = E.compare_to_ar([dict(r) for r in ar], ar, clusters)
    assert list(vs) == list(E.CRITERIA)
    for key, test in vs.items():
        assert test["verdict"] == "same", key
        assert (test["diff"], test["lo"], test["hi"], test["se"], test["mde"]) == (0.0, 0.0, 0.0, 0.0, 0.0)
        assert (test["prompts"], test["runs"], test["margin"]) == (10, 20, E.MARGINS[key])


def test_worse_by_more_than_the_margin_on_one_metric_is_worse():
    """20 prompts x 2 seeds; the point repeats 4-grams 0.06 more often than ar (3x the margin),
    with run-to-run noise; the other metrics equal ar's up to a little noise."""
    rng = random.Random(1)
    ar, clusters = _ar_like(20, 2, rng)
    point = [{**r, "repetition": r["repetition"] + 0.06 + 0.02 * rng.gauss(0, 1),
              "nll": r["nll"] + 0.01 * rng.gauss(0, 1)} for r in ar]
    vs = E.compare_to_ar(point, ar, clusters)
    rep = vs["repetition"]
    assert rep["verdict"] == "worse" and rep["lo"] > E.MARGINS["repetition"] and rep["mde"] < E.MARGINS["repetition"]
    assert rep["diff"] == pytest.approx(sum(p["repetition"] - a["repetition"] for p, a in zip(point, ar)) / 40)
    assert {k: v["verdict"] for k, v in vs.items()} == {"nll": "same", "repetition": "worse", "distinct2": "same", "distinct3": "same"}
    # distinct-n's worse side is lower, NLL's higher: the same shift the other way round
    low = [{**r, "distinct2": r["distinct2"] - 0.1, "nll": r["nll"] - 0.2} for r in ar]
    assert {k: v["verdict"] for k, v in E.compare_to_ar(low, ar, clusters).items()} == {
        "nll": "better", "repetition": "same", "distinct2": "worse", "distinct3": "same"}


def test_noisy_prompts_are_undetermined_and_say_why():
    """2 prompts x 2 seeds whose NLL differences scatter by +-0.3: the interval holds 0 and spans
    far more than the +-0.05 margin, the mde is several margins: no verdict but undetermined."""
    ar = _runs({k: [1.0, 1.0, 1.0, 1.0] for k in E.CRITERIA})
    point = [{**r, "nll": r["nll"] + d} for r, d in zip(ar, (0.3, -0.1, -0.25, 0.05))]
    nll = E.compare_to_ar(point, ar, [0, 0, 1, 1])["nll"]
    assert nll["verdict"] == "undetermined" and nll["prompts"] == 2
    # the prompts' mean differences are +0.1 and -0.1: every resample's mean is one of -0.1, 0, +0.1
    assert (nll["lo"], nll["hi"]) == pytest.approx((-0.1, 0.1)) and nll["diff"] == pytest.approx(0.0)
    assert nll["mde"] == pytest.approx(E.MDE_FACTOR * nll["se"]) and nll["mde"] > 3 * E.MARGINS["nll"]
    assert nll["se"] == pytest.approx(0.1 / math.sqrt(2), rel=0.05)  # sd of a mean of 2 draws of +-0.1
    # enough prompts for a verdict, still too noisy: 10 prompts x 2 seeds scattering by sd 0.3 around
    # no true difference; the interval holds 0 but reaches past the margin, and the mde says why
    rng = random.Random(3)
    ar, clusters = _ar_like(10, 2, rng)
    point = [{**r, "nll": r["nll"] + 0.3 * rng.gauss(0, 1)} for r in ar]
    nll = E.compare_to_ar(point, ar, clusters)["nll"]
    assert nll["lo"] < 0 < nll["hi"] and nll["hi"] - nll["lo"] > 2 * E.MARGINS["nll"]
    assert nll["verdict"] == "undetermined" and nll["mde"] > E.MARGINS["nll"]


def test_too_few_prompts_give_no_verdict_however_clear():
    """4 prompts all 0.3 worse (no noise at all): the interval is [0.3, 0.3], yet 4 prompts are
    below MIN_PROMPTS, so the verdict is undetermined; one prompt gives no interval at all."""
    ar = _runs({k: [1.0] * 8 for k in E.CRITERIA})
    point = [{**r, "nll": 1.3} for r in ar]
    clusters = [p for p in range(4) for _ in range(2)]
    nll = E.compare_to_ar(point, ar, clusters)["nll"]
    assert (nll["lo"], nll["hi"]) == pytest.approx((0.3, 0.3)) and nll["verdict"] == "undetermined"
    assert E.MIN_PROMPTS == 5
    assert E.compare_to_ar(point + point[:2], ar + ar[:2], clusters + [4, 4])["nll"]["verdict"] == "worse"
    one = E.paired_bootstrap([1.3, 1.2], [1.0, 1.0], [0, 0])
    assert one["diff"] == pytest.approx(0.25) and math.isnan(one["lo"]) and math.isnan(one["mde"]) and one["prompts"] == 1
    assert E.verdict(one, "nll") == "undetermined"


def test_inside_the_margin_is_same_even_when_the_difference_is_certain():
    """Equivalence, not a difference test: 40 prompts each exactly 0.01 above ar in NLL (a real,
    certain difference, a fifth of the margin) are the same quality."""
    ar = _runs({k: [1.0] * 40 for k in E.CRITERIA})
    point = [{**r, "nll": 1.01} for r in ar]
    nll = E.compare_to_ar(point, ar, list(range(40)))["nll"]
    assert nll["lo"] > 0 and nll["verdict"] == "same"


def test_the_bootstrap_resamples_prompts_not_runs():
    """10 prompts x 4 seeds whose differences are one value per prompt (-0.45 .. +0.45): the
    standard error is that of a mean of 10 prompts (sd / sqrt(10)), not of 40 runs (half as
    large); all seeds of a prompt travel together."""
    clusters = [p for p in range(10) for _ in range(4)]
    diffs = [(p - 4.5) / 10 for p in clusters]
    test = E.paired_bootstrap(diffs, [0.0] * 40, clusters)
    prompt_means = np.arange(10) / 10 - 0.45
    assert test["se"] == pytest.approx(prompt_means.std() / math.sqrt(10), rel=0.08)
    assert test["se"] > 1.5 * np.std(diffs) / math.sqrt(40)


def test_hand_made_resamples_and_nan_runs():
    """The statistic is the mean over the drawn runs (runs of a prompt weighted by count); a run
    with a NaN on either side is left out."""
    point = [1.0, 3.0, float("nan"), 5.0, 0.0]
    ar = [0.0, 0.0, 0.0, 0.0, float("nan")]
    # prompt 0: differences 1 and 3; prompt 1: 5 (its two other runs dropped)
    draws = np.array([[0, 0], [0, 1], [1, 1], [1, 0]])
    test = E.paired_bootstrap(point, ar, [0, 0, 1, 1, 1], draws)
    means = [8 / 4, 9 / 3, 10 / 2, 9 / 3]  # [0, 1]: (1 + 3 + 5) / 3 runs, not (2 + 5) / 2 prompt means
    assert test["diff"] == pytest.approx(3.0) and test["runs"] == 3 and test["prompts"] == 2
    assert test["se"] == pytest.approx(np.std(means, ddof=1)) and test["mde"] == pytest.approx(2.8016 * test["se"], rel=1e-4)
    # numpy's linear percentiles of the sorted means 2, 3, 3, 5 at 2.5% and 97.5%
    assert (test["lo"], test["hi"]) == pytest.approx((2 + 0.075, 3 + 0.925 * 2))
    with pytest.raises(ValueError, match="differ in number"):
        E.paired_bootstrap([1.0], [1.0, 2.0], [0, 0])


def test_the_fixed_seed_makes_the_report_reproducible():
    rng = random.Random(2)
    ar, clusters = _ar_like(12, 3, rng)
    point = [{k: v + 0.02 * rng.gauss(0, 1) for k, v in r.items()} for r in ar]
    first, again = E.compare_to_ar(point, ar, clusters), E.compare_to_ar(point, ar, clusters)
    assert first == again
    assert (E.resample_indices(12) == E.resample_indices(12, seed=E.BOOTSTRAP_SEED)).all()
    other = E.paired_bootstrap([r["nll"] for r in point], [r["nll"] for r in ar], clusters, E.resample_indices(12, seed=1))
    assert (other["lo"], other["hi"]) != (first["nll"]["lo"], first["nll"]["hi"])  # the draws matter; the seed fixes them
    assert other["diff"] == first["nll"]["diff"]


def test_the_rule_names_its_margins_and_power():
    rule = E.SAME_QUALITY_RULE
    assert all(f"{k} +-{m:g}" in rule for k, m in E.MARGINS.items())
    assert "2000 resamples" in rule and "2.80 x the bootstrap standard error" in rule and "below 5 prompts" in rule
    assert E.settings()["margins"] == E.MARGINS and E.settings()["worse_when"]["distinct2"] == "lower"
    assert E.MDE_FACTOR == pytest.approx(1.959964 + 0.841621, abs=1e-5)  # z_0.975 + z_0.8
