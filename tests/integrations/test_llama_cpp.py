"""llama.cpp's tools beside our engine (``pipeline/integrations/llama_cpp.py``): their timing lines
and generated text read back, the build's cache key and commands, the refusal where the source is
absent; and (interop) an eagle3 drafter exported here, converted by llama.cpp's converter and run
by llama.cpp's speculative tool on a tiny Llama, its text equal to llama.cpp's own greedy text."""

from __future__ import annotations

import os
import re
import tarfile
from pathlib import Path

import pytest

from multitoken.base.errors import UsageError
from multitoken.pipeline.cli import main
from multitoken.pipeline.integrations import llama_cpp

# What the tools print (the formats of the perf prints and lookup.cpp / speculative-simple.cpp's
# closing lines, with and without the log's time prefix), around the figures the comparison reads
COMPLETION_LOG = """llama_perf_sampler_print:    sampling time =       3.10 ms /   133 runs   (    0.02 ms per token, 42903.23 tokens per second)
llama_perf_context_print:        load time =     212.40 ms
llama_perf_context_print: prompt eval time =      61.02 ms /     5 tokens (   12.20 ms per token,    81.94 tokens per second)
0.02.083.470 I common_perf_print:        eval time =    1811.37 ms /   127 runs   (   14.26 ms per token,    70.11 tokens per second)
llama_perf_context_print:       total time =    1903.12 ms /   132 tokens
"""
LOOKUP_LOG = """0.01.872.259 I encoded    5 tokens in    0.061 seconds, speed:   81.967 t/s
0.01.872.259 I decoded  128 tokens in    1.775 seconds, speed:   72.113 t/s

n_draft      = 8
n_predict    = 128
n_drafted    = 96
t_draft_flat = 0.10 ms
n_accept     = 40
accept       = 41.667%
"""
SPECULATIVE_LOG = """encoded   16 tokens in    0.120 seconds, speed:  133.333 t/s
decoded   17 tokens in    0.250 seconds, speed:   68.000 t/s

n_draft   = 2
n_predict = 17
n_drafted = 24
n_accept  = 5
accept    = 20.833%
"""


def test_the_completion_tools_eval_line_is_read_not_the_prompts():
    got = llama_cpp.parse_timings("plain", COMPLETION_LOG)
    assert got["tokens"] == 127 and got["seconds"] == pytest.approx(1.81137)
    assert got["tokens_per_s"] == pytest.approx(127 / 1.81137)  # 70.11, not the prompt's 81.94
    assert "drafted" not in got


@pytest.mark.parametrize("method, log, want", [("lookup", LOOKUP_LOG, (128, 1.775, 96, 40)),
                                               ("eagle3", SPECULATIVE_LOG, (17, 0.25, 24, 5))])
def test_the_speculative_tools_decoded_line_and_counts_are_read(method, log, want):
    got = llama_cpp.parse_timings(method, log)
    assert (got["tokens"], got["seconds"], got["drafted"], got["accepted"]) == want
    assert got["tokens_per_s"] == pytest.approx(want[0] / want[1])


@pytest.mark.parametrize("method, log", [("plain", LOOKUP_LOG), ("lookup", COMPLETION_LOG)])
def test_output_without_the_timing_line_is_an_error_naming_it(method, log):
    with pytest.raises(ValueError, match="eval time|decoded N tokens"):
        llama_cpp.parse_timings(method, log)


def test_the_continuation_drops_echoed_prompt_colours_and_end_mark():
    prompt = "The cat sat"
    assert llama_cpp.continuation("plain", " on the mat. [end of text]\n", prompt) == " on the mat."
    coloured = f"\n\n{prompt}\x1b[36m on\x1b[37m the mat.\n\n"
    assert llama_cpp.continuation("eagle3", coloured, prompt) == " on the mat."
    assert llama_cpp.continuation("lookup", f"<s> {prompt} on the mat.\n\n\n", prompt) == " on the mat."
    with pytest.raises(ValueError, match="does not echo the prompt"):
        llama_cpp.continuation("lookup", "something else", prompt)


