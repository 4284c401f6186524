"""Transparent huge pages for torch's large CPU buffers, when a command is the program.

Steps of decoding and training allocate blocks of many MiB over and over (a batch's [B, V]
logits, a loss chunk's [C, V] float copies). glibc serves a block that large by a fresh
``mmap`` and unmaps it on free, so each step faults its buffers in again, 4 KiB at a time, and
on a CPU the faults can cost as much as the arithmetic on the block. Where the variable
``THP_MEM_ALLOC_ENABLE`` is set, torch (2.2 and later) aligns blocks of 2 MiB and more to
2 MiB and advises the kernel to back them with huge pages: one fault per 2 MiB instead of 512.
torch reads the variable once, at its first allocation, so it must be set before torch is
imported. Nothing computed changes: only where the bytes live.

The CLI, as the program, calls ``enable`` first thing; a value the user set is kept (``0``
turns it off). A library user who wants it sets the variable before importing torch. Linux
only; where the kernel's THP setting is ``never`` it changes nothing.
"""

from __future__ import annotations

import os
import sys

VARIABLE = "THP_MEM_ALLOC_ENABLE"


def enable() -> bool:
    """Set ``VARIABLE`` to 1 unless it is set; False when torch is already imported (too late)."""
    if "torch" in sys.modules:
        return False
    os.environ.setdefault(VARIABLE, "1")
    return True
