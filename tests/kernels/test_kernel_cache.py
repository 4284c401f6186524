"""The compiled-kernel cache (issue 46): each library's sha256 is recorded beside it at build time
and only a library matching it is loaded; a planted library (its constructor writes a marker),
a truncated one, one without the kernel's ops, or a symlink at its name never runs. Each load
runs in a process of its own: torch registers an ops namespace once per process."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from multitoken.kernels import gemv_rows

from .conftest import needs_kernels

# Every test compiles the kernel again into a fresh cache: `make test-heavy` (CI's second step).
pytestmark = [pytest.mark.heavy, needs_kernels()]

PLANT = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) { FILE* f = fopen("%s", "w"); if (f) fclose(f); }
"""
LOAD = ("import sys; from multitoken.kernels import gemv_rows as g; ops = g.library(); "
        "sys.exit(1) if ops is None else print(ops.lanes())")


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    """A fresh, empty kernel cache for this test: the library's path there."""
    monkeypatch.setenv("MULTITOKEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(gemv_rows.REQUIRE, raising=False)  # a refused library: the one-line fallback here
    return gemv_rows.cached_library(gemv_rows._compiler())


def _load() -> subprocess.CompletedProcess:
    """``library()`` in a new process with this test's cache."""
    return subprocess.run([sys.executable, "-c", LOAD], env=dict(os.environ), capture_output=True, text=True, timeout=600)


def _plant(lib: Path, marker: Path, tmp_path: Path) -> bytes:
    """A shared library at the cache's own path whose constructor writes ``marker`` when loaded."""
    src = tmp_path / "plant.c"
    src.write_text(PLANT % marker)
    lib.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True, timeout=60)
    return lib.read_bytes()


def _loads_the_real_kernel(lib: Path) -> None:
    done = _load()
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() in (["16"], ["32"])
    assert Path(lib.name + gemv_rows.DIGEST_SUFFIX).name in os.listdir(lib.parent)
    assert gemv_rows._recorded(lib) == hashlib.sha256(lib.read_bytes()).hexdigest()


@pytest.mark.parametrize("record", ["none", "other"])
def test_a_planted_library_is_rebuilt_over_never_loaded(kernel_cache, tmp_path, record):
    marker = tmp_path / "PWNED"
    planted = _plant(kernel_cache, marker, tmp_path)
    if record == "other":
        kernel_cache.with_name(kernel_cache.name + ".sha256").write_text("0" * 64 + "\n")
    _loads_the_real_kernel(kernel_cache)
    assert not marker.exists() and kernel_cache.read_bytes() != planted


def test_a_truncated_library_is_rebuilt(kernel_cache):
    _loads_the_real_kernel(kernel_cache)  # built
    whole = kernel_cache.read_bytes()
    kernel_cache.write_bytes(whole[: len(whole) // 3])  # its record kept: the bytes no longer match it
    _loads_the_real_kernel(kernel_cache)
    assert len(kernel_cache.read_bytes()) == len(whole)


def test_a_library_without_the_ops_is_refused_in_one_line(kernel_cache, tmp_path):
    """Bytes matching their record but not our kernel (no ops registered): None, said once."""
    blob = _plant(kernel_cache, tmp_path / "loaded", tmp_path)
    kernel_cache.with_name(kernel_cache.name + ".sha256").write_text(hashlib.sha256(blob).hexdigest())
    done = _load()
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "lacks the kernel's ops: remove" in done.stderr and "to rebuild it" in done.stderr


def test_a_symlink_at_the_librarys_name_is_refused(kernel_cache, tmp_path):
    target = tmp_path / "elsewhere.so"
    _plant(target, tmp_path / "PWNED", tmp_path)
    kernel_cache.parent.mkdir(parents=True, exist_ok=True)
    kernel_cache.symlink_to(target)
    done = _load()
    assert done.returncode == 1 and "exists and is not a built kernel: remove it to rebuild" in done.stderr
    assert not (tmp_path / "PWNED").exists()


def test_a_second_build_in_one_process_is_refused_not_loaded(kernel_cache):
    """This process holds the kernel's ops already (the other tests' build): a build for another
    cache would register the namespace twice, so it says so instead."""
    assert gemv_rows.library() is not None  # this process's build, in the default cache
    with pytest.raises(RuntimeError, match="already holds .* ops from another build"):
        gemv_rows._build(gemv_rows._compiler())
    assert not kernel_cache.exists()
