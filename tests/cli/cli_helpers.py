"""Helpers of the CLI tests: the CLI in a fresh process (one, or many forked from one that
imported the CLI once), a small token-id corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def run_cli(*args, cwd=None, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "multitoken.pipeline.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_forked(cases: dict, workdir: Path) -> dict[str, subprocess.CompletedProcess]:
    """Each case's command line in its own process, forked from one that imported the CLI once
    (cli_zygote.py): what ``run_cli`` gives, without torch's import per case. ``cases``: {name:
    an object with ``args``, ``cwd`` and ``env`` (None: this process's)}. Cases of one environment
    share a zygote, started in that environment (libraries read it as they are imported). A result
    also holds ``connects`` (the child's socket connects), ``seconds`` (its time, fork to exit)
    and ``main_s`` (its ``main`` alone)."""
    groups: dict[str, dict] = {}
    for name, case in cases.items():
        env = case.env if case.env is not None else dict(os.environ)
        groups.setdefault(json.dumps(env, sort_keys=True), {})[name] = case
    zygote, parallel = Path(__file__).with_name("cli_zygote.py"), str(max(2, min(4, os.cpu_count() or 1)))
    started = []
    for index, (env, group) in enumerate(groups.items()):
        spec = {n: {"args": [str(a) for a in c.args], "cwd": str(c.cwd) if c.cwd else None} for n, c in group.items()}
        folder = workdir / f"env-{index}"  # the zygote's own: it names its children's files by case number
        folder.mkdir(parents=True)
        files = folder / "cases.json", folder / "results.json"
        files[0].write_text(json.dumps(spec))
        started.append((spec, files[1], subprocess.Popen([sys.executable, zygote, *files, parallel], env=json.loads(env),
                                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    done = {}
    for spec, results_file, zygote_run in started:
        _, err = zygote_run.communicate(timeout=900)
        assert zygote_run.returncode == 0, err
        for n, r in json.loads(results_file.read_text()).items():
            done[n] = subprocess.CompletedProcess(spec[n]["args"], r["returncode"], r["stdout"], r["stderr"])
            done[n].connects, done[n].seconds, done[n].main_s = r["connects"], r["seconds"], r["main_s"]
    return done


def phrase_corpus(path: Path, docs: int = 40) -> Path:
    rng = np.random.default_rng(0)
    lines = [json.dumps({"input_ids": rng.integers(3, 500, size=int(rng.integers(20, 60))).tolist()}) for _ in range(docs)]
    path.write_text("\n".join(lines) + "\n")
    return path