def test_a_speculative_text_must_begin_with_all_of_the_greedy_text():
    assert llama_cpp.same_text(" on the mat.", " on the mat.") and llama_cpp.same_text(" on the mat. It", " on the mat.")
    assert not llama_cpp.same_text(" on the", " on the mat.")  # stopping short is a difference
    assert not llama_cpp.same_text(" on a mat.", " on the mat.")
    assert llama_cpp.same_text(" caf\u00e9 au", " caf\ufffd")  # a character the greedy run's last token cut


def test_each_method_runs_its_tool_greedy_with_the_threads_and_drafts_asked():
    argv = llama_cpp.tool_argv("/b", "plain", "m.gguf", "Hi", 16, 2)
    assert Path(argv[0]).name == "llama-completion" and "-no-cnv" in argv
    assert argv[argv.index("--temp") + 1] == "0" and argv[argv.index("-t") + 1] == "2" and argv[argv.index("-n") + 1] == "16"
    lookup = llama_cpp.tool_argv("/b", "lookup", "m.gguf", "Hi", 16, 1, drafts=8)
    assert Path(lookup[0]).name == "llama-lookup" and lookup[lookup.index("--spec-draft-n-max") + 1] == "8"
    spec = llama_cpp.tool_argv("/b", "eagle3", "m.gguf", "Hi", 16, 1, drafts=3, drafter="d.gguf")
    assert Path(spec[0]).name == "llama-speculative-simple" and spec[spec.index("--spec-type") + 1] == "draft-eagle3"
    assert spec[spec.index("-md") + 1] == "d.gguf" and spec[spec.index("--spec-draft-n-max") + 1] == "3"
    with pytest.raises(ValueError, match="needs a drafter"):
        llama_cpp.tool_argv("/b", "eagle3", "m.gguf", "Hi", 16, 1)


def _fake_source(root: Path, cmake: str = "project(x)") -> Path:
    tree = root / llama_cpp.SDIST / "vendor" / "llama.cpp"
    (tree / "ggml").mkdir(parents=True)
    (tree / "convert_hf_to_gguf.py").write_text("")
    (tree / "CMakeLists.txt").write_text(cmake)
    (tree / "ggml" / "CMakeLists.txt").write_text("")
    return tree


def test_the_build_key_follows_the_source_and_the_cpu_flags(tmp_path):
    a, b = _fake_source(tmp_path / "a"), _fake_source(tmp_path / "b", cmake="project(y)")
    flags = "flags\t\t: fpu sse2 avx2"
    key = llama_cpp.build_key(a, flags)
    assert re.fullmatch(r"[0-9a-f]{12}-[0-9a-f]{8}", key)
    assert llama_cpp.build_key(a, "flags : avx2 sse2 fpu") == key  # the set of flags, not their order
    assert llama_cpp.build_key(a, flags + " avx512f").split("-")[0] == key.split("-")[0] != llama_cpp.build_key(b, flags).split("-")[0]
    assert llama_cpp.build_key(a, flags + " avx512f").split("-")[1] != key.split("-")[1]
    archive = tmp_path / "a" / f"{llama_cpp.SDIST}.tar.gz"
    archive.write_bytes(b"sdist")
    assert llama_cpp.build_key(a, flags) != key  # the sdist's bytes, once it is there


def test_the_build_makes_only_the_tools_natively_at_low_priority(tmp_path):
    configure, compile_ = llama_cpp.cmake_commands(tmp_path / "src", tmp_path / "b", jobs=2, nice=19)
    assert configure[:3] == ["nice", "-n", "19"] and "-DGGML_NATIVE=ON" in configure and "-DLLAMA_BUILD_TESTS=OFF" in configure
    assert "-DLLAMA_OPENSSL=OFF" in configure and "-DLLAMA_BUILD_SERVER=OFF" in configure
    assert compile_[compile_.index("-j") + 1] == "2"
    assert compile_[compile_.index("--target") + 1:] == ["llama-completion", "llama-lookup", "llama-speculative-simple"]
    assert not any("amx" in arg for arg in configure)  # the native build keeps what the CPU has
    no_amx, _ = llama_cpp.cmake_commands(tmp_path / "src", tmp_path / "b", jobs=2, nice=19, amx=False)
    assert no_amx[:len(configure)] == configure
    assert no_amx[len(configure):] == [f"-DCMAKE_{lang}_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" for lang in ("C", "CXX")]
    avx2, _ = llama_cpp.cmake_commands(tmp_path / "src", tmp_path / "b", jobs=2, nice=19, isa="avx2")
    # ggml's default list without -march=native: AVX2, FMA, F16C, BMI2 and no AVX512, whatever the CPU has
    assert "-DGGML_NATIVE=OFF" in avx2 and "-DGGML_NATIVE=ON" not in avx2
    assert [a for a in avx2 if "NATIVE" not in a] == [a for a in configure if "NATIVE" not in a]


