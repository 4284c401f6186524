"""The garbage collector of a process that is the ``multitoken`` command (base/collector.py):
no collections while it starts, what is loaded frozen, everything frozen at its end; a
library user's or a test's collector untouched. Each case runs in its own interpreter, so that
this one's collector is never frozen."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json, sys
from multitoken.base import collector
from multitoken.pipeline.cli import main
seen = {"before": gc.get_threshold()}
real = collector.model_loaded
def probe():  # the first model loaded (a command may load more than one)
    first = "loading" not in seen
    seen.setdefault("loading", gc.get_threshold())
    real()
    if first:
        seen["loaded"] = [gc.get_threshold(), gc.get_freeze_count() > 0]
collector.model_loaded = probe
if sys.argv[1] == "program":
    sys.argv = ["multitoken", *sys.argv[2:]]
    code = main()
else:
    code = main(sys.argv[2:])
seen["after"] = [gc.get_threshold(), gc.get_freeze_count()]
print("PROBE " + json.dumps({"code": code, **seen}))
"""


def _probe(how: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, how, *args], capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(lines[-1][len("PROBE "):])


def test_the_program_starts_without_collections_then_freezes_what_it_loaded_and_all_at_its_end(tmp_path):
    seen = _probe("program", "attach", "--head", "medusa", "--n", "2", "--out", str(tmp_path / "heads"))
    assert seen["code"] == 0
    default = seen["before"]
    assert seen["loading"][0] > default[0] and seen["loading"][1:] == default[1:]  # start-up: a bound above its objects
    assert seen["loaded"] == [default, True]  # the usual thresholds for the work, the loaded objects frozen
    assert seen["after"][0] == default and seen["after"][1] > 0


def test_main_called_with_arguments_leaves_the_callers_collector_alone(tmp_path):
    seen = _probe("library", "attach", "--head", "medusa", "--n", "2", "--out", str(tmp_path / "heads"))
    assert seen["code"] == 0
    assert seen["loading"] == seen["before"] and seen["loaded"] == [seen["before"], False]
    assert seen["after"] == [seen["before"], 0]
