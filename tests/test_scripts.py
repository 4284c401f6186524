"""What the benchmark scripts share (``scripts/bench_common.py``): every method's one untimed
warm-up run before the timed repetitions, and dependencies' console noise kept off as in the CLI;
the steps ``bench_decode.py``'s logic timing replays (``scripts/logic_stages.py``)."""

from __future__ import annotations

import subprocess
import sys
import time

from .conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
try:
    from bench_common import best_of, load, open_table
    from logic_stages import recorded_steps, stage_times
finally:
    sys.path.remove(str(REPO / "scripts"))


def test_every_method_runs_once_untimed_before_its_timed_repetitions():
    calls: list[str] = []
    seen: list[str] = []

    def method(label):
        def run():
            calls.append(label)
            time.sleep(0.02 if label == "b" else 0.0)
            return {"cold": calls.count(label) == 1}
        return run

    best = best_of({"a": method("a"), "b": method("b")}, 1, before=seen.append)
    assert calls == ["a", "b", "a", "b"]  # warm-up of each, then the one timed repetition, interleaved
    assert seen == ["a", "b", "a", "b"]
    assert not best["a"]["cold"] and not best["b"]["cold"]  # --reps 1 keeps a warm run, never the first
    assert 0.02 <= best["b"]["wall_s"] < 1.0 and best["a"]["wall_s"] < best["b"]["wall_s"]  # the run's own time


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


def test_logic_timing_replays_the_heads_rows_of_the_models_own_dynamic_text():
    import torch

    from multitoken.decoding.config import DecodeConfig
    from multitoken.embedded import DEFAULT_BASE, EMBEDDED_HEADS, EMBEDDED_STATS

    model, _ = load(str(DEFAULT_BASE), str(EMBEDDED_HEADS))
    table = open_table(str(EMBEDDED_STATS), model.backbone.tokenizer)
    prompt = model.backbone.tokenizer.encode("Once upon a time")
    steps = recorded_steps(model, table, [prompt], 5)
    assert len(steps) == 5  # one per new token: the anchors of the prompt's last token and of 4 new ones
    first = model.head_logits(torch.tensor([prompt]))  # n x [1, 1, V]: the rows a step at the prompt's end reads
    logps, seen = steps[0]
    assert len(logps) == model.n_future and all(torch.allclose(a, b[0, -1], atol=1e-5) for a, b in zip(logps, first))
    assert seen[prompt].all() and seen.sum() == len(set(prompt))
    assert set(prompt) <= set(steps[-1][1].nonzero()[0].tolist())  # later steps see the prompt and the new text
    times = stage_times(steps, 3, DecodeConfig(mode="dynamic", eps_b=0.0), table, "dense", 1)
    assert times["dynamic_propose"] > 0
