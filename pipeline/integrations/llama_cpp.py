"""llama.cpp's own tools beside our engine: the source the registry's ``llama-cpp-python`` sdist
vendors, built once per source and CPU into the cache, run on a prompt, and their output read.

The source is ``$MULTITOKEN_CACHE/llama.cpp/<sdist>`` (else ``.cache/multitoken`` in the
checkout; ``make llama-cpp-source`` downloads the sdist there, unpacked once here). ``build``
compiles only the tools a comparison runs (the plain completion tool, ``llama-lookup``'s n-gram
drafts, ``llama-speculative-simple`` for a drafter GGUF such as ``--spec-type draft-eagle3``)
with CMake (``-DGGML_NATIVE=ON``: the instructions of the CPU it runs on; no network, tests or
server), into ``tools-<source hash>-<CPU flags hash>/``: ``bin/`` and ``build.json`` (the
commands, how long they took). A finished build is reused; a CPU with other flags gets its own.
``amx=False`` builds without ggml's AMX kernels (``tools-...-noamx/``), for a machine whose CPU
names AMX but where those kernels stop on an illegal instruction (``usable_build``).
``isa="avx2"`` builds ggml's AVX2 level instead of the native one (``-DGGML_NATIVE=OFF``: AVX,
AVX2, FMA, F16C and BMI2, no AVX512; ``tools-...-avx2/``), so that a bigger CPU runs what an AVX2
one would, beside our kernels forced to the same level (``MULTITOKEN_CPU_FEATURES=avx2``).

The tools print their decoding speed themselves (start-up and the prompt left out):
``parse_timings`` reads it, ``continuation`` the text generated after the echoed prompt.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from multitoken.base.atomic import atomic_dir
from multitoken.base.errors import UsageError
from multitoken.kernels import cpu_features

REPO = Path(__file__).resolve().parents[2]  # the checkout whose .cache/ is the default cache
SDIST = "llama_cpp_python-0.3.36"  # the registry's llama-cpp-python sdist, which vendors llama.cpp
PIP_DOWNLOAD = "pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36"
# What each comparison runs: our name -> the CMake target (= the binary's name)
TOOLS = {"completion": "llama-completion", "lookup": "llama-lookup", "speculative": "llama-speculative-simple"}
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",  # static: bin/ stands alone
                 "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
                 "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_EXAMPLES=ON")
# Compiler flags that keep ggml's AMX kernels out of a native build (GCC and Clang: an explicit
# -mno-<isa> wins over what -march=native turns on, whatever their order)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# The instruction level a build targets: this CPU's, or ggml's default list without it (AVX2, FMA,
# F16C, BMI2 on; AVX512 and AMX off)
ISAS = {"native": "-DGGML_NATIVE=ON", "avx2": "-DGGML_NATIVE=OFF"}
RECORD = "build.json"
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # llama-speculative-simple colours accepted drafts


def cache_root() -> Path:
    """``$MULTITOKEN_CACHE/llama.cpp``, else ``.cache/multitoken/llama.cpp`` in the checkout (the
    Makefile's ``llama-cpp-source`` folder)."""
    return Path(os.environ.get("MULTITOKEN_CACHE") or REPO / ".cache" / "multitoken") / "llama.cpp"


def source(root: Path | None = None) -> Path | None:
    """The vendored llama.cpp tree (``<root>/<sdist>/vendor/llama.cpp``), the sdist's ``.tar.gz``
    unpacked there once where only it is present; None where neither is."""
    root = root or cache_root()
    tree = root / SDIST / "vendor" / "llama.cpp"
    archive = root / f"{SDIST}.tar.gz"
    if not tree.is_dir() and archive.is_file():
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
    return tree if (tree / "convert_hf_to_gguf.py").is_file() else None


def missing_source(root: Path | None = None) -> UsageError:
    """The one-line refusal where the source is absent, naming the command that fetches it."""
    root = root or cache_root()
    return UsageError(f"llama.cpp's source ({SDIST}) is not in {root}",
                      f"run `make llama-cpp-source` (or {PIP_DOWNLOAD} -d {root}), or point MULTITOKEN_CACHE at a cache that holds it")


def build_key(tree: Path, flags: str | None = None) -> str:
    """``<source>-<cpu>``: a hash of the vendored tree's identity (its sdist archive where present,
    else its ggml version file and CMake lists) and one of the CPU's flags (``-DGGML_NATIVE``
    compiles for exactly them)."""
    archive = tree.parents[2] / f"{SDIST}.tar.gz"
    parts = [archive] if archive.is_file() else [tree / "CMakeLists.txt", tree / "ggml" / "CMakeLists.txt"]
    src = hashlib.sha256()
    for path in parts:
        src.update(path.read_bytes())
    flags = cpu_features.cpu_flags() if flags is None else flags
    cpu = hashlib.sha256(" ".join(sorted(flags.split(":", 1)[-1].split())).encode()).hexdigest()
    return f"{src.hexdigest()[:12]}-{cpu[:8]}"


def cmake_commands(tree: Path, build_dir: Path, jobs: int, nice: int, amx: bool = True, isa: str = "native") -> list[list[str]]:
    """Configure, then build only ``TOOLS``' targets, ``jobs`` at a time at ``nice`` priority;
    without ggml's AMX kernels where ``amx`` is False; for ``isa``'s instructions (``ISAS``)."""
    low = ["nice", "-n", str(nice)] if nice and shutil.which("nice") else []
    no_amx = [] if amx else [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    return [[*low, "cmake", "-S", str(tree), "-B", str(build_dir), *CMAKE_OPTIONS, ISAS[isa], *no_amx],
            [*low, "cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs),
             "--target", *TOOLS.values()]]


def _folder(root: Path, tree: Path, amx: bool, isa: str = "native") -> Path:
    return root / f"tools-{build_key(tree)}{'' if isa == 'native' else '-' + isa}{'' if amx else '-noamx'}"


def built(root: Path | None = None, tree: Path | None = None, amx: bool = True, isa: str = "native") -> dict | None:
    """The cached build's record (with ``bin``) for this source, CPU and level, or None where there is none."""
    tree = tree or source(root)
    if tree is None:
        return None
    folder = _folder(root or cache_root(), tree, amx, isa)
    record = folder / RECORD
    if not record.is_file() or not all((folder / "bin" / name).is_file() for name in TOOLS.values()):
        return None
    return {**json.loads(record.read_text()), "bin": str(folder / "bin"), "reused": True}


def build(root: Path | None = None, jobs: int = 2, nice: int = 19, log=lambda msg: None, amx: bool = True,
          isa: str = "native") -> dict:
    """llama.cpp's tools for this source and CPU (without ggml's AMX kernels where ``amx`` is
    False; at ``isa``'s level): the cached build, else one made now (its CMake tree beside
    ``bin/``; the record says how long configuring and building took)."""
    if isa not in ISAS:
        raise UsageError(f"unknown instruction level {isa!r} for llama.cpp", f"use one of {', '.join(ISAS)}")
    root = root or cache_root()
    tree = source(root)
    if tree is None:
        raise missing_source(root)
    done = built(root, tree, amx, isa)
    if done is not None:
        return done
    if shutil.which("cmake") is None:
        raise UsageError("building llama.cpp needs cmake, which is not on PATH", "install cmake (and a C++ compiler)")
    folder = _folder(root, tree, amx, isa)
    work = folder.with_name(folder.name + ".cmake")  # the CMake tree: kept, so an interrupted build goes on
    record = {"source": str(tree), "key": folder.name.removeprefix("tools-"), "jobs": jobs, "nice": nice, "amx": amx, "isa": isa,
              "cpu_flags": sorted(cpu_features.cpu_flags().split(":", 1)[-1].split()), "commands": [], "seconds": []}
    for argv in cmake_commands(tree, work, jobs, nice, amx, isa):
        log("llama.cpp: " + " ".join(argv))
        start = time.perf_counter()
        run = subprocess.run(argv, capture_output=True, text=True)
        record["commands"].append(" ".join(argv))
        record["seconds"].append(round(time.perf_counter() - start, 1))
        if run.returncode != 0:
            raise RuntimeError(f"llama.cpp's build failed ({' '.join(argv[:4])} ...): {(run.stderr or run.stdout)[-1500:]}")
    record["build_s"] = round(sum(record["seconds"]), 1)
    with atomic_dir(folder) as staging:
        (staging / "bin").mkdir()
        for name in TOOLS.values():
            shutil.copy2(work / "bin" / name, staging / "bin" / name)
        (staging / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return {**record, "bin": str(folder / "bin"), "reused": False}


# Running the tools -----------------------------------------------------------------------------
class ToolFailed(RuntimeError):
    """A tool exited non-zero (``returncode``: negative where a signal ended it)."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def usable_build(model: str | Path, jobs: int = 2, log=lambda msg: None, isa: str = "native") -> dict:
    """``build``'s tools (at ``isa``'s level) once they have run ``model`` for a few tokens. Where
    the CPU names AMX but ggml's AMX kernels stop on an illegal instruction (seen on a virtual
    machine whose plain AMX test program runs), the tools built without them (``amx=False``), the
    fault recorded under ``amx_fault``: a comparison takes the fastest path that runs, not none."""
    def probe(tools: dict) -> dict:
        run_tool(tool_argv(tools["bin"], "plain", model, "Hello", 2, 1), "plain", "Hello")
        return tools

    if isa != "native":  # below the native level: no AMX kernels to fall back from
        return probe(build(jobs=jobs, log=log, isa=isa))
    try:
        return probe(build(jobs=jobs, log=log))
    except ToolFailed as err:
        if err.returncode != -signal.SIGILL or "amx_tile" not in cpu_features.cpu_flags().split():
            raise
        fault = f"{TOOLS['completion']} exited {err.returncode} (SIGILL)"
    log(f"llama.cpp: its AMX kernels stopped on an illegal instruction ({fault}); building it without them")
    return {**probe(build(jobs=jobs, log=log, amx=False)), "amx_fault": fault}


def tool_argv(bin_dir: str | Path, method: str, model: str | Path, prompt: str, new_tokens: int, threads: int,
              drafts: int = 8, drafter: str | Path | None = None) -> list[str]:
    """One greedy run of ``method`` (``plain``, ``lookup`` or ``eagle3``) on ``prompt``: ``new_tokens``
    at most, ``threads`` threads (the drafter's too), ``drafts`` tokens drafted per step."""
    common = ["-m", str(model), "-p", prompt, "-n", str(new_tokens), "-t", str(threads), "--temp", "0",
              "--seed", "0", "-c", "2048"]
    if method == "plain":
        return [str(Path(bin_dir) / TOOLS["completion"]), *common, "-no-cnv", "--no-display-prompt"]
    if method == "lookup":
        return [str(Path(bin_dir) / TOOLS["lookup"]), *common, "--spec-draft-n-max", str(drafts)]
    if method == "eagle3":
        if drafter is None:
            raise ValueError("the eagle3 method needs a drafter GGUF")
        return [str(Path(bin_dir) / TOOLS["speculative"]), *common, "-md", str(drafter), "--spec-type", "draft-eagle3",
                "--spec-draft-n-max", str(drafts), "-td", str(threads)]
    raise ValueError(f"unknown llama.cpp method {method!r}")


def run_tool(argv: list[str], method: str, prompt: str, timeout: float = 600, attempts: int = 3) -> dict:
    """Run one tool; its decoding speed and counts (``parse_timings``) and its continuation.

    The tools log through a thread that is not flushed at exit (llama.cpp issue 22142): on a busy
    machine the last lines, timings included, are sometimes lost. The timings come after the
    text, so a run whose timing line arrived is whole; a run without it is made again."""
    for attempt in range(1, attempts + 1):  # attempts >= 1
        # a token may end mid-character (byte tokens): undecodable bytes are replaced, alike in every run
        done = subprocess.run(argv, capture_output=True, encoding="utf-8", errors="replace", timeout=timeout,
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise ToolFailed(f"{Path(argv[0]).name} exited {done.returncode}: {done.stderr[-1500:]}", done.returncode)
        whole = (_EVAL if method == "plain" else _DECODED).search(done.stderr) is not None
        if whole or attempt == attempts:  # the last attempt's missing line is parse_timings' error
            return {**parse_timings(method, done.stderr), "text": continuation(method, done.stdout, prompt), "attempts": attempt}


_EVAL = re.compile(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs")  # llama-completion's (the prompt's says "tokens")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")  # lookup / speculative-simple
_COUNTS = {"drafted": re.compile(r"n_drafted\s*=\s*(\d+)"), "accepted": re.compile(r"n_accept\s*=\s*(\d+)")}


def parse_timings(method: str, log: str) -> dict:
    """The decoding speed a tool printed, start-up and prompt left out: ``tokens`` decoded in
    ``seconds``, ``tokens_per_s``; the drafted and accepted counts of a speculative tool.

    llama-completion's ``eval time`` covers the one-token passes after the prompt's (the prompt's
    pass yields the first token); lookup and speculative-simple time their loop from the prompt's
    last token on, every generated token inside it."""
    if method == "plain":
        found = list(_EVAL.finditer(log))
        if not found:
            raise ValueError("no 'eval time = ... ms / N runs' line in llama-completion's output")
        ms, n = float(found[-1][1]), int(found[-1][2])
        out = {"tokens": n, "seconds": ms / 1000}
    else:
        m = _DECODED.search(log)
        if m is None:
            raise ValueError(f"no 'decoded N tokens in S seconds' line in the {method} tool's output")
        out = {"tokens": int(m[1]), "seconds": float(m[2])}
        for key, pattern in _COUNTS.items():
            hit = pattern.search(log)
            if hit:
                out[key] = int(hit[1])
    out["tokens_per_s"] = out["tokens"] / out["seconds"] if out["seconds"] > 0 else 0.0
    return out


def continuation(method: str, stdout: str, prompt: str) -> str:
    """The text a tool generated: its stdout without colours, the echoed prompt (lookup and
    speculative-simple print it; llama-completion is told not to), llama-completion's
    `` [end of text]`` mark and the closing newlines."""
    text = ANSI.sub("", stdout)
    if method != "plain":
        at = text.find(prompt)
        if at < 0:
            raise ValueError(f"the {method} tool's output does not echo the prompt {prompt[:40]!r}")
        text = text[at + len(prompt):]
    return text.rstrip("\n").removesuffix(" [end of text]")


def same_text(text: str, greedy: str) -> bool:
    """Whether a speculative run's ``text`` is the plain greedy run's: it begins with all of it
    (llama.cpp's speculative tools stop at ``-n`` or a few tokens past it, the last step's kept
    drafts), where a character cut at the end of ``greedy`` (shown as U+FFFD) may be whole."""
    return text.startswith(greedy.rstrip("\ufffd"))


def convert(tree: Path, model_dir: Path, out_file: Path, target: Path | None = None, outtype: str = "f32",
            timeout: float = 900) -> Path:
    """llama.cpp's own converter on an HF checkpoint, or on an EAGLE-3 export with ``target`` (the
    base's HF dir, ``--target-model-dir``); it reads the ``gguf`` package vendored beside it (it
    puts ``gguf-py`` first on its path)."""
    argv = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(model_dir), "--outfile", str(out_file), "--outtype", outtype]
    argv += ["--target-model-dir", str(target)] if target is not None else []
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}: {done.stderr[-2000:]}")
    return out_file
