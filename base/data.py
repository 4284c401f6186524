"""Read corpora as documents of token ids, the same way for training, stats and evaluation.

A data spec is a local file, a directory or glob of files (``.jsonl``, ``.jsonl.zst``,
``.parquet``, ``.txt``), or a Hugging Face Hub dataset id (read with ``streaming=True``).
Rows carry either text (tokenized here) or token ids already (e.g. the Pile sample
``EleutherAI/pile-deduped-pythia-random-sampled``). A ``.txt`` file is one document.

Documents are numbered in one deterministic order, so that a job can be split into shards
(``shard=(i, n)`` takes documents ``i, i+n, ...``) and resumed from a document index.

Local folders have splits as on the Hub (``datasets``' conventions): a file belongs to the
split whose keyword its folder names, or else its file name, contain as a word (``train`` /
``training``; ``validation`` / ``valid`` / ``val`` / ``dev``; ``test`` / ``testing`` / ``eval``
/ ``evaluation``), e.g. ``train_00.jsonl``, ``val.jsonl``, ``data/test/part-1.parquet``. A
folder without such names, a single file or a glob is all ``train``: another ``--split`` is
refused. A ``X.jsonl`` beside ``X.jsonl.zst`` is the same content: the ``.zst`` is read (the
file as published; its frames reveal a truncated copy, which a decompressed one may be) and
the ``.jsonl`` is skipped, which ``describe_files`` reports. Reading one file by its format:
``data_formats.py``.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from multitoken.base.data_formats import SUFFIXES, file_rows, json_kind, suffix
from multitoken.base.errors import DataError, UsageError
from multitoken.base.hub import looks_like_path, offline_reason  # shared with --base

ID_COLUMNS = ("input_ids", "token_ids", "tokens", "ids")
TEXT_COLUMNS = ("text", "content")
TOKENIZE_BATCH = 256
# datasets' split keywords (data_files.py): a keyword counts as a word bounded by these characters
SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_SEP = r"[-._ 0-9]"


@dataclass
class DataConfig:
    """Where the corpus comes from. Drives the ``--data/--split/--column`` flags."""

    data: str | None = field(default=None, metadata={"help": "local file, directory or glob (jsonl, jsonl.zst, parquet, txt) or a Hub dataset id"})
    split: str = field(default="train", metadata={"help": "dataset split: train, validation or test (local folders: files or folders named so, as on the Hub)"})
    column: str | None = field(default=None, metadata={"help": f"text or token-id column (default: the first of {', '.join(ID_COLUMNS + TEXT_COLUMNS)} present)"})
    max_tokens: int | None = field(default=None, metadata={"help": "stop after this many tokens"})


@dataclass
class LocalFiles:
    """The local files a data spec reads, after split selection and de-duplication."""

    files: list[Path]  # read, in this order
    skipped: list[tuple[Path, Path]] = field(default_factory=list)  # (not read, same content as)
    split: str | None = None  # the split selected in a folder with splits, None: no splits


def _split_of(name: str) -> str | None:
    """The split whose keyword ``name`` (a file or folder name) holds as a word, if any."""
    for split, words in SPLIT_KEYWORDS.items():
        if any(re.search(rf"(^|{_SEP}){w}({_SEP}|$)", name) for w in words):
            return split
    return None


def canonical_split(split: str) -> str:
    """``val`` -> ``validation`` etc.; slicing (``train[:10%]``) is a Hub feature only."""
    if "[" in split:
        raise UsageError(f"--split {split!r}: slicing a split works only for Hub datasets",
                         "pass the split name alone (train, validation or test), and --max-tokens to read less")
    return next((s for s, words in SPLIT_KEYWORDS.items() if split == s or split in words), split)


def _select_split(root: Path, files: list[Path], split: str, spec: str) -> tuple[list[Path], str | None]:
    """The files of ``split`` in the folder ``root``: folder names decide when any names a
    split, else file names, as ``datasets`` does; no names at all: everything is train."""
    rel = [f.relative_to(root) for f in files]
    by_dir = [next((s for s in map(_split_of, r.parts[:-1]) if s), None) for r in rel]
    splits = by_dir if any(by_dir) else [_split_of(r.name) for r in rel]
    want = canonical_split(split)
    if not any(splits):
        if want != "train":
            raise UsageError(f"--split {split}: {spec!r} has no splits (no file or folder named train, validation or test), "
                             "so all of it is the train split", "drop --split, or point --data at the files you want")
        return files, None
    chosen = [f for f, s in zip(files, splits) if s == want]
    if not chosen:
        found = ", ".join(sorted({s for s in splits if s}))
        raise UsageError(f"{spec!r} has no {want} split (it has: {found})", f"pass --split with one of: {found}")
    return chosen, want


def _dedupe(files: list[Path]) -> tuple[list[Path], list[tuple[Path, Path]]]:
    """Drop ``X.jsonl`` when ``X.jsonl.zst`` is read too: the same documents twice."""
    present = set(files)
    skipped = [(f, f.with_name(f.name + ".zst")) for f in files if f.with_name(f.name + ".zst") in present]
    gone = {f for f, _ in skipped}
    return [f for f in files if f not in gone], skipped


def local_files(cfg: DataConfig) -> LocalFiles | None:
    """The local files ``cfg`` reads (sorted, split selected, de-duplicated), or None when
    ``cfg.data`` is not local (a Hub id)."""
    if not cfg.data:
        raise UsageError("no data given", "pass --data FILE|DIR|GLOB|HUB_ID")
    spec = cfg.data
    p = Path(spec).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and suffix(f))
        if not files:
            raise DataError(f"directory {spec!r} holds no {', '.join(SUFFIXES)} files", "point --data at the data files")
        files, split = _select_split(p, files, cfg.split, spec)
    elif p.is_file():
        if not suffix(p):
            raise DataError(f"unsupported file type: {spec!r}", f"use one of {', '.join(SUFFIXES)}")
        files, split = [p], None
    elif any(ch in spec for ch in "*?["):
        files = sorted(Path(f) for f in glob.glob(spec, recursive=True) if suffix(Path(f)))
        if not files:
            raise DataError(f"glob {spec!r} matches no data files", "check the pattern")
        split = None
    elif looks_like_path(spec) or suffix(p):  # no Hub retries for a mistyped file name
        raise DataError(f"data path {spec!r} not found: no such file or directory",
                        "check the path (--data takes a local file, directory or glob, or a Hub dataset id such as owner/name)")
    else:
        return None
    if split is None and canonical_split(cfg.split) != "train":
        raise UsageError(f"--split {cfg.split}: {spec!r} names files, which have no splits (all of it is the train split)",
                         "drop --split, or point --data at the files you want")
    files, skipped = _dedupe(files)
    return LocalFiles(files, skipped, split)


def check_hub_reachable(cfg: DataConfig) -> None:
    """A streamed Hub dataset needs the Hub: say so at once, not after the library's retries."""
    offline = offline_reason()
    if offline is not None:
        raise DataError(f"{cfg.data!r} is not a local path, and the Hub dataset of that name cannot be streamed: "
                        f"the Hub is unreachable ({offline})", "check the path (a local file or folder), or connect to the network")


