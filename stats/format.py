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
import tokenize
from pathlib import Path

import numpy as np

from multitoken.base.atomic import atomic_dir
from multitoken.base.errors import CheckpointError, UsageError

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
    """Atomically create directory ``path`` holding ``arrays`` and ``info.json`` (a rerun
    redoing a finished step replaces the old copy)."""
    with atomic_dir(Path(path)) as tmp:
        lengths = {}
        for name, arr in arrays.items():
            with open(tmp / f"{name}.npy", "wb") as fh:
                n, dtype = _write_npy(fh, arr)
            lengths[name] = [n, str(dtype)]
        record = {"format_version": FORMAT_VERSION, "arrays": lengths, **info}
        (tmp / INFO_NAME).write_text(json.dumps(record, indent=1))


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


def read_info(path: Path) -> dict:
    path = Path(path)
    fix = f"delete {path} and rerun the same command to recount it"
    try:
        info = json.loads((path / INFO_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # ValueError: bad JSON or bad UTF-8
        raise CheckpointError(f"{path}: unreadable partial ({err})", fix) from err
    if not isinstance(info, dict) or info.get("format_version") != FORMAT_VERSION:
        got = info.get("format_version") if isinstance(info, dict) else type(info).__name__
        raise CheckpointError(f"{path}: partial format {got}, expected {FORMAT_VERSION}", fix)
    arrays = info.get("arrays")
    if not isinstance(arrays, dict) or not all(
            isinstance(v, list) and len(v) == 2 and _is_count(v[0]) and isinstance(v[1], str) for v in arrays.values()):
        raise CheckpointError(f"{path / INFO_NAME}: arrays must map names to [length, dtype]", fix)
    return info


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


COUNT_DTYPES = ("uint32", "uint64")
# what np.load raises on a short or garbled .npy: ValueError/EOFError for the data, and the
# header is a Python literal parsed with ast, so a damaged one raises SyntaxError/TokenError
NPY_ERRORS = (OSError, ValueError, EOFError, SyntaxError, tokenize.TokenError)


def check_meta(meta, file: Path) -> dict:
    """Validate a stats dir's ``meta.json`` (types, ranges, one entry per order); returns it."""
    fix = "rebuild the stats dir with multitoken stats build"

    def bad(what: str):
        return CheckpointError(f"{file}: {what}", fix)

    if not isinstance(meta, dict):
        raise bad(f"holds a JSON {type(meta).__name__}, not an object")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{file}: stats format {meta.get('format_version')!r:.40}, this multitoken reads {FORMAT_VERSION}", fix)
    missing = [k for k in ("vocab_size", "orders", "total_tokens", "ngram_totals", "distinct", "count_dtypes",
                           "min_counts", "tokenizer") if k not in meta]
    if missing:
        raise bad(f"lacks {', '.join(missing)}")
    if not _is_count(meta["vocab_size"]) or meta["vocab_size"] < 1:
        raise bad(f"vocab_size must be an integer >= 1, got {meta['vocab_size']!r:.40}")
    orders = meta["orders"]
    if not (isinstance(orders, list) and orders and all(_is_count(o) for o in orders)
            and orders == list(range(1, len(orders) + 1)) and len(orders) <= MAX_ORDER):
        raise bad(f"orders must be [1, ..., N] with N <= {MAX_ORDER}, got {orders!r:.40}")
    keys = [str(o) for o in orders]
    for name, ok, what in (("ngram_totals", lambda v: _is_count(v) and v > 0, "integers > 0"),
                           ("distinct", _is_count, "integers >= 0"),
                           ("count_dtypes", lambda v: v in COUNT_DTYPES, f"one of {COUNT_DTYPES}"),
                           ("min_counts", lambda v: _is_count(v) and v >= 1, "integers >= 1")):
        table = meta[name]
        if not isinstance(table, dict) or sorted(table) != keys or not all(ok(table[k]) for k in keys):
            raise bad(f"{name} must map each order {keys} to {what}, got {table!r:.60}")
    if meta["total_tokens"] != meta["ngram_totals"]["1"]:
        raise bad(f"total_tokens {meta['total_tokens']!r:.20} differs from the unigram total {meta['ngram_totals']['1']}")
    tok = meta["tokenizer"]
    if not (isinstance(tok, dict) and isinstance(tok.get("fingerprint"), str) and isinstance(tok.get("name"), (str, type(None)))):
        raise bad("tokenizer must be an object with a fingerprint (text) and a name")
    if meta["vocab_size"] ** len(orders) >= KEY_LIMIT:
        raise bad(f"vocab_size {meta['vocab_size']} is too large for order-{len(orders)} keys")
    return meta


def load_array(path: Path, name: str, info: dict, mmap: bool = True) -> np.ndarray:
    """One array of an array dir, checked against the length and dtype recorded at write time."""
    file = Path(path) / f"{name}.npy"
    if name not in info["arrays"]:
        raise CheckpointError(f"{path / INFO_NAME} lists no array {name!r}", f"delete {path} and rerun the same command to recount it")
    length, dtype = info["arrays"][name]
    try:
        arr = np.load(file, mmap_mode="r" if mmap else None, allow_pickle=False)
    except NPY_ERRORS as err:
        raise CheckpointError(f"{file}: unreadable or truncated ({err})", f"delete {path} and rerun the same command to recount it") from err
    if arr.ndim != 1 or arr.shape[0] != length or str(arr.dtype) != dtype:
        raise CheckpointError(
            f"{file}: holds {arr.shape} {arr.dtype}, expected [{length}] {dtype} (truncated or replaced)",
            f"delete {path} and rerun the same command to recount it",
        )
    return arr
