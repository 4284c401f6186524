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
blocks takes over (compute-bound there; its rounding differs, as any GEMM's would).

Build: the C++ below with the machine's C++ compiler (``$CXX``, else ``c++`` / ``g++``),
``-O3 -march=native -fopenmp`` (x86-64 only), into the cache (``$MULTITOKEN_CACHE/kernels``,
keyed by the source, the flags, the compiler's version and the CPU's feature flags, so a cache
shared between machines never loads a binary built for another CPU), written atomically; about
a second, once. OpenMP threads come from torch's own runtime (its ``libgomp`` is already loaded
when this loads), so ``torch.set_num_threads`` sets them. Without a compiler, or on any build or
load error, ``library()`` returns None after one line on stderr, and callers keep oneDNN's or
torch's linears.
"""

from __future__ import annotations

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

MAX_ROWS = 64  # rows per call the kernel takes; more go through a batched matmul
SOURCE = r"""
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <omp.h>
#ifdef __AVX512F__
constexpr int L = 32, MB = 12;  // outputs per block, rows per register block: 24 zmm of sums
#else
constexpr int L = 16, MB = 4;  // AVX2: 8 ymm of sums
#endif
constexpr int PREFETCH = 2048;  // floats ahead of the weight read (8 KB)

template <int R>
static inline void rows_block(const float* __restrict x, const float* __restrict wb, float* __restrict out,
                              int K, int N, int n0) {
    float acc[R][L];
    for (int m = 0; m < R; ++m)
        for (int j = 0; j < L; ++j) acc[m][j] = 0.0f;
    for (int k = 0; k < K; ++k) {
        const float* w = wb + (int64_t)k * L;
        __builtin_prefetch(w + PREFETCH, 0, 3);
        __builtin_prefetch(w + PREFETCH + 16, 0, 3);
        for (int m = 0; m < R; ++m) {
            const float xv = x[(int64_t)m * K + k];
            for (int j = 0; j < L; ++j) acc[m][j] += xv * w[j];
        }
    }
    const int width = std::min(L, N - n0);
    for (int m = 0; m < R; ++m) std::memcpy(out + (int64_t)m * N + n0, acc[m], sizeof(float) * width);
}

static void column_block(const float* x, const float* wb, float* out, int M, int K, int N, int n0) {
    int m = 0;
    for (; m + MB <= M; m += MB) rows_block<MB>(x + (int64_t)m * K, wb, out + (int64_t)m * N, K, N, n0);
    const float* xr = x + (int64_t)m * K;
    float* o = out + (int64_t)m * N;
    switch (M - m) {
        case 1: rows_block<1>(xr, wb, o, K, N, n0); break;
        case 2: rows_block<2>(xr, wb, o, K, N, n0); break;
        case 3: rows_block<3>(xr, wb, o, K, N, n0); break;
#ifdef __AVX512F__
        case 4: rows_block<4>(xr, wb, o, K, N, n0); break;
        case 5: rows_block<5>(xr, wb, o, K, N, n0); break;
        case 6: rows_block<6>(xr, wb, o, K, N, n0); break;
        case 7: rows_block<7>(xr, wb, o, K, N, n0); break;
        case 8: rows_block<8>(xr, wb, o, K, N, n0); break;
        case 9: rows_block<9>(xr, wb, o, K, N, n0); break;
        case 10: rows_block<10>(xr, wb, o, K, N, n0); break;
        case 11: rows_block<11>(xr, wb, o, K, N, n0); break;
#endif
        default: break;
    }
}

extern "C" int rows_lanes() { return L; }

// x [M, K], wp [ceil(N / L), K, L] (zero-padded past N), out [M, N]
extern "C" void rows_linear(const float* x, const float* wp, float* out, int M, int K, int N) {
    const int blocks = (N + L - 1) / L;
    const int threads = std::min(omp_get_max_threads(), blocks);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int b = 0; b < blocks; ++b) column_block(x, wp + (int64_t)b * K * L, out, M, K, N, b * L);
}
"""

_STATE: dict = {"loaded": False, "lib": None, "why": None}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), so a cached build is never loaded on another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _flags() -> list[str]:
    return ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]


def _build(compiler: str) -> Path:
    """The shared library, compiled into the cache unless a build for this key is there."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    key = hashlib.sha256("\0".join([SOURCE, " ".join(_flags()), version, _cpu_flags()]).encode()).hexdigest()[:16]
    out_dir = cache_dir() / "kernels" / key
    lib = out_dir / "rows_linear.so"
    if lib.is_file():
        return lib
    if os.path.lexists(lib):  # our cache's own name, but not a file we wrote: leave it
        raise RuntimeError(f"{lib} exists and is not a built kernel: remove it to rebuild")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src, built = Path(tmp) / "rows_linear.cpp", Path(tmp) / "rows_linear.so"
        src.write_text(SOURCE)
        done = subprocess.run([compiler, *_flags(), str(src), "-o", str(built)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
        os.replace(built, lib)  # atomic: a concurrent build of the same key writes the same bytes
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
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        return None, f"{type(err).__name__}: {err}"
    lib.rows_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
    lib.rows_linear.restype = None
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
    rows = x.reshape(-1, k).contiguous()  # [M, K]
    m = rows.shape[0]
    if m <= MAX_ROWS:
        out = torch.empty(m, n, dtype=torch.float32)
        _STATE["lib"].rows_linear(rows.data_ptr(), blocked.data_ptr(), out.data_ptr(), m, k, n)
    else:  # a prompt's pass: [B, M, K] @ [B, K, L] over the blocks
        out = torch.matmul(rows, blocked).transpose(0, 1).reshape(m, -1)[:, :n]
    if bias is not None:
        out.add_(bias)  # out is this call's own tensor
    return out.reshape(*x.shape[:-1], n)