def describe_files(cfg: DataConfig) -> tuple[list[str] | None, list[str]]:
    """(the files read, as strings, or None for a Hub dataset; lines saying so, for stderr).
    Runs before any work, so an unreachable Hub dataset fails here."""
    found = local_files(cfg)
    if found is None:
        check_hub_reachable(cfg)
        return None, [f"data: Hub dataset {cfg.data!r}, split {cfg.split!r}"]
    split = f"split {found.split!r}: " if found.split else ""
    lines = [f"data: {split}reading {len(found.files)} file{'s' if len(found.files) != 1 else ''}"]
    lines += [f"  {f}" for f in found.files]
    lines += [f"data: skipped {skip} (same content as {kept})" for skip, kept in found.skipped]
    return [str(f) for f in found.files], lines


def count_files(cfg: DataConfig) -> int:
    """How many files the corpus is read from: local files, or a Hub dataset's data files (the
    streamed dataset's shards). ``iter_rows(files=...)`` reads a contiguous group of them."""
    found = local_files(cfg)
    return len(found.files) if found is not None else _open_hub(cfg).num_shards


def iter_rows(cfg: DataConfig, files: tuple[int, int, int] | None = None) -> Iterator[dict]:
    """Raw rows (dicts) of the corpus, in a deterministic order. ``files=(first, end, total)``:
    only the rows of files ``first..end-1`` of the ``total`` that ``count_files`` gives (a
    different total now is refused: the listing changed since the job was planned)."""
    found = local_files(cfg)
    if found is not None:
        for f in _file_group(found.files, files, cfg):
            yield from file_rows(f)
        return
    ds = _open_hub(cfg)
    if files is None:
        yield from ds
        return
    for f in _file_group(range(ds.num_shards), files, cfg):  # shard f of num_shards: data file f
        yield from ds.shard(num_shards=ds.num_shards, index=f, contiguous=True)


def _file_group(items, files: tuple[int, int, int] | None, cfg: DataConfig):
    if files is None:
        return items
    first, end, total = files
    if len(items) != total:
        raise DataError(f"{cfg.data!r} now has {len(items)} data files, the job was planned on {total}",
                        "restore the files, or count the new set into another --out")
    return items[first:end]


def _open_hub(cfg: DataConfig):
    import datasets

    check_hub_reachable(cfg)
    try:
        ds = datasets.load_dataset(cfg.data, split=cfg.split, streaming=True)
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as err:
        raise DataError(
            f"{cfg.data!r} is not a local path and could not be opened as a Hub dataset ({type(err).__name__}: {err})",
            "check the path or dataset id; without network access, download the data and pass its local path",
        ) from err
    return ds


