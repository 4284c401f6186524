"""The compiled-kernel cache (issue 46): each library's sha256 is recorded beside it at build time
and only a library matching it is loaded; a planted library (its constructor writes a marker),
a truncated one, one lacking the kernel's symbols, or a symlink at its name never runs."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from multitoken.kernels import cpu_linear, rows_kernel

# Every test compiles the kernel again into a fresh cache: `make test-heavy` (CI's second step).
pytestmark = pytest.mark.heavy


PLANT = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) { FILE* f = fopen("%s", "w"); if (f) fclose(f); }
"""


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    """A fresh, empty kernel cache for this test, and rows_kernel's state as before loading."""
    if not cpu_linear.rows_usable():
        pytest.skip("needs the compiled rows kernel: an x86-64 CPU and a C++ compiler with OpenMP")
    monkeypatch.setenv("MULTITOKEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(rows_kernel, "_STATE", {"loaded": False, "lib": None, "why": None})
    return rows_kernel.cached_library(rows_kernel._compiler())


def _plant(lib: Path, marker: Path, tmp_path: Path) -> bytes:
    """A shared library at the cache's own path whose constructor writes ``marker`` when loaded."""
    src = tmp_path / "plant.c"
    src.write_text(PLANT % marker)
    lib.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True, timeout=60)
    return lib.read_bytes()


def _loads_the_real_kernel(lib: Path) -> None:
    got = rows_kernel.library()
    assert got is not None, rows_kernel._STATE["why"]
    assert got.rows_lanes() in (16, 32)
    assert Path(lib.name + rows_kernel.DIGEST_SUFFIX).name in os.listdir(lib.parent)
    assert rows_kernel._recorded(lib) == hashlib.sha256(lib.read_bytes()).hexdigest()


@pytest.mark.parametrize("record", ["none", "other"])
def test_a_planted_library_is_rebuilt_over_never_loaded(kernel_cache, tmp_path, record):
    marker = tmp_path / "PWNED"
    planted = _plant(kernel_cache, marker, tmp_path)
    if record == "other":
        kernel_cache.with_name(kernel_cache.name + ".sha256").write_text("0" * 64 + "\n")
    _loads_the_real_kernel(kernel_cache)
    assert not marker.exists() and kernel_cache.read_bytes() != planted


def test_a_truncated_library_is_rebuilt(kernel_cache):
    assert rows_kernel._build(rows_kernel._compiler()) == kernel_cache  # built, not loaded
    whole = kernel_cache.read_bytes()
    kernel_cache.write_bytes(whole[: len(whole) // 3])  # its record kept: the bytes no longer match it
    _loads_the_real_kernel(kernel_cache)
    assert len(kernel_cache.read_bytes()) == len(whole)


def test_a_library_without_the_symbols_is_refused_in_one_line(kernel_cache, tmp_path, capsys):
    """Bytes matching their record but not our kernel (no rows_lanes ...): None, said once, no AttributeError."""
    marker = tmp_path / "loaded"
    blob = _plant(kernel_cache, marker, tmp_path)
    kernel_cache.with_name(kernel_cache.name + ".sha256").write_text(hashlib.sha256(blob).hexdigest())
    assert rows_kernel.library() is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lacks rows_lanes: remove" in err and "to rebuild it" in err


def test_a_symlink_at_the_librarys_name_is_refused(kernel_cache, tmp_path, capsys):
    target = tmp_path / "elsewhere.so"
    _plant(target, tmp_path / "PWNED", tmp_path)
    kernel_cache.parent.mkdir(parents=True, exist_ok=True)
    kernel_cache.symlink_to(target)
    assert rows_kernel.library() is None
    assert "exists and is not a built kernel: remove it to rebuild" in capsys.readouterr().err
    assert not (tmp_path / "PWNED").exists()
