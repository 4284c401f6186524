"""The kernel tests' model fixtures: the tied tiny Llama of the pipeline tests (SmolLM2's shape)."""

from __future__ import annotations

from ..pipeline.conftest import build_tied_llama, tied_llama_dir  # noqa: F401  (a fixture, re-exported)
