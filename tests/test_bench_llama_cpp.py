"""scripts/bench_llama_cpp.py's own parts: our speed counted as llama.cpp counts its own, ratios
paired per prompt, texts checked against each engine's plain greedy text, the docs table, and
``--smoke``'s size. (Running llama.cpp's tools is tests/integrations/test_llama_cpp.py's.)"""

from __future__ import annotations

import pytest

from .test_scripts import SCRIPTS, load_script


@pytest.fixture(scope="module")
def script():
    return load_script(SCRIPTS / "bench_llama_cpp.py")


def _run(tps: float, text: str, tpf: float | None = None) -> dict:
    run = {"tokens": 10, "seconds": 10 / tps, "tokens_per_s": tps, "text": text}
    return {**run, "tokens_per_forward": tpf} if tpf else run


def test_our_speed_leaves_out_the_prompts_pass_and_its_token(script):
    trace = {"new_tokens": 17, "wall_s": 1.3, "prefill_s": 0.3, "forward_passes": 9}
    assert script.decode_rate(trace) == (16, pytest.approx(1.0))


def test_ratios_pair_each_prompt_with_llama_cpp_plain_on_that_prompt(script):
    runs = {"llama.cpp:plain": [_run(50, "a"), _run(100, "b"), _run(80, "c")],
            "llama.cpp:lookup": [_run(100, "a"), _run(100, "b and"), _run(40, "c")],  # past -n: b's text and more
            "multitoken:ar": [_run(25, "a"), _run(50, "b'"), _run(80, "c")],
            "multitoken:eagle3": [_run(50, "a", 2.0), _run(150, "b", 3.0), _run(40, "c", 1.5)]}
    got = script.paired(runs, "llama.cpp:plain")
    assert got["llama.cpp:plain"]["ratios"] == [1.0, 1.0, 1.0]
    assert got["llama.cpp:lookup"]["ratios"] == [2.0, 1.0, 0.5] and got["llama.cpp:lookup"]["median_ratio"] == 1.0
    # paired per prompt: the median of the ratios, not the ratio of the medians (80 / 80 = 1.0)
    assert got["multitoken:eagle3"]["ratios"] == [1.0, 1.5, 0.5] and got["multitoken:eagle3"]["median_ratio"] == 1.0
    assert got["multitoken:ar"]["median_tokens_per_s"] == 50 and got["multitoken:ar"]["median_ratio"] == 0.5
    # texts against their own engine's plain run: ours against ar, llama.cpp's against plain
    assert got["llama.cpp:lookup"]["same_as_plain"] == [True, True, True]
    assert got["llama.cpp:plain"]["same_as_plain"] is None and got["multitoken:ar"]["same_as_plain"] is None  # the references
    assert got["multitoken:eagle3"]["same_as_plain"] == [True, False, True]
    short = script.paired({"llama.cpp:plain": [_run(50, "a b")], "llama.cpp:lookup": [_run(50, "a")]}, "llama.cpp:plain")
    assert short["llama.cpp:lookup"]["same_as_plain"] == [False]  # stopping short of the greedy text is a difference
    assert got["multitoken:eagle3"]["median_tokens_per_forward"] == 2.0
    assert "median_tokens_per_forward" not in got["llama.cpp:lookup"]


def test_the_table_has_a_row_per_method_and_a_column_pair_per_thread_count(script):
    runs = {"llama.cpp:plain": [_run(50, "a")], "multitoken:ar": [_run(25, "a", 1.0)], "multitoken:lookup": [_run(40, "x", 2.5)]}
    two = {"llama.cpp:plain": [_run(80, "a")], "multitoken:ar": [_run(40, "a", 1.0)], "multitoken:lookup": [_run(120, "a", 2.5)]}
    results = {1: script.paired(runs, "llama.cpp:plain"), 2: script.paired(two, "llama.cpp:plain")}
    record = {"machine": {"cores": 2}, "command": "python scripts/bench_llama_cpp.py",
              "settings": {"max_new_tokens": 128, "prompts": 1}}
    t = script.table(results, [1, 2], record)
    assert t["columns"] == ["method", "tokens / forward", "1 thread tok/s", "x llama.cpp", "2 threads tok/s", "x llama.cpp",
                            "2 threads: x 1", "text = plain greedy"]
    assert t["rows"] == [["llama.cpp:plain", "", "50.0", "1.00", "80.0", "1.00", "1.60", ""],
                         ["multitoken:ar", "1.00", "25.0", "0.50", "40.0", "0.50", "1.60", ""],
                         ["multitoken:lookup", "2.50", "40.0", "0.80", "120.0", "1.50", "3.00", "1 of 2"]]
    assert all(key in t for key in ("id", "machine", "date", "command", "source", "note"))  # what benchmark_tables.py requires
    assert t["machine"].startswith("2-core ") and "128 new tokens" in t["note"]


