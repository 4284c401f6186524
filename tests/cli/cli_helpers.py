"""Helpers of the CLI tests: the CLI in a fresh process, a small token-id corpus."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np


def run_cli(*args, cwd=None, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "multitoken.pipeline.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def phrase_corpus(path: Path, docs: int = 40) -> Path:
    rng = np.random.default_rng(0)
    lines = [json.dumps({"input_ids": rng.integers(3, 500, size=int(rng.integers(20, 60))).tolist()}) for _ in range(docs)]
    path.write_text("\n".join(lines) + "\n")
    return path
