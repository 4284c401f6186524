"""The compiled multi-row GEMV for decoding steps (``--cpu-linear rows``): out = x W^T for 1-64
rows, reading each weight once per call, and its build.

Why: a decoding step multiplies a few rows (the tokens it verifies) by every weight matrix, so
it is bound by reading the weights; what matters is that 2-16 rows cost what one row costs.
The weight is kept in column blocks of ``L`` outputs, ``[N / L, K, L]``, so that a block streams
contiguously; per block up to 12 rows' ``L`` sums live in vector registers (4 with AVX2), adding
one product per input feature in order (one fused multiply-add each). Each output is then the
same chain of operations whatever the row count, the row's place in the call and the thread
count: a verification step's logits are bit-identical to a one-token step's (docs/kernels.md,
the exactness contract). Past ``MAX_ROWS`` rows (a prompt's pass) a batched matmul over the same
blocks takes over (compute-bound there; its rounding differs, as any GEMM's would). The narrow
formats (formats.py) are decoded in the same blocks by the same chain: gguf_codes.py.

Build: ops.cpp (which includes gemv_rows.cpp, argmax_prefilter.cpp and layer_step.cpp and registers them as torch
ops with schemas and checks) by ``torch.utils.cpp_extension.load`` with ``-O3 -march=native
-fopenmp`` (x86-64 only; with ``MULTITOKEN_CPU_FEATURES`` set, the instructions above its level
turned off: cpu_features.py), into the cache (``$MULTITOKEN_CACHE/kernels``, keyed by the
sources, the flags, the level, the compiler's version, torch's version and the CPU's feature
flags, so a cache shared between machines never loads a binary built for another CPU, nor a
forced build a native one), with the library's sha256 beside it; only a library whose bytes
match that record is ever loaded (a planted, truncated or half-written one is rebuilt over; one
without our ops is refused). The ops live in the namespace ``multitoken_<level>`` (``native``,
``avx512``, ``avx2``, ``plain``): builds for two levels can be loaded in one process. OpenMP
threads come from torch's own runtime, so ``torch.set_num_threads`` sets them. Without a
compiler, or on any build or load error, ``library()`` returns None after one line on stderr
and callers keep oneDNN's or torch's linears, unless ``MULTITOKEN_REQUIRE_KERNELS=1`` (CI):
then that line is an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from multitoken.base.errors import UsageError
from multitoken.base.progress import status
from multitoken.embedded import cache_dir
from multitoken.kernels import cpu_features, formats
from multitoken.kernels.formats import Format

MAX_ROWS = 64  # rows per kernel call (handed to ops.cpp); the float32 blocks take a batched matmul past it
# The C++ (package data): ops.cpp is compiled and includes the others; all of them key the cache.
HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("ops.cpp", "gemv_rows.cpp", "argmax_prefilter.cpp", "gemv_int8.cpp", "row_attention.cpp", "decode_attention.cpp", "rows_max.cpp", "layer_step.cpp"))
REQUIRE = "MULTITOKEN_REQUIRE_KERNELS"  # =1: a kernel that cannot be built is an error, not a fallback
OPS = ("lanes", "prefilter_built", "gemv", "screened", "rows_argmax", "q8_argmax", "row_attention", "decode_attention", "rms_norm", "rotary_step", "rows_max_index", "llama_row", "llama_rows")
DIGEST_SUFFIX = ".sha256"  # beside each library: the sha256 of the bytes this process family built

_STATE: dict = {"loaded": False, "lib": None, "why": None}


def required() -> bool:
    """Whether ``MULTITOKEN_REQUIRE_KERNELS=1`` asks for the compiled path (CI)."""
    return os.environ.get(REQUIRE, "").strip() == "1"


def namespace() -> str:
    """The torch ops namespace of this process's build: one per CPU-feature level."""
    return f"multitoken_{cpu_features.level()}"


def _compiler() -> str | None:
    """The C++ compiler torch's build runs (``$CXX``, else ``c++``), resolved on the PATH."""
    return shutil.which(os.environ.get("CXX") or "c++")


def _flags() -> list[str]:
    """The compiler's flags: this CPU's instructions, less those above ``MULTITOKEN_CPU_FEATURES``,
    no product and sum fused unless the source says so (every rounding is the source's: the
    kernels spell their fused multiply-adds out, layer_step.cpp's loops round as torch's ops), and
    the values the C++ takes from here (the namespace, ``MAX_ROWS``, formats.py's formats)."""
    return ["-O3", *cpu_features.kernel_flags(), "-fopenmp", "-fno-math-errno", "-ffp-contract=off",
            f"-DMT_NAMESPACE={namespace()}", f"-DMT_MAX_ROWS={MAX_ROWS}", *formats.defines()]


