"""Bad and careless inputs against every writing command and every reader, as subprocesses.

Each case of ``CASES`` damages an input, points ``--out`` somewhere it must not write or gives
an option out of range, runs the command line in its own process (forked from one that imported
the CLI once: ``cli_zygote.py``) and asserts: the exit code, one clean message (the
expected words, no ``Traceback``), and that every sentinel file (the user's own, beside or
inside the destination) is byte-identical afterwards. The inputs (a heads dir, a stats dir, a
corpus, partial counts of a sharded build, a finished train run) are made once per module,
from the embedded stories260K assets.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from multitoken.pipeline.cli import main
from multitoken.embedded import EMBEDDED_HEADS, EMBEDDED_STATS

from ..conftest import fixture_path
from .bad_input_cases import CASES
from .cli_helpers import phrase_corpus, run_forked


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("world")
    w = {"heads": Path(shutil.copytree(EMBEDDED_HEADS, root / "heads")),
         "stats": Path(shutil.copytree(EMBEDDED_STATS, root / "stats")),
         "corpus": phrase_corpus(root / "corpus.jsonl")}
    # partial counts of a sharded order-2 build (merged later by `stats merge`)
    assert main(["stats", "build", "--data", str(w["corpus"]), "--out", str(root / "sharded"), "--order", "2", "--shard", "0/1"]) == 0
    w["sharded"] = root / "sharded"
    # a finished order-2 stats dir, with its record
    assert main(["stats", "build", "--data", str(w["corpus"]), "--out", str(root / "built"), "--order", "2"]) == 0
    w["built"] = root / "built"
    # a finished one-step train run and its checkpoint
    assert main(["train", "--heads", str(w["heads"]), "--data", str(w["corpus"]), "--out", str(root / "trained"),
                 "--max-steps", "1", "--seq-len", "16", "--batch-size", "1", "--eval-batches", "1", "--no-progress"]) == 0
    w["trained"] = root / "trained"
    w["bin"], w["tok"] = fixture_path("stories260K", "stories260K.bin"), fixture_path("stories260K", "tok512.model")
    return w

def _snapshot(paths: list[Path]) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in paths}


TEST = "test_bad_input_ends_in_one_clean_line"


@pytest.fixture(scope="module")
def outcomes(world, request, tmp_path_factory) -> dict:
    """Every selected case, damaged one by one, then run side by side (each is a separate
    process, forked from one that imported the CLI once): {name: (case, its dir, sentinels before, result)}."""
    names = [item.callspec.params["name"] for item in request.session.items
             if getattr(item, "originalname", None) == TEST and item.module.__name__ == request.module.__name__]
    prepared = {}
    for name in names:
        d = tmp_path_factory.mktemp(name)
        case = CASES[name](world, d)
        prepared[name] = (case, d, _snapshot(case.sentinels))
    results = run_forked({n: c for n, (c, _, _) in prepared.items()}, tmp_path_factory.mktemp("zygote"))
    return {n: (*prepared[n], results[n]) for n in prepared}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_ends_in_one_clean_line(outcomes, name):
    case, d, before, result = outcomes[name]
    err = result.stderr
    assert "Traceback" not in err, err
    assert "[y/N]" not in result.stdout + err  # nothing asks on stdin
    assert result.returncode == case.code, err
    assert case.message in err, err
    assert _snapshot(case.sentinels) == before  # nothing of the user's lost or changed
    assert not (d / "PWNED").exists()  # no planted code ran
    leftovers = [p for p in d.rglob("*") if ".tmp-" in p.name or p.name.endswith(".lock") or ".multitoken-probe" in p.name]
    assert leftovers == []
