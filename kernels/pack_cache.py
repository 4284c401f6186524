"""Packed weights kept on disk: a model's linears packed once per machine, read back by later runs.

Why: packing a GGUF base (its codes looked up in the file or searched in the floats, then laid
out in the kernel's column blocks) costs seconds at every start; reading the packed tensors back
costs a file read.

What keys an entry (``$MULTITOKEN_CACHE/packed/<key>.safetensors``), so that nothing stale is
ever served:
- the weights themselves: an xxh3-128 digest of every packed weight's bytes, shape and dtype
  (content, not file names: a retrained head, a LoRA merge or a changed checkpoint is another key,
  and weights that came from no file are keyed the same way);
- where codes came from: the GGUF file's own digest (its bytes, so a changed GGUF is another key);
- the setting (``rows`` or ``rows-f32``) and whether narrow formats are on here;
- the layout: the kernel's lanes, the CPU level and feature flags, torch's version, and a digest
  of the kernels' sources (a change to any packing code is another key).

An entry is one safetensors file (never a pickle), written to a temp file beside it and renamed
into place; its metadata holds the key and, per tensor, its format and the digest of its packed
bytes. Reading checks all of them: a truncated, corrupt or foreign file is not used (the linears
are packed again and the entry rewritten). The most recently used entries are kept, up to
``MAX_BYTES`` in all.
Models under ``MIN_CACHED`` weights are not cached: packing them costs less than the file.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
import xxhash

from multitoken.base.atomic import atomic_open
from multitoken.embedded import cache_dir
from multitoken.kernels import cpu_features

VERSION = 1  # the entry's own layout (its metadata); bump when it changes
MIN_CACHED = 1_000_000  # weights packed in one call below which nothing is cached (packing them takes milliseconds)
MAX_BYTES = 2 << 30  # entries kept while their total stays under this (the least recently used go first)
SUFFIX = ".safetensors"
STALE_S = 3600  # a temp file this old is a dead writer's (a live one writes in seconds)
HERE = Path(__file__).parent


def folder() -> Path:
    """Where entries live: ``$MULTITOKEN_CACHE/packed`` (beside the fetched models and kernels)."""
    return cache_dir() / "packed"


def _bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


def digest(t: torch.Tensor) -> str:
    """A tensor's identity: xxh3-128 of its bytes, with its shape and dtype."""
    h = xxhash.xxh3_128(f"{tuple(t.shape)}:{t.dtype}:".encode())
    h.update(_bytes(t))
    return h.hexdigest()


def file_digest(path: str | Path) -> str:
    """xxh3-128 of a file's bytes (read once per process and file version: its size, and its
    modification and change times, the latter set by the system on every write, never by a user)."""
    st = Path(path).stat()
    return _file_digest(str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@functools.lru_cache(maxsize=8)
def _file_digest(path: str, size: int, mtime_ns: int, ctime_ns: int) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _sources() -> str:
    """Digest of every kernels source file: a change to the packing code or the C++ layout."""
    h = xxhash.xxh3_128()
    for path in sorted(HERE.glob("*.py")) + sorted(HERE.glob("*.cpp")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def layout(lanes: int) -> dict:
    """What the packed bytes depend on besides the weights (``lanes``: the kernel's block width)."""
    return {"version": VERSION, "lanes": lanes, "level": cpu_features.level(), "cpu": cpu_features.cpu_flags(),
            "torch": torch.__version__, "sources": _sources()}


def entry_key(digests: list[str], setting: dict) -> str:
    """The key of one packing: the weights' digests, in order, and what else shaped the result."""
    h = xxhash.xxh3_128(json.dumps(setting, sort_keys=True).encode())
    for d in digests:
        h.update(d.encode())
    return h.hexdigest()


def _path(key: str) -> Path:
    return folder() / f"{key}{SUFFIX}"


def load(key: str, digests: list[str]) -> dict[str, tuple[str, torch.Tensor]] | None:
    """``{weight digest: (format name, packed tensor)}`` of the entry ``key`` where it holds every
    digest asked for, each tensor's bytes matching the digest recorded at write; else None."""
    from safetensors import SafetensorError, safe_open

    path = _path(key)
    if path.is_symlink() or not path.is_file():
        return None
    found = {}
    try:
        with safe_open(str(path), framework="pt") as fh:  # a truncated file fails its header check here
            meta = json.loads((fh.metadata() or {})["entry"])
            if not isinstance(meta, dict) or meta.get("key") != key or not isinstance(meta.get("tensors"), dict):
                return None
            names = set(fh.keys())
            for d in digests:
                record = meta["tensors"].get(d)
                if d not in names or not isinstance(record, dict):
                    return None
                tensor = fh.get_tensor(d).clone()  # memory of its own: the file may be replaced later
                if digest(tensor) != record.get("digest"):
                    return None
                found[d] = (record.get("format"), tensor)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError):
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # recently used: pruned last
    return found


def store(key: str, packed: dict[str, tuple[str, torch.Tensor]]) -> None:
    """Write the entry ``key`` (``{weight digest: (format name, packed tensor)}``) atomically; a
    cache that cannot be written is said once on stderr and decoding goes on."""
    from safetensors.torch import save

    tensors = {d: t.contiguous() for d, (_, t) in packed.items()}
    meta = {"key": key, "tensors": {d: {"format": name, "digest": digest(t)} for d, (name, t) in packed.items()}}
    try:
        data = save(tensors, metadata={"entry": json.dumps(meta)})
        with atomic_open(_path(key), "wb") as fh:
            fh.write(data)
        _prune()
    except OSError as err:
        print(f"multitoken: the packed weights were not cached in {folder()} ({err.strerror or err}); "
              "the next run packs them again", file=sys.stderr)


def _prune() -> None:
    """Keep the most recently used entries up to ``MAX_BYTES`` in all (the newest always), and no
    temp file of a writer that died (``atomic_open``'s ``.NAME.*`` beside the entry) older than
    ``STALE_S``."""
    now = time.time()
    for tmp in folder().glob(f".*{SUFFIX}.*"):
        with contextlib.suppress(OSError):
            if tmp.is_file() and now - tmp.stat().st_mtime > STALE_S:
                tmp.unlink()
    entries = sorted(((p.stat(), p) for p in folder().glob(f"*{SUFFIX}") if p.is_file() and not p.is_symlink()),
                     key=lambda e: e[0].st_mtime_ns, reverse=True)
    total = 0
    for i, (st, path) in enumerate(entries):
        total += st.st_size
        if i and total > MAX_BYTES:
            path.unlink(missing_ok=True)
