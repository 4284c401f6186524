"""The benchmark harness every script under ``scripts/`` shares (``multitoken.pipeline.eval.benchmark``):
the record (machine, CPU features and flags, threads, load before / after, command, commit,
versions), the repetitions and the best kept, the ``--out`` JSON and its refusal to overwrite;
that every benchmark uses it and no script imports another; the steps ``bench_logic.py`` replays."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from multitoken.kernels import cpu_features
from multitoken.pipeline.eval import benchmark
from multitoken.pipeline.eval.benchmark import Bench, best_of, check_out, load, open_table

from .conftest import REPO

SCRIPTS = REPO / "scripts"
BENCHMARKS = sorted(SCRIPTS.glob("bench_*.py"))


def load_script(path: Path):
    """A script as a module, by its file path (scripts are no package and import no other script)."""
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# best_of ---------------------------------------------------------------------------------------
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


def test_the_fastest_repetition_is_kept_whatever_its_place():
    sleeps = iter([0.06, 0.0, 0.04])  # the second of three repetitions is the fastest
    best = best_of({"a": lambda: (time.sleep(s := next(sleeps)), {"slept": s})[1]}, 3, warm_up=False,
                   after=lambda: {"peak": 1})
    assert best["a"]["slept"] == 0.0 and best["a"]["wall_s"] < 0.04 and best["a"]["peak"] == 1


def test_a_score_picks_the_minimum_of_what_the_run_measured():
    scores = iter([5.0, 2.0, 9.0, 3.0])
    best = best_of({"a": lambda: {"per_step": next(scores)}}, 4, warm_up=False, score=lambda r: r["per_step"])
    assert best["a"]["per_step"] == 2.0


# The record ------------------------------------------------------------------------------------
def test_the_record_names_machine_load_command_commit_and_versions(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / "bench_decode.py"), "--reps", "1"])
    bench = Bench("decode", argparse.Namespace(out=str(tmp_path / "r.json"), overwrite=False), reps=1)
    record = bench.save()
    m = record["machine"]
    assert m["cpu"] and m["cores"] == __import__("os").cpu_count() and m["torch_threads"] == torch.get_num_threads()
    assert m["cpu_features"] == asdict(cpu_features.features())  # the kernels' own probe, not a second one
    have = set(cpu_features.cpu_flags().split())
    assert set(m["cpu_flags"]) == {f for f in benchmark.SPEED_FLAGS if f in have}
    assert len(record["load_before"]) == 3 and len(record["load_after"]) == 3
    assert record["command"] == "python scripts/bench_decode.py --reps 1"
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert record["git"]["commit"] == head and isinstance(record["git"]["dirty"], bool)
    assert record["versions"]["torch"] == torch.__version__ and record["versions"]["python"] == sys.version.split()[0]
    assert record["settings"] == {"reps": 1} and record["benchmark"] == "decode" and record["wall_s"] >= 0


def test_out_json_round_trips_numpy_and_tensors(tmp_path):
    out = tmp_path / "bench.json"
    bench = Bench("x", argparse.Namespace(out=str(out), overwrite=False))
    bench["rows"] = {"ms": np.float32(1.5), "ids": torch.tensor([1, 2]), "path": Path("/a/b")}
    bench.save()
    first = json.loads(out.read_text())
    assert first["rows"] == {"ms": 1.5, "ids": [1, 2], "path": "/a/b"}
    bench["more"] = 3  # a later save (after each part of a long run) replaces the file with the whole record
    again = json.loads(bench.save() and out.read_text())
    assert again["more"] == 3 and again["rows"] == first["rows"] and again["machine"] == first["machine"]


def test_out_refuses_to_overwrite_unless_asked(tmp_path):
    out = tmp_path / "bench.json"
    out.write_text("{}")
    with pytest.raises(SystemExit, match="already exists; pass --overwrite"):
        Bench("x", argparse.Namespace(out=str(out), overwrite=False))
    assert out.read_text() == "{}"  # refused before any work, the file untouched
    Bench("x", argparse.Namespace(out=str(out), overwrite=True)).save()
    assert json.loads(out.read_text())["benchmark"] == "x"
    with pytest.raises(SystemExit, match="is a directory"):
        check_out(tmp_path, overwrite=True)
    with pytest.raises(SystemExit, match="does not exist"):
        check_out(tmp_path / "missing" / "b.json", overwrite=False)


def test_a_script_refuses_an_existing_out_with_one_line(tmp_path):
    out = tmp_path / "layout.json"
    out.write_text("{}")
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_cache_layout.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and out.read_text() == "{}"
    assert done.stderr.strip().splitlines() == [f"error: --out {out} already exists; pass --overwrite to replace it, or another path"]


# Every script on the harness -------------------------------------------------------------------
def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_no_script_imports_another_or_edits_sys_path():
    scripts = sorted(SCRIPTS.rglob("*.py"))
    stems = {p.stem for p in scripts}
    assert {"bench_decode", "bench_tree", "cp_rank"} <= stems  # the walk sees the scripts at all
    for path in scripts:
        text = path.read_text()
        assert "sys.path" not in text, path
        assert not {name.split(".")[0] for name in _imports(path)} & stems, path


def test_every_benchmark_writes_the_harness_record():
    assert len(BENCHMARKS) >= 9
    for path in BENCHMARKS:
        text = path.read_text()
        assert "multitoken.pipeline.eval.benchmark" in _imports(path), path
        assert "Bench(" in text and "add_out(" in text, path
        # one record: no machine facts or load average gathered on the side, one --out writer
        for own in ("platform.", "getloadavg", "write_text(json", "json.dump(", "/proc/cpuinfo", "MULTITOKEN_FIXTURES"):
            assert own not in text, (path, own)


def test_scripts_load_models_without_dependencies_progress_bars():
    code = ("from multitoken.pipeline.eval.benchmark import load; from multitoken.embedded import DEFAULT_BASE; "
            "load(str(DEFAULT_BASE), None); "
            "import os, transformers.utils.logging as t; "
            "assert os.environ['HF_HUB_DISABLE_PROGRESS_BARS'] == '1' and not t.is_progress_bar_enabled()")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Loading weights" not in done.stderr and "it/s" not in done.stderr


def test_logic_timing_replays_the_heads_rows_of_the_models_own_dynamic_text():
    from multitoken.decoding.config import DecodeConfig
    from multitoken.embedded import DEFAULT_BASE, EMBEDDED_HEADS, EMBEDDED_STATS

    logic = load_script(SCRIPTS / "bench_logic.py")
    model, _ = load(str(DEFAULT_BASE), str(EMBEDDED_HEADS))
    table = open_table(str(EMBEDDED_STATS), model.backbone.tokenizer)
    prompt = model.backbone.tokenizer.encode("Once upon a time")
    steps = logic.recorded_steps(model, table, [prompt], 5)
    assert len(steps) == 5  # one per new token: the anchors of the prompt's last token and of 4 new ones
    first = model.head_logits(torch.tensor([prompt]))  # n x [1, 1, V]: the rows a step at the prompt's end reads
    logps, seen = steps[0]
    assert len(logps) == model.n_future and all(torch.allclose(a, b[0, -1], atol=1e-5) for a, b in zip(logps, first))
    assert seen[prompt].all() and seen.sum() == len(set(prompt))
    assert set(prompt) <= set(steps[-1][1].nonzero()[0].tolist())  # later steps see the prompt and the new text
    times = logic.stage_times(steps, 3, DecodeConfig(mode="dynamic", eps_b=0.0), table, "dense", 1)
    assert times["dynamic_propose"] > 0


# docs/benchmarks: tables rendered from the JSON results --------------------------------------
def test_benchmark_pages_show_exactly_what_their_json_renders():
    tables_script = load_script(SCRIPTS / "benchmark_tables.py")
    tables = tables_script.load_tables()
    pages = sorted(tables_script.DOCS.glob("*.md"))
    assert len(pages) >= 8 and len(tables) >= 20 and not (REPO / "docs" / "benchmarks.md").exists()
    placed = []
    for page in pages:
        text = page.read_text()
        assert text == tables_script.fill(text, tables), f"{page.name}: run python scripts/benchmark_tables.py"
        assert len(text.splitlines()) <= 250, page.name
        placed += tables_script.marked(text)
    assert sorted(placed) == sorted(tables)  # every table on exactly one page, no page marks a missing one


def test_a_changed_figure_makes_its_page_stale_and_every_caption_names_one_machine():
    tables_script = load_script(SCRIPTS / "benchmark_tables.py")
    tables = tables_script.load_tables()
    page = (tables_script.DOCS / "kernels.md").read_text()
    key = tables_script.marked(page)[0]
    changed = {**tables, key: {**tables[key], "rows": [["9.99"] * len(tables[key]["columns"])] + tables[key]["rows"][1:]}}
    assert tables_script.fill(page, changed) != page and "| 9.99 |" in tables_script.fill(page, changed)
    for table in tables.values():
        caption = tables_script.render(table).splitlines()[0]
        assert caption.startswith(f"*{table['machine']};") and table["command"] in caption
        assert table["source"] and table["machine"].strip()


def test_the_table_check_exits_non_zero_on_a_stale_page(tmp_path, monkeypatch):
    tables_script = load_script(SCRIPTS / "benchmark_tables.py")
    docs = tmp_path / "benchmarks"
    (docs / "results").mkdir(parents=True)
    table = {"id": "t", "machine": "m", "date": None, "command": "c", "source": "s", "columns": ["a"], "rows": [["1"]]}
    (docs / "results" / "x.json").write_text(json.dumps({"tables": [table]}))
    (docs / "p.md").write_text("# P\n\n<!-- table: t -->\nold\n<!-- /table -->\n")
    pick = {"what": "the thing", "table": "t", "row": "1", "tokens_per_forward": None, "speed": "a"}
    (docs / "summary.json").write_text(json.dumps({"rows": [pick]}))
    (tmp_path / "README.md").write_text("# R\n\n<!-- summary -->\nold\n<!-- /summary -->\n")
    monkeypatch.setattr(tables_script, "DOCS", docs)
    monkeypatch.setattr(tables_script, "RESULTS", docs / "results")
    monkeypatch.setattr(tables_script, "SUMMARY", docs / "summary.json")
    monkeypatch.setattr(tables_script, "README", tmp_path / "README.md")
    monkeypatch.setattr(tables_script.load_tables, "__defaults__", (docs / "results",))
    assert tables_script.main(["--check"]) == 1
    assert tables_script.main([]) == 0 and tables_script.main(["--check"]) == 0
    assert "| 1 |" in (docs / "p.md").read_text()
    readme = (tmp_path / "README.md").read_text()
    assert "| the thing | - | 1 | 1 |" in readme and "1. *m; undated; `c`.* Speed: a. ([p.md](docs/benchmarks/p.md))" in readme


def test_the_readme_results_are_the_summary_its_picks_render():
    tables_script = load_script(SCRIPTS / "benchmark_tables.py")
    tables, pages = tables_script.load_tables(), tables_script.table_pages()
    picks = json.loads(tables_script.SUMMARY.read_text())["rows"]
    readme = (REPO / "README.md").read_text()
    assert readme.count("<!-- summary -->") == 1 and len(picks) >= 5
    assert readme == tables_script.fill_summary(readme, tables, picks, pages), "run python scripts/benchmark_tables.py"
    for pick in picks:  # every figure shown is the picked cell of its table, whose machine and command are named
        table = tables[pick["table"]]
        assert tables_script.cell(table, pick["row"], pick["speed"]) in readme
        assert f"*{table['machine']}; " in readme and f"`{table['command']}`" in readme
    first = picks[0]
    source = tables[first["table"]]
    col = source["columns"].index(first["speed"])
    rows = [[*r[:col], "9.99", *r[col + 1:]] if r[0] == first["row"] else r for r in source["rows"]]
    changed = {**tables, first["table"]: {**source, "rows": rows}}
    assert "| 9.99 |" in tables_script.fill_summary(readme, changed, picks, pages)


def test_a_summary_pick_of_a_missing_row_or_column_fails_naming_it():
    tables_script = load_script(SCRIPTS / "benchmark_tables.py")
    tables, pages = tables_script.load_tables(), tables_script.table_pages()
    page = "x\n<!-- summary -->\n<!-- /summary -->\n"
    pick = {"what": "w", "table": "sweep-embedded", "row": "0.0", "tokens_per_forward": "tokens / forward", "speed": "wall-clock x"}
    assert "| w | 2.91 |" in tables_script.fill_summary(page, tables, [pick], pages)
    for bad, said in (({"row": "0.05"}, "no row '0.05'"), ({"speed": "nope"}, "no column 'nope'"),
                      ({"table": "gone"}, "table gone")):
        with pytest.raises(SystemExit, match=said):
            tables_script.fill_summary(page, tables, [{**pick, **bad}], pages)


def test_torch_quantised_matmuls_are_timed_on_the_weights_ours_read(tmp_path):
    """bench_quant_linear: torch's int4 matmul reads the same Q4_1 weight as our kernel (so the two
    agree to float32 rounding), every method of a shape is timed, and the record is written."""
    quant = load_script(SCRIPTS / "bench_quant_linear.py")
    out = tmp_path / "q.json"
    record = quant.main(["--shapes", "k_proj", "--rows", "1,3", "--reps", "1", "--out", str(out)])
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(record["results"]))
    for row in record["results"]["k_proj"].values():
        assert {"f_linear", "onednn", "torch_int4", "torch_int8", "torch_int4_bf16", "torch_int8_bf16", "ours_f32",
                "ours_q4_1", "ours_q8_0"} <= set(row)
        # float32 chains over 576 products of |w x| <= ~0.1: within 1e-4 of their own weight's float64;
        # bfloat16 activations and outputs (8 bits of mantissa) within 2% of outputs of magnitude ~1
        errors = {key: value for key, value in row.items() if key.startswith("err_")}
        assert all(value < (0.02 if key.endswith("_bf16") else 1e-4) for key, value in errors.items()), row
    gen = torch.Generator().manual_seed(0)
    weight, codes, d, m = quant.q4_1_weight(16, 64, gen)  # torch packs N in 16s
    int4 = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
    x = torch.eye(64)  # the product with the identity reads the weight back as torch decodes it
    got = torch._weight_int4pack_mm_for_cpu(x, int4, quant.GROUP, torch.stack([d.T, (m + 8 * d).T], -1).contiguous())
    torch.testing.assert_close(got.T, weight, rtol=0, atol=1e-6)


def test_with_heads_against_plain_generate_pairs_prompts_and_stops_on_a_differing_text(tmp_path, monkeypatch):
    """bench_with_heads at a tiny size on the embedded model: per method tokens/s, paired ratios
    and tokens per forward, the results table the pages render; a with_heads whose text differs
    from plain generate's makes it exit non-zero, its record kept."""
    from multitoken.embedded import DEFAULT_BASE

    script, tables = load_script(SCRIPTS / "bench_with_heads.py"), load_script(SCRIPTS / "benchmark_tables.py")
    argv = ["--base", str(DEFAULT_BASE), "--heads", "embedded:stories260K-heads", "--trees", "chain",
            "--num-prompts", "2", "--max-new-tokens", "6", "--reps", "1"]
    record = script.main([*argv, "--out", str(tmp_path / "w.json")])
    chain = record["methods"]["with_heads tree=chain"]
    assert record["methods"]["plain generate"]["ratio_geomean"] == 1.0 and chain["equal_to_plain"]
    assert chain["tokens"] == 12 and 1.0 <= chain["tokens_per_forward"] <= 4.0 and chain["ratio_geomean"] > 0
    assert set(record["first_call"]) == {"plain generate", "with_heads tree=chain"}
    assert "| with_heads tree=chain |" in tables.render({**record["table"], "file": "smollm2.json"})
    real = script.with_heads

    def off_by_one(heads, **kw):  # transformers' text with its last token changed
        method = real(heads, **kw)

        def wrong(*a, **k):
            out = method(*a, **k)
            out[:, -1] = (out[:, -1] + 1) % 512
            wrong.traces = method.traces
            return out
        return wrong

    monkeypatch.setattr(script, "with_heads", off_by_one)
    with pytest.raises(SystemExit, match="with_heads tree=chain differ from plain generate's greedy output"):
        script.main([*argv, "--out", str(tmp_path / "wrong.json")])
    assert json.loads((tmp_path / "wrong.json").read_text())["methods"]["with_heads tree=chain"]["equal_to_plain"] is False