def pick_column(row: dict, column: str | None) -> tuple[str, bool]:
    """(column name, holds token ids?) for a row, auto-detected unless ``column`` is given."""
    if column is not None:
        if column not in row:
            raise DataError(f"column {column!r} not found; the data has columns {sorted(row)}", "pass --column with one of those")
        value = row[column]
        return column, isinstance(value, (list, tuple, np.ndarray)) and not _all_strings(value)
    for c in ID_COLUMNS:
        if c in row:
            return c, True
    for c in TEXT_COLUMNS:
        if c in row:
            return c, False
    raise DataError(
        f"no text or token-id column found; the data has columns {sorted(row)}",
        f"pass --column NAME (looked for {', '.join(ID_COLUMNS + TEXT_COLUMNS)})",
    )


def _all_strings(value) -> bool:
    return len(value) > 0 and all(isinstance(v, str) for v in value)


def _flat_ints(value) -> np.ndarray | None:
    """``value`` as a 1-D integer array, or None when it is not a flat list of integers."""
    try:
        ids = np.asarray(value)
    except (ValueError, TypeError, OverflowError):  # ragged lists, ints past int64
        return None
    return ids if ids.ndim == 1 and (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)) else None


def _what(value) -> str:
    if not isinstance(value, (list, tuple)):
        return f"a JSON {json_kind(value)}"
    return "a list of strings" if _all_strings(value) else "a nested or mixed list"


def _as_text(value, name: str, where: str) -> str:
    """A text cell: a string (null: an empty document). A list of strings is not token ids."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, (list, tuple)) and _all_strings(value):
        raise DataError(f"{where}: column {name!r} holds a list of strings, not one text",
                        "join the pieces into one string per row (or pass --column with a text or token-id column)")
    raise DataError(f"{where}: column {name!r} holds a JSON {json_kind(value)}, not text",
                    "store the text as a string, or pass --column with a text or token-id column")


def _as_ids(value, vocab_size: int | None, where: str) -> np.ndarray:
    ids = _flat_ints(value)
    if ids is None:
        raise DataError(f"{where}: token-id column must hold a flat list of integers (e.g. [464, 3290, 13]), "
                        f"got {_what(value)}", "pass the text column with --column instead")
    ids = ids.astype(np.int64, copy=False)
    if ids.size and (ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size)):
        raise DataError(
            f"{where}: token ids outside the vocabulary [0, {vocab_size}) (min {ids.min()}, max {ids.max()})",
            "the ids were made by another tokenizer; pass the matching --tokenizer",
        )
    return ids


def _documents(cfg: DataConfig, tokenizer, vocab_size: int | None, shard: tuple[int, int], start: int,
               files: tuple[int, int, int] | None):
    index, count = shard
    column: tuple[str, bool] | None = None
    pending: list[tuple[int, str]] = []
    seen = False

    def flush():
        encoded = tokenizer([t for _, t in pending], add_special_tokens=False)["input_ids"]
        out = [(i, np.asarray(e, dtype=np.int64)) for (i, _), e in zip(pending, encoded)]
        pending.clear()
        return out

    for doc_index, row in enumerate(iter_rows(cfg, files)):
        seen = True
        if doc_index < start or doc_index % count != index:
            continue
        column = column or pick_column(row, cfg.column)
        name, is_ids = column
        if name not in row:
            raise DataError(f"row {doc_index} has no column {name!r} (columns: {sorted(row)})")
        if is_ids:
            yield doc_index, _as_ids(row[name], vocab_size, f"row {doc_index}")
            continue
        text = _as_text(row[name], name, f"row {doc_index}")
        if tokenizer is None:
            raise UsageError("the data holds text but no tokenizer was given", "pass --tokenizer (or --base)")
        pending.append((doc_index, text))
        if len(pending) >= TOKENIZE_BATCH:
            yield from flush()
    if pending:
        yield from flush()
    if not seen and files is None:  # one empty file of a group is no error: the job checks its total
        raise DataError(f"{cfg.data!r} holds no rows", "check the data spec and --split")


def iter_documents(
    cfg: DataConfig,
    tokenizer=None,
    *,
    vocab_size: int | None = None,
    shard: tuple[int, int] = (0, 1),
    start: int = 0,
    files: tuple[int, int, int] | None = None,
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(document index, token ids # [len])`` for this shard, from index ``start`` on.

    ``files=(first, end, total)`` reads only those files (see ``iter_rows``); documents are then
    numbered from 0 at the first of them, and ``shard`` applies to that numbering.

    Text is tokenized in batches without special tokens; id rows are checked against
    ``vocab_size`` (default: the tokenizer's). ``cfg.max_tokens`` bounds the tokens yielded
    (the last document is cut to fit).
    """
    if not 0 <= shard[0] < shard[1]:
        raise UsageError(f"shard {shard[0]}/{shard[1]} does not exist", "use --shard I/N with 0 <= I < N")
    if vocab_size is None and tokenizer is not None:
        vocab_size = len(tokenizer)
    budget = cfg.max_tokens if cfg.max_tokens is not None else None
    for doc_index, ids in _documents(cfg, tokenizer, vocab_size, shard, start, files):
        if budget is not None:
            if budget <= 0:
                return
            ids = ids[:budget]
            budget -= len(ids)
        yield doc_index, ids