def test_what_a_second_thread_gives_is_paired_per_prompt(script):
    one = script.paired({"llama.cpp:plain": [_run(50, "a"), _run(100, "b"), _run(10, "c")]}, "llama.cpp:plain")
    two = script.paired({"llama.cpp:plain": [_run(60, "a"), _run(300, "b"), _run(30, "c")]}, "llama.cpp:plain")
    # per prompt 1.2, 3.0, 3.0: the median of those, not the ratio of the medians (60 / 50)
    assert script.scaling(one["llama.cpp:plain"], two["llama.cpp:plain"]) == pytest.approx(3.0)


def test_smoke_is_one_prompt_sixteen_tokens_one_thread(script):
    args = script.arguments(["--smoke"])
    assert (args.num_prompts, args.max_new_tokens, args.threads) == (1, 16, [1])
    full = script.arguments([])
    assert (full.num_prompts, full.max_new_tokens, full.threads, full.lookup) == (6, 128, [1, 2], 8)


def test_the_int8_rows_are_checked_against_their_own_ar(script):
    """``-q8`` methods (--cpu-linear rows-q8) are not transformers' text: each is checked against
    ``multitoken:ar-q8``, the exact ones against ``multitoken:ar``."""
    runs = {"llama.cpp:plain": [_run(50, "a"), _run(50, "b")], "multitoken:ar": [_run(50, "a"), _run(50, "b")],
            "multitoken:lookup": [_run(60, "a", 2.0), _run(60, "b", 2.0)],
            "multitoken:ar-q8": [_run(70, "a"), _run(70, "c")], "multitoken:lookup-q8": [_run(90, "a", 2.0), _run(90, "c", 2.0)]}
    got = script.paired(runs, "llama.cpp:plain")
    assert got["multitoken:lookup-q8"]["same_as_plain"] == [True, True] and got["multitoken:ar-q8"]["same_as_plain"] is None
    assert got["multitoken:lookup"]["same_as_plain"] == [True, True]
    assert script.OURS["lookup-q8"][-2:] == ["--cpu-linear", "rows-q8"] and script.plain_of("multitoken:eagle3-q8") == "multitoken:ar-q8"


def test_the_avx2_level_runs_both_engines_on_an_avx2_cpus_code(script, monkeypatch):
    monkeypatch.delenv("MULTITOKEN_CPU_FEATURES", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    native = script.ours_env("native")
    assert "MULTITOKEN_CPU_FEATURES" not in native and "ATEN_CPU_CAPABILITY" not in native
    avx2 = script.ours_env("avx2")  # our kernels' AVX2 build and torch's AVX2 ops
    assert avx2["MULTITOKEN_CPU_FEATURES"] == "avx2" and avx2["ATEN_CPU_CAPABILITY"] == "avx2"
    assert script.arguments(["--isa", "avx2"]).isa == "avx2" and script.arguments([]).isa == "native"
    with pytest.raises(SystemExit):
        script.arguments(["--isa", "avx512"])  # llama.cpp has no build for it here
    results = {1: script.paired({"llama.cpp:plain": [_run(50, "a")]}, "llama.cpp:plain")}
    record = {"machine": {"cores": 2}, "command": "c", "settings": {"max_new_tokens": 8, "prompts": 1, "isa": "avx2"}}
    assert "AVX2 level" in script.table(results, [1], record)["note"]
    record["settings"]["isa"] = "native"
    assert "AVX2" not in script.table(results, [1], record)["note"]