FAKE_CMAKE = """#!/bin/sh
# configure: -S SRC -B DIR ...; build: --build DIR ... --target T...: an empty file DIR/bin/T per target
echo "$@" >> "$CMAKE_CALLS"
if [ "$1" = "--build" ]; then
  dir="$2"; mkdir -p "$dir/bin"
  seen=0; for a in "$@"; do
    if [ $seen = 1 ]; then : > "$dir/bin/$a"; fi
    if [ "$a" = "--target" ]; then seen=1; fi
  done
fi
exit 0
"""


def test_a_build_is_made_once_per_source_and_cpu_then_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("MULTITOKEN_CACHE", str(tmp_path / "cache"))
    _fake_source(llama_cpp.cache_root())
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "cmake").write_text(FAKE_CMAKE)
    (fake / "cmake").chmod(0o755)
    calls = tmp_path / "calls"
    monkeypatch.setenv("CMAKE_CALLS", str(calls))
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    first = llama_cpp.build(jobs=2)
    assert not first["reused"] and first["build_s"] >= 0 and len(first["commands"]) == 2
    assert len(calls.read_text().splitlines()) == 2  # configure, then the tools' targets
    folder = Path(first["bin"]).parent
    assert folder.name == f"tools-{llama_cpp.build_key(llama_cpp.source())}"
    assert sorted(p.name for p in Path(first["bin"]).iterdir()) == sorted(llama_cpp.TOOLS.values())
    again = llama_cpp.build(jobs=2)
    assert again["reused"] and again["bin"] == first["bin"] and again["build_s"] == first["build_s"]
    assert len(calls.read_text().splitlines()) == 2  # nothing rebuilt
    plain = llama_cpp.build(jobs=2, amx=False)  # a build of its own, beside the native one
    assert not plain["reused"] and plain["amx"] is False and Path(plain["bin"]).parent.name == folder.name + "-noamx"
    assert "-mno-amx-tile" in calls.read_text().splitlines()[2] and llama_cpp.built(amx=False)["reused"]
    avx2 = llama_cpp.build(jobs=2, isa="avx2")  # the AVX2 level: a third build of its own
    assert not avx2["reused"] and avx2["isa"] == "avx2" and Path(avx2["bin"]).parent.name == folder.name + "-avx2"
    assert "-DGGML_NATIVE=OFF" in calls.read_text().splitlines()[4] and llama_cpp.built(isa="avx2")["reused"]
    assert llama_cpp.built()["bin"] == first["bin"]  # the native build is left as it was
    with pytest.raises(UsageError, match="unknown instruction level 'avx-2'"):
        llama_cpp.build(jobs=2, isa="avx-2")


FAKE_TOOL = """#!/bin/sh
# {faults}: dies of SIGILL as ggml's AMX kernels do where they fault; else a greedy run's closing line
if [ "{faults}" = "1" ]; then kill -ILL $$; fi
echo "common_perf_print:        eval time =      10.00 ms /     1 runs" >&2
"""


@pytest.mark.parametrize("flags, faults", [("fpu amx_tile avx512f", True), ("fpu amx_tile avx512f", False),
                                           ("fpu avx512f", True)])
