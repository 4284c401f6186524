"""The kernel tests' model fixtures (the tied tiny Llama of the pipeline tests, SmolLM2's shape) and
the compiled path's skip mark."""

from __future__ import annotations

import pytest

from ..pipeline.conftest import build_tied_llama, tied_llama_dir  # noqa: F401  (a fixture, re-exported)


def needs_kernels():
    """The skip mark of the compiled path's tests: skipped only where this machine has no C++
    compiler (decided without compiling anything at collection), and never where
    ``MULTITOKEN_REQUIRE_KERNELS=1`` (CI): there a kernel that does not build fails its tests."""
    from multitoken.kernels import gemv_rows

    return pytest.mark.skipif(not gemv_rows.required() and not gemv_rows.available(),
                              reason="needs the compiled kernels: an x86-64 CPU and a C++ compiler with OpenMP")
