"""The process's memory around packing (cpu_linear.pack): which tensors still live in a file map of
the checkpoint, copying them out, and giving freed heap pages back to the OS, so that the dense
weights a pack releases leave the resident set."""

from __future__ import annotations

import ctypes

from torch import nn


def file_maps() -> list[tuple[int, int]]:
    """Address ranges of this process's file-backed memory maps (Linux; none elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    fields = [line.split() for line in lines]
    return [tuple(int(a, 16) for a in f[0].split("-")) for f in fields if len(f) >= 6 and f[4] != "0"]


def own_copies(root: nn.Module, maps: list[tuple[int, int]]) -> None:
    """Copy every parameter and buffer under ``root`` that lives in a file map into memory of
    its own. transformers may load a checkpoint as one copy-on-write map of its file, which
    stays (and stays resident once the packing read it) while any tensor points into it: the
    released dense weights would free nothing."""
    for t in [*root.parameters(), *root.buffers()]:
        ptr = t.data_ptr() if t.numel() else 0
        if any(a <= ptr < b for a, b in maps):
            t.data = t.data.clone()


def trim_heap() -> None:
    """Give the released dense weights' pages back to the OS: glibc keeps freed heap memory
    mapped (and counted in RSS) below live allocations, such as the packed copies made after."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        return
