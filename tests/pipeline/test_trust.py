"""Trust (issue 46): no code from data runs. Every transformers Auto* load in the package passes
``trust_remote_code=False`` (transformers then never asks on stdin); the compiled-kernel cache
loads only the library whose sha256 it recorded at build time."""

from __future__ import annotations

import ast
from pathlib import Path

import multitoken.pipeline as pipeline

PACKAGE = Path(pipeline.__file__).resolve().parent
LOADERS = {"from_pretrained", "from_config"}


def _auto_loads(tree: ast.AST):
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOADERS
                and isinstance(node.func.value, ast.Name) and node.func.value.id.startswith("Auto")):
            yield node


def test_every_auto_load_refuses_remote_code():
    calls = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        for call in _auto_loads(ast.parse(path.read_text())):
            calls += 1
            flags = [k for k in call.keywords if k.arg == "trust_remote_code"]
            assert flags and isinstance(flags[0].value, ast.Constant) and flags[0].value.value is False, \
                f"{path.relative_to(PACKAGE)}:{call.lineno}: {call.func.value.id}.{call.func.attr} without trust_remote_code=False"
    assert calls >= 4  # tokenizer, config, model, the meta-device model of the quantization plan
