"""scripts/bench_tree.py, as ``make demo-real`` runs it: every column of its table holds a value
(x ar for greedy rows too, tokens per forward for transformers' rows), a progress line after
each run with the warm-up on the first prompt only, an honest headline, and the speeds' plot."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from multitoken.embedded import DEFAULT_BASE, EMBEDDED_HEADS
from multitoken.pipeline.eval.benchmark import load
from multitoken.pipeline.eval.plotting import plot_speeds

from .conftest import REPO
from .test_scripts import SCRIPTS, load_script

ROWS = ["hf_prompt_lookup", "ar", "chain", "static_4", "dynamic_4", "chain+lookup", "dynamic_4+lookup"]


@pytest.fixture(scope="module")
def bench_tree():
    return load_script(SCRIPTS / "bench_tree.py")


@pytest.fixture(scope="module")
def part(bench_tree):
    """The embedded model's rows at a demo's options, small: 2 prompts x 8 tokens."""
    args = bench_tree.parse_args(["--budgets", "4", "--reps", "1", "--max-new-tokens", "8", "--lookup", "4", "--out", None])
    model, label = load(str(DEFAULT_BASE), str(EMBEDDED_HEADS))
    lines: list[str] = []
    prompts = ["Once upon a time", "The little dog ran to the park and"]
    return bench_tree.bench("stories260K", model, label, prompts, args, only=ROWS, log=lines.append), lines


def test_every_column_of_the_table_has_a_value(bench_tree, part):
    r, _ = part
    assert list(r["methods"]) == ["hf_greedy", *ROWS]
    lines = bench_tree.table_lines(r)
    assert not any("nan" in line for line in lines), "\n".join(lines)
    rows = r["methods"]
    assert rows["ar"]["speedup_vs_ar"] == 1.0  # greedy rows against our ar greedy: the column was all nan
    assert rows["chain"]["speedup_vs_ar"] == round(rows["chain"]["tokens_per_s"] / rows["ar"]["tokens_per_s"], 3)
    assert rows["hf_greedy"]["tokens_per_forward"] == 1.0  # transformers' forwards counted: one per greedy token
    assert rows["hf_greedy"]["forward_passes"] == rows["hf_greedy"]["tokens"]
    assert rows["chain"]["tokens_per_forward"] > 1.0 and rows["static_4"]["tree_nodes"] == 4
    assert all(m["identical"] for m in rows.values())


def test_a_progress_line_follows_every_run_and_the_warm_up_decodes_one_prompt(part):
    r, lines = part
    labels = list(r["methods"])
    assert len(lines) == 2 * len(labels)  # the warm-up and the one timed repetition of each method
    assert all("warm-up, first prompt" in line for line in lines[:len(labels)])
    for label, line in zip(labels, lines[len(labels):]):
        assert f": {label} (" in line and f"{r['methods'][label]['tokens']} tokens" in line and "so far" in line


def test_the_headline_is_the_fastest_row_with_transformers_text(bench_tree, part):
    r, _ = part
    ours = {k: m for k, m in r["methods"].items() if not k.startswith("hf_")}
    fastest = max(ours, key=lambda k: ours[k]["tokens_per_s"])
    line = bench_tree.headline(r)
    assert f"fastest {fastest}: " in line and f"x{ours[fastest]['speedup_vs_hf_greedy']:.2f} transformers" in line
    assert "every greedy row gave transformers' greedy text" in line
    wrong = {**r, "methods": {**r["methods"], fastest: {**ours[fastest], "identical": False}}}
    line = bench_tree.headline(wrong)
    assert f"fastest {fastest}:" not in line and f"NOT transformers' text: {fastest}" in line


def test_the_speeds_plot_is_written(part, tmp_path):
    r, _ = part
    out = plot_speeds([r, {**r, "model": "again"}], tmp_path / "trees.png", "8 new tokens")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_make_demo_real_names_only_rows_the_script_runs(bench_tree):
    """The Makefile's tree command parses, and every row it keeps is a method of the script (a
    misspelt label would drop its row without a word); the plot lands beside the JSON record."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    variables = {**dict(re.findall(r"^(\w+) \?= (.*)$", text, re.M)), "VENV": ".venv"}
    line = next(line for line in text.splitlines() if line.startswith("\t") and "scripts/bench_tree.py" in line)
    line = re.sub(r"\$\((\w+)\)", lambda m: variables[m[1]], line)
    args = bench_tree.parse_args(shlex.split(line.split("scripts/bench_tree.py", 1)[1]))
    model = load(str(DEFAULT_BASE), str(EMBEDDED_HEADS))[0]
    known = bench_tree.methods(model, args)
    assert args.rows and set(args.rows) <= set(known) and set(args.first_kernel_rows) <= set(known)
    assert args.smollm2 and args.no_embedded and args.cpu_linear == ["stock", "rows"]
    assert Path(args.plot).parent == Path(args.out).parent and args.plot.endswith(".png")
