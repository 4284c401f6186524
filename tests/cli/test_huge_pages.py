"""torch's large CPU buffers on transparent huge pages when ``multitoken`` is the program
(base/huge_pages.py): the variable set before torch imports, a user's value kept, a library
user's process untouched; and, where the kernel grants huge pages on request, a large tensor
really lands on them. Each case runs in its own interpreter (torch reads the variable once)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import json, os, re, sys
from multitoken.pipeline.cli import main
from multitoken.base import huge_pages
if sys.argv[1] == "program":
    sys.argv = ["multitoken", "--version"]
    try:
        main()
    except SystemExit:
        pass
else:  # a library call of the command, then torch
    try:
        main(["--version"])
    except SystemExit:
        pass
import torch
x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, every page touched
smaps = open("/proc/self/smaps").read() if os.path.exists("/proc/self/smaps") else None
kib = -1 if smaps is None else sum(int(m) for m in re.findall(r"AnonHugePages:\\s+(\\d+) kB", smaps))
print("PROBE " + json.dumps({"env": os.environ.get(huge_pages.VARIABLE), "huge_kib": kib,
                             "late": huge_pages.enable()}))
"""


def _probe(how: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | env
    done = subprocess.run([sys.executable, "-c", PROBE, how], capture_output=True, text=True, timeout=300, env=environ)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(lines[-1][len("PROBE "):])


def _thp_mode() -> str | None:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    found = re.search(r"\[(\w+)\]", path.read_text()) if path.exists() else None
    return found.group(1) if found else None


def test_the_program_sets_the_variable_and_a_library_user_does_not():
    program, library = _probe("program"), _probe("library")
    assert program["env"] == "1" and library["env"] is None
    assert program["late"] is False and library["late"] is False  # torch imported: too late to set


def test_a_users_value_is_kept():
    assert _probe("program", THP_MEM_ALLOC_ENABLE="0")["env"] == "0"


def test_large_tensors_land_on_huge_pages_where_the_kernel_grants_them():
    mode = _thp_mode()
    if mode != "madvise":
        pytest.skip(f"needs Linux transparent huge pages in 'madvise' mode (this kernel: {mode}): "
                    "there only torch's advice decides")
    on, off = _probe("program"), _probe("program", THP_MEM_ALLOC_ENABLE="0")
    assert off["huge_kib"] < 16 << 10  # the 64 MiB tensor on 4 KiB pages
    assert on["huge_kib"] >= 48 << 10  # most of it on 2 MiB pages
