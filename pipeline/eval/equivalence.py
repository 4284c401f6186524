"""The sweep's same-quality test: paired differences from ar, a cluster bootstrap over prompts,
an equivalence verdict per metric and the power the data gave it.

A point and ar run the same prompts with the same seeds, so every point run has its ar twin:
the difference ``point - ar`` is taken per (prompt, seed) run. Runs of one prompt are not
independent (the prompt sets the topic, the length the text can go before looping, ...), so the
unit of resampling is the prompt: ``BOOTSTRAP_RESAMPLES`` times, as many prompts as were run are
drawn with replacement, all seeds of a drawn prompt coming with it, and the mean difference over
the drawn runs is recorded (a cluster bootstrap; ``BOOTSTRAP_SEED`` fixes the draws, so a report
is reproducible and every point and metric of a sweep sees the same draws). Per metric:

- ``diff``: the mean paired difference over all runs; ``lo``, ``hi``: the 2.5th and 97.5th
  percentiles of the resampled means (the 95% percentile interval); ``se``: their standard
  deviation (the bootstrap standard error);
- ``mde``: the minimum detectable difference, ``MDE_FACTOR`` x se = (z_0.975 + z_0.8) x se = 2.80
  x se: the smallest true difference a two-sided 5% test finds 80% of the time. An ``mde``
  above the metric's margin says the data were too few to tell a difference that large from 0;
- ``verdict`` (``SAME_QUALITY_RULE``), with the margin m of ``MARGINS`` and the metric's worse
  side (``WORSE_WHEN``: higher NLL, higher repetition, lower distinct-n):
  ``same`` when the whole interval lies within [-m, +m] (an equivalence test: two one-sided
  tests at 2.5%); else ``worse`` or ``better`` when the interval excludes 0 (a difference shown,
  not shown to be negligible), on the metric's worse or better side; else ``undetermined``
  (the interval holds 0 and reaches past the margin: too little data to call it either way).

A point is of ar's quality when all four metrics are ``same``. ``better`` is not ``same``: the
rule asks for ar's text, and a point whose NLL is far below ar's samples like a lower
temperature. Runs where either side has no value (NaN: the NLL of an empty continuation) are
left out, and a prompt left with no run drops out. The prompts are the sample size: the
percentile interval of a mean over n prompts is narrower than a t interval (for normal
differences it covers the mean ~85% of the time at n = 5, ~90% at 10, ~93% at 20, i.e.
P(|t_(n-1)| < 1.96 sqrt((n-1)/n)); at n = 2 it is the range of the two prompts' means). So the
interval and mde are reported from 2 prompts on, but a verdict other than ``undetermined``
needs ``MIN_PROMPTS`` (5); the sweep's default runs DynaMo's 10 prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np

CRITERIA = ("nll", "repetition", "distinct2", "distinct3")  # all four must be "same"
# The equivalence margin of each metric: a difference from ar within +-margin counts as none.
MARGINS = {"nll": 0.05, "repetition": 0.02, "distinct2": 0.02, "distinct3": 0.02}
# +1: higher than ar is worse; -1: lower is worse.
WORSE_WHEN = {"nll": +1, "repetition": +1, "distinct2": -1, "distinct3": -1}
VERDICTS = ("same", "worse", "better", "undetermined")
LEVEL = 0.95
POWER = 0.8
MDE_FACTOR = NormalDist().inv_cdf((1 + LEVEL) / 2) + NormalDist().inv_cdf(POWER)  # 1.960 + 0.842 = 2.80
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
MIN_PROMPTS = 5  # for a verdict; an interval needs 2
SAME_QUALITY_RULE = (
    "paired point - ar per prompt and seed; 95% percentile interval of the mean difference from a "
    f"bootstrap over prompts ({BOOTSTRAP_RESAMPLES} resamples, seed {BOOTSTRAP_SEED}); a metric is 'same' when "
    "the interval lies within its margin (" + ", ".join(f"{k} +-{m:g}" for k, m in MARGINS.items()) + "), "
    "'worse'/'better' when it excludes 0 otherwise, else 'undetermined' (always below "
    f"{MIN_PROMPTS} prompts); same quality = all four 'same'; "
    f"mde = {MDE_FACTOR:.2f} x the bootstrap standard error (smallest difference found at 80% power)")


def resample_indices(n_prompts: int, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """[resamples, n_prompts] prompt indices drawn with replacement, the same for a given seed."""
    return np.random.default_rng(seed).integers(0, n_prompts, size=(resamples, n_prompts))


def paired_bootstrap(point: Sequence[float], ar: Sequence[float], prompts: Sequence[int],
                     draws: np.ndarray | None = None) -> dict:
    """Mean of ``point - ar`` (run k of each is the same prompt ``prompts[k]`` and seed), with the
    95% percentile interval, standard error and mde of a bootstrap over prompts; ``draws``:
    ``resample_indices`` for the number of distinct prompts (drawn here when not given). Runs
    where either value is NaN are left out."""
    if not len(point) == len(ar) == len(prompts):
        raise ValueError(f"paired runs differ in number: {len(point)} point, {len(ar)} ar, {len(prompts)} prompt ids")
    order = {p: i for i, p in enumerate(dict.fromkeys(prompts))}  # prompt -> cluster, first seen first
    sums, counts = np.zeros(len(order)), np.zeros(len(order))
    for x, y, p in zip(point, ar, prompts):
        if not (math.isnan(x) or math.isnan(y)):
            sums[order[p]] += x - y
            counts[order[p]] += 1
    kept = counts > 0
    n_prompts, runs = int(kept.sum()), int(counts.sum())
    diff = float(sums.sum() / runs) if runs else float("nan")
    out = {"diff": diff, "lo": float("nan"), "hi": float("nan"), "se": float("nan"), "mde": float("nan"),
           "prompts": n_prompts, "runs": runs}
    if n_prompts < 2:  # one prompt: nothing to resample
        return out
    if n_prompts < len(order):  # a prompt with no scored run: resample the others
        sums, counts, draws = sums[kept], counts[kept], None
    if draws is None or draws.shape[1] != n_prompts:
        draws = resample_indices(n_prompts)
    means = sums[draws].sum(1) / counts[draws].sum(1)  # [resamples]
    lo, hi = np.percentile(means, [100 * (1 - LEVEL) / 2, 100 * (1 + LEVEL) / 2])
    se = float(means.std(ddof=1))
    return {**out, "lo": float(lo), "hi": float(hi), "se": se, "mde": MDE_FACTOR * se}


def verdict(test: dict, metric: str) -> str:
    """``same``, ``worse``, ``better`` or ``undetermined`` for one metric's ``paired_bootstrap``."""
    lo, hi, margin = test["lo"], test["hi"], MARGINS[metric]
    if test["prompts"] < MIN_PROMPTS or math.isnan(lo) or math.isnan(hi):
        return "undetermined"
    if -margin <= lo and hi <= margin:
        return "same"
    if lo > 0 or hi < 0:
        return "worse" if (lo > 0) == (WORSE_WHEN[metric] > 0) else "better"
    return "undetermined"


def compare_to_ar(runs: list[dict], ar_runs: list[dict], prompts: Sequence[int]) -> dict[str, dict]:
    """Per criterion: ``paired_bootstrap`` of the point's runs against ar's (run k of both: prompt
    ``prompts[k]``, the same seed), its margin and its ``verdict``."""
    draws = resample_indices(len(set(prompts)))
    out = {}
    for key in CRITERIA:
        test = paired_bootstrap([r[key] for r in runs], [a[key] for a in ar_runs], prompts, draws)
        out[key] = {**test, "margin": MARGINS[key], "verdict": verdict(test, key)}
    return out


def settings() -> dict:
    """The test's constants, for the JSON report."""
    return {"unit": "prompt (all its seeds together)", "level": LEVEL, "resamples": BOOTSTRAP_RESAMPLES,
            "seed": BOOTSTRAP_SEED, "margins": dict(MARGINS), "worse_when": {k: "higher" if s > 0 else "lower" for k, s in WORSE_WHEN.items()},
            "power": POWER, "mde_factor": MDE_FACTOR, "min_prompts": MIN_PROMPTS}