def cached_library(compiler: str) -> Path:
    """Where the build for this machine's key lives (it may not exist yet)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    source = "\n".join(path.read_text() for path in SOURCES)
    key = hashlib.sha256("\0".join([source, " ".join(_flags()), cpu_features.level(), version, torch.__version__,
                                     cpu_features.cpu_flags()]).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / key / f"{namespace()}.so"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _recorded(lib: Path) -> str | None:
    try:
        return lib.with_name(lib.name + DIGEST_SUFFIX).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _ninja_dir() -> str | None:
    """The folder of the ``ninja`` package's binary (a dependency), which torch's build runs by
    name: a venv's bin folder is not on PATH unless the venv is activated."""
    try:
        import ninja  # the PyPI package: ninja.BIN_DIR holds its binary
    except ImportError:
        return None
    folder = getattr(ninja, "BIN_DIR", None)
    return folder if folder and os.path.isfile(os.path.join(folder, "ninja")) else None


@contextlib.contextmanager
def _cxx(compiler: str):
    """$CXX set to ``compiler`` and the ninja package's binary put first on $PATH while torch's
    build runs (it reads both)."""
    before = {key: os.environ.get(key) for key in ("CXX", "PATH")}
    os.environ["CXX"] = compiler
    ninja_dir = _ninja_dir()
    if ninja_dir:
        os.environ["PATH"] = os.pathsep.join(filter(None, (ninja_dir, before["PATH"])))
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _compile(compiler: str, build: Path) -> Path:
    """ops.cpp compiled by torch.utils.cpp_extension in ``build`` (which also loads it: the ops
    are registered in this process from then on)."""
    from torch.utils import cpp_extension  # imported on first build only: it pulls in setuptools

    with _cxx(compiler):
        cpp_extension.load(name=namespace(), sources=[str(SOURCES[0])], extra_cflags=_flags(),
                           extra_ldflags=["-fopenmp"], extra_include_paths=[str(HERE)], build_directory=str(build),
                           is_python_module=False, verbose=False)
    return build / f"{namespace()}.so"


def _why(output: str, compiler: str) -> str:
    """The line of a failed build's output that says why: the compiler's first error, else its
    last line that is not ninja's own nor the command."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    plain = [line for line in lines if not line.startswith(("ninja:", "FAILED", "[", "Error building")) and compiler not in line]
    return (errors or plain or lines or ["no output"])[0 if errors else -1]


def _build(compiler: str) -> Path:
    """The shared library, compiled (and loaded) into the cache unless a build for this key is
    there whose bytes match the sha256 recorded beside it at build time (not loaded then). A
    library without that record, or with other bytes (planted, truncated, half-written), is never
    loaded: it is rebuilt over."""
    lib = cached_library(compiler)
    if os.path.lexists(lib) and not (lib.is_file() and not lib.is_symlink()):  # our name, not a file we wrote
        raise RuntimeError(f"{lib} exists and is not a built kernel: remove it to rebuild")
    if lib.is_file() and _recorded(lib) == _sha256(lib):
        return lib
    if _registered() is not None:  # torch registers a namespace once per process: a new build loads in a new one
        raise RuntimeError(f"this process already holds {namespace()}'s ops from another build: {lib} is "
                           "built and loaded by the next process")
    out_dir = lib.parent
    made = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = None
    status("compiling the CPU kernels (once per machine)")
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        try:
            built = _compile(compiler, Path(tmp))
        except (RuntimeError, OSError, subprocess.SubprocessError) as err:
            failed = f"{Path(compiler).name} failed: {_why(str(err), compiler)}"
        else:
            digest = Path(tmp) / "digest"
            digest.write_text(_sha256(built) + "\n")
            # atomic, the record first: a reader between the two sees a mismatch and rebuilds
            os.replace(digest, lib.with_name(lib.name + DIGEST_SUFFIX))
            os.replace(built, lib)
    if failed:
        if made:  # the folder this failed build made goes too: no empty kernel folder left behind
            with contextlib.suppress(OSError):
                out_dir.rmdir()
        raise RuntimeError(failed)
    return lib


def _registered():
    """This process's ops namespace where our ops are registered in it, else None."""
    ops = getattr(torch.ops, namespace())
    try:
        for name in OPS:
            getattr(ops, name)
    except (AttributeError, RuntimeError):
        return None
    return ops


def library():
    """The kernel's ops (``torch.ops.multitoken_<level>``), or None where they cannot be built here
    (said once on stderr; an error instead where ``MULTITOKEN_REQUIRE_KERNELS=1``)."""
    if not _STATE["loaded"]:
        _STATE["loaded"] = True
        _STATE["lib"], _STATE["why"] = _load()
        if _STATE["lib"] is None:
            if required():
                raise UsageError(f"the compiled CPU kernels are unavailable ({_STATE['why']})",
                                 f"install a C++ compiler with OpenMP and ninja, or unset {REQUIRE}")
            print(f"multitoken: the compiled rows kernel is unavailable ({_STATE['why']}); "
                  "CPU linears stay oneDNN's or torch's", file=sys.stderr)
    return _STATE["lib"]


