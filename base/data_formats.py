"""Rows of one corpus file, by format: ``.txt`` (one document), ``.jsonl`` / ``.json`` (one
JSON object a line), ``.jsonl.zst`` (the same, zstd-compressed, every frame) and ``.parquet``.
A damaged file (not UTF-8, not JSON, a truncated zstd frame, an unreadable parquet) is named in
one line with its fix. Which files a data spec reads, and what a row's cells mean: ``data.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from multitoken.base.errors import DataError

SUFFIXES = (".jsonl.zst", ".jsonl", ".json", ".parquet", ".txt")


def suffix(path: Path) -> str | None:
    """The data format of ``path`` (one of ``SUFFIXES``), None when it is no data file."""
    name = path.name.lower()
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def _iter_jsonl(lines, name: str) -> Iterator[dict]:
    """Rows of a jsonl stream (``lines``: its raw byte lines), each a JSON object."""
    for lineno, raw in enumerate(lines, 1):
        line = _utf8(raw, f"{name}:{lineno}")
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{name}:{lineno}: not valid JSON ({err.msg})", "each line must be one JSON object") from err
        if not isinstance(row, dict):
            raise DataError(f"{name}:{lineno}: holds a JSON {json_kind(row)}, not an object",
                            'each line must be one JSON object, e.g. {"text": "..."} or {"input_ids": [1, 2, 3]}')
        yield row


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{where}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start})",
                        "re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from err


def json_kind(value) -> str:
    """The JSON name of a value's type, for messages."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "list", dict: "object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _zstd_lines(path: Path) -> Iterator[bytes]:
    """Byte lines of a ``.zst`` file, every frame. zstandard's stream reader ends quietly at
    a cut inside a frame ("no rows"); a frame left unfinished here says truncated."""
    import zstandard

    dctx, tail = zstandard.ZstdDecompressor(), b""
    obj, mid_frame = dctx.decompressobj(), False
    try:
        with open(path, "rb") as raw:
            while chunk := raw.read(1 << 20):
                while chunk:
                    mid_frame = True
                    tail += obj.decompress(chunk)
                    chunk = b""
                    if obj.eof:  # the next frame starts in what this one left over
                        chunk, obj, mid_frame = obj.unused_data, dctx.decompressobj(), False
                    *lines, tail = tail.split(b"\n")
                    yield from lines
    except zstandard.ZstdError as err:
        raise DataError(f"{path}: corrupt zstd stream ({err})", "re-download or re-compress the file") from err
    if mid_frame:
        raise DataError(f"{path}: truncated or corrupt zstd file (it ends inside a frame)",
                        "re-download the file, or re-compress it with zstd")
    if tail:
        yield tail


def file_rows(path: Path) -> Iterator[dict]:
    """The rows of one data file, in file order, each a dict."""
    kind = suffix(path)
    if kind == ".txt":
        yield {"text": _utf8(path.read_bytes(), str(path))}
    elif kind in (".jsonl", ".json"):
        with open(path, "rb") as fh:
            yield from _iter_jsonl(fh, str(path))
    elif kind == ".jsonl.zst":
        yield from _iter_jsonl(_zstd_lines(path), str(path))
    elif kind == ".parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as err:  # pyarrow raises several unrelated types for bad files
            raise DataError(f"{path}: unreadable parquet file ({err})") from err
        for batch in pf.iter_batches(batch_size=1024):
            yield from batch.to_pylist()
