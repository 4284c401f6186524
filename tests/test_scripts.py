"""What the benchmark scripts share (``scripts/bench_common.py``): every method's one untimed
warm-up run before the timed repetitions, and dependencies' console noise kept off as in the CLI."""

from __future__ import annotations

import subprocess
import sys

from .conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
try:
    from bench_common import best_of
finally:
    sys.path.remove(str(REPO / "scripts"))


def test_every_method_runs_once_untimed_before_its_timed_repetitions():
    calls: list[str] = []
    seen: list[str] = []

    def method(label):
        def run():
            calls.append(label)
            return {"cold": calls.count(label) == 1}
        return run

    best = best_of({"a": method("a"), "b": method("b")}, 1, before=seen.append)
    assert calls == ["a", "b", "a", "b"]  # warm-up of each, then the one timed repetition, interleaved
    assert seen == ["a", "b", "a", "b"]
    assert not best["a"]["cold"] and not best["b"]["cold"]  # --reps 1 keeps a warm run, never the first
    assert best["a"]["wall_s"] >= 0


def test_the_fastest_repetition_is_kept_and_warm_up_can_be_skipped():
    calls = []
    best = best_of({"a": lambda: calls.append(1) or {"n": len(calls)}}, 3, warm_up=False,
                   after=lambda: {"peak": 1})
    assert len(calls) == 3 and best["a"]["peak"] == 1 and best["a"]["n"] in (1, 2, 3)


def test_scripts_load_models_without_dependencies_progress_bars():
    code = ("import sys; sys.path.insert(0, 'scripts'); import bench_common; "
            "from multitoken.embedded import DEFAULT_BASE; bench_common.load(DEFAULT_BASE, None); "
            "import os, transformers.utils.logging as t; "
            "assert os.environ['HF_HUB_DISABLE_PROGRESS_BARS'] == '1' and not t.is_progress_bar_enabled()")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Loading weights" not in done.stderr and "it/s" not in done.stderr