def test_startup_runs_a_fresh_cli_process_and_times_its_phases_in_order(tmp_path):
    """bench_startup: one child of the real CLI on the embedded model, its stages time-stamped;
    imports end before it is ready, the first token after, the process outlasts them all; the
    child's cache is its own, linking the real models and kernels (built once, reused)."""
    from multitoken.embedded import cache_dir

    startup = load_script(SCRIPTS / "bench_startup.py")
    env = startup._cache(tmp_path / "child")
    assert env["MULTITOKEN_CACHE"] == str(tmp_path / "child")
    assert (tmp_path / "child" / "kernels").resolve() == (cache_dir() / "kernels").resolve()
    run = startup._run(["generate", "Once upon a time", "--json", "--max-new-tokens", "1", "--mode", "ar"], env)
    assert [text for _, text in run["stages"]][:2] == ["multitoken generate: starting", "loading embedded:stories260K"]
    assert 0 < run["imports_s"] < run["ready_s"] <= run["first_token_s"] < run["process_s"]
    assert 0 <= run["prepare_s"] < run["ready_s"]


def test_the_build_bench_pairs_old_and_new_rates_from_their_reports():
    """bench_build: each recipe's tokens per second come from its build report (distilled new
    tokens and training tokens over wall and CPU seconds), medians per recipe, new over old."""
    bench = load_script(SCRIPTS / "bench_build.py")

    def report(distill_s, train_cpu_s, top1):
        held = {"head2/top1": top1, "head3/top1": top1 / 2}
        return {"stages": {"distill": {"train": {"new_tokens_this_run": 1000, "seconds": distill_s, "cpu_seconds": distill_s / 2,
                                                 "engine": "multitoken", "dtype": "bfloat16"}},
                           "train": {"tokens_seen": 600, "steps": 3, "seconds": 3.0, "cpu_seconds": train_cpu_s,
                                     "compute_dtype": "bfloat16"}},
                "heldout": {"eagle3": held}}

    old = [bench.figures(report(10.0, 6.0, 0.5), [1.0], [2.0]), bench.figures(report(20.0, 6.0, 0.5), [], [])]
    new = [bench.figures(report(2.0, 2.0, 0.5), [], []), bench.figures(report(4.0, 2.0, 0.5), [], [])]
    assert old[0]["distill_tokens_per_s"] == 100.0 and old[0]["distill_cpu_tokens_per_s"] == 200.0
    assert old[0]["train_cpu_tokens_per_s"] == 100.0 and old[0]["load_before"] == [1.0]
    got = bench.summary({"old": old, "new": new})
    assert got["median"]["old"]["distill_tokens_per_s"] == 75.0 and got["new_over_old"]["distill_tokens_per_s"] == 5.0
    assert got["new_over_old"]["train_cpu_tokens_per_s"] == 3.0
    rows = bench.table({"old": old, "new": new}, ["eagle3"])["rows"]
    assert rows[1] == ["new", "multitoken, bfloat16", 750.0, 300.0, "bfloat16", "0.500 / 0.250"]
    old_report = report(1.0, 1.0, 0.5)
    del old_report["stages"]["distill"]["train"]["dtype"]  # a report from before distillation had a dtype
    assert bench.figures(old_report, [], [])["distill_dtype"] == "float32"
    args = bench.arguments(["--tokens", "64"])
    assert "--distill-batch" not in bench.build_args(args, REPO)  # new: build-heads' own default; old: its flags'
    assert "--distill-batch 64" in bench.OLD_FLAGS and "--distill-dtype float32" in bench.OLD_FLAGS