def test_a_build_whose_amx_kernels_fault_is_made_again_without_them(tmp_path, monkeypatch, flags, faults):
    builds = []

    def build(jobs=2, log=None, amx=True, isa="native"):  # an AMX build whose tool dies of SIGILL where ``faults``
        folder = tmp_path / f"tools{'' if amx else '-noamx'}" / "bin"
        folder.mkdir(parents=True, exist_ok=True)
        tool = folder / llama_cpp.TOOLS["completion"]
        tool.write_text(FAKE_TOOL.format(faults=int(faults and amx)))
        tool.chmod(0o755)
        builds.append(amx)
        return {"bin": str(folder), "amx": amx}

    monkeypatch.setattr(llama_cpp, "build", build)
    monkeypatch.setattr(llama_cpp.cpu_features, "cpu_flags", lambda: f"flags : {flags}")
    if faults and "amx_tile" not in flags:  # not AMX's fault: said, not worked around
        with pytest.raises(llama_cpp.ToolFailed, match="exited -4") as err:
            llama_cpp.usable_build(tmp_path / "model.gguf")
        assert err.value.returncode == -4 and builds == [True]
        return
    tools = llama_cpp.usable_build(tmp_path / "model.gguf")
    assert builds == ([True, False] if faults else [True])
    assert tools["amx"] is not faults and ("amx_fault" in tools) is faults
    if faults:
        assert tools["amx_fault"] == "llama-completion exited -4 (SIGILL)"


def test_the_source_is_unpacked_once_from_the_sdist_and_its_absence_named(tmp_path, monkeypatch):
    monkeypatch.setenv("MULTITOKEN_CACHE", str(tmp_path / "cache"))
    root = llama_cpp.cache_root()
    assert root == tmp_path / "cache" / "llama.cpp" and llama_cpp.source() is None
    with pytest.raises(UsageError, match="make llama-cpp-source") as err:
        llama_cpp.build()
    assert str(root) in str(err.value)
    _fake_source(tmp_path / "pack")
    root.mkdir(parents=True)
    with tarfile.open(root / f"{llama_cpp.SDIST}.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "pack" / llama_cpp.SDIST, arcname=llama_cpp.SDIST)
    tree = llama_cpp.source()
    assert tree == root / llama_cpp.SDIST / "vendor" / "llama.cpp" and (tree / "convert_hf_to_gguf.py").is_file()
    assert llama_cpp.built() is None  # unpacked, never built


# Interop: llama.cpp runs our drafter -----------------------------------------------------------
BUILD_ENV = "MULTITOKEN_LLAMA_CPP_BUILD"


def _tools() -> dict:
    """The cached build, or one made now where MULTITOKEN_LLAMA_CPP_BUILD=1; else skip, naming
    the missing tools (a build takes longer than CI's step on a 2-core machine)."""
    if llama_cpp.source() is None:
        pytest.skip(str(llama_cpp.missing_source()))
    done = llama_cpp.built()
    if done is not None:
        return done
    if os.environ.get(BUILD_ENV) != "1":
        pytest.skip(f"llama.cpp's prebuilt tools ({', '.join(llama_cpp.TOOLS.values())}) are not in "
                    f"{llama_cpp.cache_root()}/tools-{llama_cpp.build_key(llama_cpp.source())}/bin: set {BUILD_ENV}=1 "
                    "to build them once (several minutes), or run `make bench-llama-cpp`")
    return llama_cpp.build()


@pytest.mark.interop
def test_llama_cpp_runs_our_exported_drafter_losslessly(tiny_llama_dir, tmp_path):
    tools = _tools()
    tree = Path(tools["source"])
    heads, export = tmp_path / "heads", tmp_path / "export"
    assert main(["attach", "--base", str(tiny_llama_dir), "--head", "eagle3", "--n", "3", "--out", str(heads)]) == 0
    assert main(["export", "--format", "eagle3", "--heads", str(heads), "--out", str(export)]) == 0
    target = llama_cpp.convert(tree, tiny_llama_dir, tmp_path / "target.gguf")
    drafter = llama_cpp.convert(tree, export, tmp_path / "drafter.gguf", target=tiny_llama_dir)
    prompt = "Once upon a time"
    runs = {m: llama_cpp.run_tool(llama_cpp.tool_argv(tools["bin"], m, target, prompt, 12, 1, drafts=2, drafter=drafter), m, prompt)
            for m in ("plain", "eagle3")}
    assert runs["eagle3"]["drafted"] > 0  # llama.cpp loaded the drafter and drafted with it
    assert runs["plain"]["text"].strip() and llama_cpp.same_text(runs["eagle3"]["text"], runs["plain"]["text"])
