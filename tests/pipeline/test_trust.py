"""Trust (issue 46): no code from data runs. Every transformers Auto* load in the package passes
``trust_remote_code=False`` (transformers then never asks on stdin); the compiled-kernel cache's
side: tests/kernels/test_kernel_cache.py."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

# every folder of our code (they install under multitoken.*; base and embedded sit beside pipeline)
PACKAGES = [Path(importlib.import_module(f"multitoken.{name}").__file__).resolve().parent
            for name in ("base", "embedded", "adapters", "stats", "kernels", "decoding", "pipeline")]
LOADERS = {"from_pretrained", "from_config"}


def _auto_loads(tree: ast.AST):
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOADERS
                and isinstance(node.func.value, ast.Name) and node.func.value.id.startswith("Auto")):
            yield node


def test_every_auto_load_refuses_remote_code():
    calls = 0
    for path in sorted(p for package in PACKAGES for p in package.rglob("*.py")):
        for call in _auto_loads(ast.parse(path.read_text())):
            calls += 1
            flags = [k for k in call.keywords if k.arg == "trust_remote_code"]
            assert flags and isinstance(flags[0].value, ast.Constant) and flags[0].value.value is False, \
                f"{path}:{call.lineno}: {call.func.value.id}.{call.func.attr} without trust_remote_code=False"
    assert calls >= 7  # tokenizer, config, model, the quantization plan's meta model, fetch's three