# gpu/split_heads, gpu/import_heads ------------------------------------------------------------
def test_heads_split_into_parts_under_the_limit_join_back_to_the_same_tensors(tmp_path):
    """A drafter over the device's 16 MiB per returned file comes back in parts; joining them
    gives every tensor back (floating ones in bfloat16, id maps as they were)."""
    import torch
    from safetensors.torch import load, load_file, save_file

    split = load_script(REPO / "scripts" / "gpu" / "split_heads.py")
    join = load_script(REPO / "scripts" / "gpu" / "import_heads.py")
    heads = tmp_path / "heads-eagle3"
    heads.mkdir()
    tensors = {"a.weight": torch.randn(300, 100), "b.weight": torch.randn(200, 100), "d2t": torch.arange(50),
               "t2d": torch.rand(70) > 0.5}
    save_file(tensors, str(heads / "heads.safetensors"))
    out = tmp_path / "out"
    out.mkdir()
    split.LIMIT = 70_000  # bytes: a.weight alone (60,000 in bfloat16) fills a part
    assert split.main(str(out), str(heads)) == 0
    parts = sorted(out.glob("heads-eagle3.*.safetensors"))
    assert len(parts) == 2 and all(sum(t.numel() * t.element_size() for t in load_file(str(p)).values()) <= 70_000
                                   for p in parts)
    blob, dtypes = join.joined(parts)
    back = load(blob)
    assert set(back) == set(tensors) and dtypes["d2t"] == "int64" and dtypes["t2d"] == "bool" and dtypes["a.weight"] == "bfloat16"
    for name, t in tensors.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert back[name].dtype == want.dtype and torch.equal(back[name], want)
    with pytest.raises(SystemExit, match="over the"):
        split.split({"big": torch.zeros(100, dtype=torch.uint8)}, limit=99)


def test_heldout_heads_scores_heads_dirs_side_by_side(tmp_path):
    """The measure shipped heads are chosen by runs end to end (on the embedded base)."""
    out = tmp_path / "heldout.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "heldout_heads.py"), "--base", "embedded:stories260K", "--heads",
                           "embedded:stories260K-heads", "embedded:stories260K-heads", "--prompts", "4", "--new-tokens", "8",
                           "--batch", "2", "--threads", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["heldout"]
    (first,) = {json.dumps(r, sort_keys=True) for r in rows.values()}  # one dir named twice: one score
    assert json.loads(first)["positions"] > 0 and 0.0 <= json.loads(first)["head2/top1"] <= 1.0
