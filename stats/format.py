"""On-disk layout shared by counting, merging and lookup.

An n-gram ``(x1, .., xn)`` is one ``uint64`` key in mixed radix ``V`` (the vocabulary size):
``((x1 * V) + x2) * V + x3``. Sorting keys therefore sorts n-grams lexicographically, so a
key range is a range of first tokens, which is what lets merging split by key range.

Every multi-file artefact (a spilled run, a merged key range) is an *array dir*: ``.npy``
files plus an ``info.json`` that records each array's length, written into a temporary
directory and renamed into place, so a reader sees the whole dir or nothing. Readers check
the recorded lengths, so a truncated or foreign file is an error, never silently short.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from multitoken.pipeline.errors import CheckpointError, UsageError

FORMAT_VERSION = 1
MAX_ORDER = 3
# The largest key must stay below 2**64 - 1, which marks empty hash slots (see hashindex).
KEY_LIMIT = 2**64 - 1
META_NAME = "meta.json"
INFO_NAME = "info.json"


def check_order(order: int) -> None:
    if not 1 <= order <= MAX_ORDER:
        raise UsageError(
            f"order {order} is not supported: stats count n-grams of order 1 to {MAX_ORDER}",
            f"pass --order 2 or --order {MAX_ORDER} (order 4+ tables grow too large for a k^n mask to help)",
        )


def check_vocab(vocab_size: int, order: int) -> None:
    if vocab_size < 1:
        raise UsageError(f"vocabulary size must be >= 1, got {vocab_size}")
    if vocab_size**order >= KEY_LIMIT:
        raise UsageError(
            f"a vocabulary of {vocab_size} tokens is too large for order-{order} keys (V^{order} must fit in 64 bits)",
            "count a lower order",
        )


def encode(columns: list[np.ndarray], vocab_size: int) -> np.ndarray:
    """Token id columns ``n x [m]`` -> keys ``[m]`` (uint64)."""
    v = np.uint64(vocab_size)
    key = np.asarray(columns[0]).astype(np.uint64)
    for col in columns[1:]:
        key = key * v + np.asarray(col).astype(np.uint64)
    return key


def decode(keys: np.ndarray, order: int, vocab_size: int) -> np.ndarray:
    """Keys ``[m]`` -> token ids ``[m, order]`` (int64)."""
    v = np.uint64(vocab_size)
    keys = np.asarray(keys, dtype=np.uint64).copy()
    out = np.empty((keys.size, order), dtype=np.int64)
    for j in range(order - 1, -1, -1):
        out[:, j] = keys % v
        keys //= v
    return out


def write_array_dir(path: Path, arrays: dict[str, np.ndarray], info: dict) -> None:
    """Atomically create directory ``path`` holding ``arrays`` and ``info.json``."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lengths = {}
    for name, arr in arrays.items():
        with open(tmp / f"{name}.npy", "wb") as fh:
            n, dtype = _write_npy(fh, arr)
            fh.flush()
            os.fsync(fh.fileno())
        lengths[name] = [n, str(dtype)]
    record = {"format_version": FORMAT_VERSION, "arrays": lengths, **info}
    with open(tmp / INFO_NAME, "w") as fh:
        json.dump(record, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    if path.exists():  # a rerun redoing a finished step: replace the old copy
        shutil.rmtree(path)
    os.rename(tmp, path)
    _fsync_dir(path.parent)


def _write_npy(fh, arr) -> tuple[int, np.dtype]:
    """Write a 1-D ``.npy``: an array, or a list of 1-D pieces of one dtype written back to back.

    Pieces are streamed: no concatenated copy is made (a spill's runs are most of the memory
    bound, and copying them cost about as much CPU as writing them).
    """
    if not isinstance(arr, list):
        arr = np.ascontiguousarray(arr)
        np.save(fh, arr)
        return int(arr.shape[0]), arr.dtype
    dtype = arr[0].dtype
    if any(p.dtype != dtype or p.ndim != 1 for p in arr):
        raise ValueError("array pieces must be 1-D and share one dtype")
    n = sum(int(p.size) for p in arr)
    np.lib.format.write_array_header_1_0(fh, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (n,)})
    for piece in arr:
        fh.write(np.ascontiguousarray(piece).data)
    return n, dtype


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_info(path: Path) -> dict:
    path = Path(path)
    try:
        info = json.loads((path / INFO_NAME).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable partial ({err})", f"delete {path} and rerun the same command to recount it") from err
    if info.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: partial format {info.get('format_version')}, expected {FORMAT_VERSION}", f"delete {path} and rerun")
    return info


def load_array(path: Path, name: str, info: dict, mmap: bool = True) -> np.ndarray:
    """One array of an array dir, checked against the length and dtype recorded at write time."""
    file = Path(path) / f"{name}.npy"
    length, dtype = info["arrays"][name]
    try:
        arr = np.load(file, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:  # numpy raises ValueError for short/garbled files
        raise CheckpointError(f"{file}: unreadable or truncated ({err})", f"delete {path} and rerun the same command to recount it") from err
    if arr.ndim != 1 or arr.shape[0] != length or str(arr.dtype) != dtype:
        raise CheckpointError(
            f"{file}: holds {arr.shape} {arr.dtype}, expected [{length}] {dtype} (truncated or replaced)",
            f"delete {path} and rerun the same command to recount it",
        )
    return arr