def _load():
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"built for x86-64 only, this is {platform.machine()}"
    compiler = _compiler()
    if compiler is None:
        return None, "no C++ compiler found: install g++ (or set $CXX)"
    try:
        path = _build(compiler)
        if _registered() is None:  # a cached build: load it
            torch.ops.load_library(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        return None, f"{type(err).__name__}: {err}"
    if (ops := _registered()) is None:
        return None, f"{path} lacks the kernel's ops: remove {path.parent} to rebuild it"
    return ops, None


def available() -> bool:
    """Whether a compiler for the kernel is here, without building or loading anything (a test's
    skip condition: collection compiles nothing)."""
    return platform.machine().lower() in ("x86_64", "amd64") and _compiler() is not None


def lanes() -> int:
    return library().lanes()


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] in column blocks # -> [ceil(N / L), K, L] fp32, zero-padded past N."""
    n, k = weight.shape
    width = lanes()
    blocks = -(-n // width)
    padded = weight.detach().float()
    if blocks * width != n:  # one more copy only where the last block is partial (peak memory while packing)
        padded = torch.cat([padded, padded.new_zeros(blocks * width - n, k)])
    return padded.reshape(blocks, width, k).transpose(1, 2).contiguous()


def dense_weight(blocked: torch.Tensor, n: int) -> torch.Tensor:
    """The plain [N, K] weight back from its blocks, exactly (a copy, no arithmetic)."""
    blocks, k, width = blocked.shape
    return blocked.transpose(1, 2).reshape(blocks * width, k)[:n].contiguous()


def linear(x: torch.Tensor, blocked: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] fp32 -> [..., N]: the kernel up to ``MAX_ROWS`` rows, a batched matmul past it."""
    k = x.shape[-1]
    x = x if x.is_contiguous() else x.contiguous()  # rows [M, K] in memory
    m = x.numel() // k
    if m <= MAX_ROWS:  # a decoding step: one op call (a step makes ~200)
        return _STATE["lib"].gemv(x, blocked, Format.F32, n, bias)
    # a prompt's pass: [B, M, K] @ [B, K, L] over the blocks
    out = torch.matmul(x.reshape(m, k), blocked).transpose(0, 1).reshape(m, -1)[:, :n].reshape(*x.shape[:-1], n)
    if bias is not None:
        out.add_(bias)  # out is this call's own tensor
    return out


# The argmax screen -------------------------------------------------------------------------------
# Greedy decoding reads only the argmax of the unembedding, the largest weight of a small model
# (SmolLM2: 49,152 x 576, a fifth of a step's reads). An int8 copy (one scale per output) gives
# every logit within a bound of the exact kernel's; only the outputs whose bound reaches the best
# are computed exactly, from the fp32 blocks, by the same chain: the argmax is the exact kernel's,
# bit for bit, at a quarter of the reads.
U = 2.0 ** -24  # fp32 unit roundoff
SCREEN_CHUNK = 256  # blocks quantised at a time (bounds peak memory while building)


def screen_weight(blocked: torch.Tensor) -> dict[str, torch.Tensor]:
    """The screen's copy of ``blocked`` [B, K, L]: int8 blocks, a scale per output, and per output
    ``err``, the most its screened logit can differ from the exact kernel's per unit of |x|_1."""
    _, k, _ = blocked.shape
    gamma = k * U / (1 - k * U)  # an fp32 chain of k fused multiply-adds: error <= gamma * sum |x_i w_i|
    parts = {"q": [], "scale": [], "err": []}
    for chunk in blocked.split(SCREEN_CHUNK):  # [c, K, L]
        amax = chunk.abs().amax(1)  # [c, L]
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        q = torch.round(chunk / scale[:, None]).clamp(-127, 127).to(torch.int8)
        w, dq = chunk.double(), q.double() * scale.double()[:, None]
        quant = (dq - w).abs().amax(1)  # [c, L] largest rounding of a weight
        reach = torch.maximum(w.abs().amax(1), dq.abs().amax(1))  # bounds |w_i| and |q_i s|
        # |screened - exact| <= |x|_1 (quant + 2 gamma reach + u reach): the rounding of each
        # weight, of both chains and of the final scaling; 1% spare covers the bound's own arithmetic
        err = ((quant + (2 * gamma + 1.01 * U) * reach) * 1.01 + 1e-30).float()
        parts["q"].append(q)
        parts["scale"].append(scale.reshape(-1))
        parts["err"].append(torch.nextafter(err, torch.tensor(float("inf"))).reshape(-1))
    return {name: torch.cat(chunks).contiguous() for name, chunks in parts.items()}


def argmax(x: torch.Tensor, blocked: torch.Tensor, screen: dict, n: int) -> tuple[torch.Tensor, int] | None:
    """The argmax over the ``n`` outputs of ``linear(x, blocked, n, None)`` (the first on
    ties) # x [..., K] -> [...] long, and how many outputs were computed exactly; None where the
    screen does not apply (more than ``MAX_ROWS`` rows, a non-finite input): take that argmax."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()  # [M, K]
    if not 0 < rows.shape[0] <= MAX_ROWS:
        return None
    best, picked = library().rows_argmax(rows, screen["q"], screen["scale"], screen["err"], blocked, n)
    return None if picked < 0 else (best.reshape(x.shape[:-1]), picked)


def screened(x: torch.Tensor, screen: dict, n: int) -> torch.Tensor:
    """The screen's logits alone # x [M, K] -> [M, N] (what its bound is tested on)."""
    return library().screened(x.contiguous(), screen["q"], screen["scale"], n)
