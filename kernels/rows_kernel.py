"""A compiled multi-row GEMV for decoding steps (``--cpu-linear rows``): out = x W^T for 1-64
rows, reading each weight once per call, built for this machine the first time it is used.

Why: a decoding step multiplies a few rows (the tokens it verifies) by every weight matrix, so
it is bound by reading the weights; what matters is that 2-16 rows cost what one row costs.
torch's MKL ``F.linear`` grows with the rows past 3, and oneDNN's blocked layout (``packed``)
stays flat but reads ~15% slower than MKL's one-row GEMV on this kind of CPU. This kernel keeps
the weight in column blocks of ``L`` outputs, ``[N / L, K, L]``, so that a block streams
contiguously; per block it holds up to 12 rows' ``L`` sums in vector registers (4 with AVX2), adding one
product per input feature in order (one fused multiply-add each), and prefetches the weight
~8 KB ahead. Each output is then the same chain of operations whatever the row count, the row's
place in the call and the thread count: a verification step's logits are bit-identical to a
one-token step's. Past ``MAX_ROWS`` rows (a prompt's pass) a batched matmul over the same
blocks takes over (compute-bound there; its rounding differs, as any GEMM's would). Weights
stored narrower than float32 without loss (a GGUF base's Q4_1 / Q8_0 codes, 16-bit floats) are
decoded in the same blocks by the same chain: grid_weights.py.

Build: the C++ of rows_kernel.cpp (and grid_screen.cpp after it) with the machine's C++ compiler
(``$CXX``, else ``c++`` / ``g++``), ``-O3 -march=native -fopenmp`` (x86-64 only; with
``MULTITOKEN_CPU_FEATURES`` set, the instructions above its level turned off: cpu_features.py),
into the cache (``$MULTITOKEN_CACHE/kernels``, keyed by the sources, the flags, the level, the
compiler's version and the CPU's feature flags, so a cache shared between machines never loads a
binary built for another CPU, nor a forced build a native one), written atomically with the
library's sha256 beside it (``rows_linear.so.sha256``); only a library whose bytes match that
record is ever loaded (a planted, truncated or half-written one is rebuilt over, never
dlopen'ed; one lacking a symbol is refused); about
a second, once. OpenMP threads come from torch's own runtime (its ``libgomp`` is already loaded
when this loads), so ``torch.set_num_threads`` sets them. Without a compiler, or on any build or
load error, ``library()`` returns None after one line on stderr, and callers keep oneDNN's or
torch's linears.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from multitoken.embedded import cache_dir
from multitoken.kernels import cpu_features

MAX_ROWS = 64  # rows per call the kernel takes; more go through a batched matmul
# The C++ (package data), read when the kernel is built: one translation unit, in this order
# (grid_screen.cpp uses rows_kernel.cpp's layout and helpers).
SOURCES = tuple(Path(__file__).parent / name for name in ("rows_kernel.cpp", "grid_screen.cpp"))

_STATE: dict = {"loaded": False, "lib": None, "why": None}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _flags() -> list[str]:
    """The compiler's flags: this CPU's instructions, less those above ``MULTITOKEN_CPU_FEATURES``."""
    return ["-O3", *cpu_features.kernel_flags(), "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]


# What the kernel exports, with (argument types, result type): a library lacking one is not ours.
SYMBOLS = {
    "rows_lanes": ([], ctypes.c_int),
    "rows_linear": ([ctypes.c_void_p] * 3 + [ctypes.c_int] * 3, None),
    "rows_argmax": ([ctypes.c_void_p] * 7 + [ctypes.c_int] * 3, ctypes.c_int64),
    "rows_screened": ([ctypes.c_void_p] * 4 + [ctypes.c_int] * 3, None),
    "grid_linear": ([ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int] * 3, None),
    "grid_argmax": ([ctypes.c_void_p] * 7 + [ctypes.c_int] * 3, ctypes.c_int64),
    "grid_screen_built": ([], ctypes.c_int),
}
DIGEST_SUFFIX = ".sha256"  # beside each library: the sha256 of the bytes this process family built


def cached_library(compiler: str) -> Path:
    """Where the build for this machine's key lives (it may not exist yet)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    source = "\n".join(path.read_text() for path in SOURCES)
    key = hashlib.sha256("\0".join([source, " ".join(_flags()), cpu_features.level(), version,
                                     cpu_features.cpu_flags()]).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / key / "rows_linear.so"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _recorded(lib: Path) -> str | None:
    try:
        return lib.with_name(lib.name + DIGEST_SUFFIX).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _build(compiler: str) -> Path:
    """The shared library, compiled into the cache unless a build for this key is there whose
    bytes match the sha256 recorded beside it at build time. A library without that record, or
    with other bytes (planted, truncated, half-written), is never loaded: it is rebuilt over."""
    lib = cached_library(compiler)
    if os.path.lexists(lib) and not (lib.is_file() and not lib.is_symlink()):  # our name, not a file we wrote
        raise RuntimeError(f"{lib} exists and is not a built kernel: remove it to rebuild")
    if lib.is_file() and _recorded(lib) == _sha256(lib):
        return lib
    out_dir = lib.parent
    made = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src, built = Path(tmp) / "rows_linear.cpp", Path(tmp) / "rows_linear.so"
        src.write_text("\n".join(path.read_text() for path in SOURCES))
        done = subprocess.run([compiler, *_flags(), str(src), "-o", str(built)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            failed = f"{Path(compiler).name} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
        else:
            failed = None
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


def library():
    """The loaded kernel (ctypes) or None where it cannot be built here (said once on stderr)."""
    if not _STATE["loaded"]:
        _STATE["loaded"] = True
        _STATE["lib"], _STATE["why"] = _load()
        if _STATE["lib"] is None:
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
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        return None, f"{type(err).__name__}: {err}"
    for name, (args, result) in SYMBOLS.items():
        fn = getattr(lib, name, None)
        if fn is None:
            return None, f"{path} lacks {name}: remove {path.parent} to rebuild it"
        fn.argtypes, fn.restype = args, result
    return lib, None


def lanes() -> int:
    return library().rows_lanes()


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


def rows_linear(x: torch.Tensor, blocked: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] fp32 -> [..., N]: the kernel up to ``MAX_ROWS`` rows, a batched matmul past it."""
    k = x.shape[-1]
    x = x if x.is_contiguous() else x.contiguous()  # rows [M, K] in memory
    m = x.numel() // k
    if m <= MAX_ROWS:  # a decoding step: no reshape on this path (a step makes ~200 calls)
        out = torch.empty(x.shape[:-1] + (n,), dtype=torch.float32)
        _STATE["lib"].rows_linear(x.data_ptr(), blocked.data_ptr(), out.data_ptr(), m, k, n)
    else:  # a prompt's pass: [B, M, K] @ [B, K, L] over the blocks
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


def rows_argmax(x: torch.Tensor, blocked: torch.Tensor, screen: dict, n: int) -> tuple[torch.Tensor, int] | None:
    """The argmax over the ``n`` outputs of ``rows_linear(x, blocked, n, None)`` (the first on
    ties) # x [..., K] -> [...] long, and how many outputs were computed exactly; None where the
    screen does not apply (more than ``MAX_ROWS`` rows, a non-finite input): take that argmax."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()  # [M, K]
    m = rows.shape[0]
    if not 0 < m <= MAX_ROWS:
        return None
    approx, best = torch.empty(m, n, dtype=torch.float32), torch.empty(m, dtype=torch.long)
    picked = _STATE["lib"].rows_argmax(rows.data_ptr(), screen["q"].data_ptr(), screen["scale"].data_ptr(),
                                       screen["err"].data_ptr(), blocked.data_ptr(), approx.data_ptr(),
                                       best.data_ptr(), m, k, n)
    return None if picked < 0 else (best.reshape(x.shape[:-1]), picked)
