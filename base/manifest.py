"""Records of what a command wrote: ownership is by record, never by name.

Every output carries a record (JSON): the command, the package version, the kind of output,
and each file it wrote (path relative to the output, size, sha256), plus the work directories
a running job manages itself (``stats build``'s ``partials/``). A directory output keeps it in
``multitoken_manifest.json``; a single-file output ``F`` beside it in ``F.multitoken.json``.
Only files a record lists are ever replaced or removed; a listed file that is no longer the
regular file of the recorded size (replaced, turned into a symlink or a folder) is not ours any
more. Paths are checked component by component, so nothing is reached through a symlink.

Imports nothing of ours but ``errors`` and ``atomic`` (base layer).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from multitoken.base.atomic import atomic_write_text
from multitoken.base.errors import UsageError

MANIFEST = "multitoken_manifest.json"
SIDECAR_SUFFIX = ".multitoken.json"
RECORD_FORMAT = 1


def sidecar(path: str | Path) -> Path:
    """The record beside a single-file output."""
    return Path(str(path) + SIDECAR_SUFFIX)


def file_entry(path: Path) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return {"size": os.lstat(path).st_size, "sha256": digest.hexdigest()}


def scan(root: Path) -> dict[str, dict]:
    """Every regular file under ``root`` (a staging dir we filled): ``{relative path: entry}``.
    Symlinks are not followed (our writers make none)."""
    files = {}
    for dirpath, dirs, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            if stat.S_ISREG(os.lstat(path).st_mode):
                files[path.relative_to(root).as_posix()] = file_entry(path)
    return files


def new_record(kind: str, command: str, files: dict[str, dict], work: list[str] | None = None) -> dict:
    from importlib.metadata import version

    return {"record_format": RECORD_FORMAT, "kind": kind, "command": command,
            "multitoken_version": version("multitoken"), "files": dict(sorted(files.items())),
            "work": sorted(set(work or ()))}


def read_record(path: Path, shown: str) -> dict | None:
    """The record at ``path``; None when there is none. A damaged one is refused (nothing of
    that output can then be proven ours)."""
    if not path.exists() and not path.is_symlink():
        return None
    fix = f"move {shown} away or delete it, then rerun"
    try:
        if path.is_symlink() or not path.is_file():
            raise ValueError("not a regular file")
        record = json.loads(path.read_text(encoding="utf-8"))
        ok = (isinstance(record, dict) and isinstance(record.get("files"), dict) and isinstance(record.get("kind"), str)
              and isinstance(record.get("work", []), list))
    except (OSError, ValueError) as err:
        raise UsageError(f"{path} (the record of what multitoken wrote in {shown}) is damaged ({err})", fix) from None
    if not ok:
        raise UsageError(f"{path} (the record of what multitoken wrote in {shown}) is damaged", fix)
    bad = [rel for rel in [*record["files"], *record.get("work", [])] if not _relative(rel)]
    if bad:
        raise UsageError(f"{path} lists {bad[0]!r}, which is not a path inside {shown}", fix)
    return record


def write_record(path: Path, record: dict) -> None:
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")


def _relative(rel) -> bool:
    parts = Path(rel).parts if isinstance(rel, str) else ()
    return bool(parts) and not Path(rel).is_absolute() and ".." not in parts and "." not in parts


def inside(root: Path, rel: str) -> Path | None:
    """``root/rel`` when no component of ``rel`` but the last is a symlink or a non-directory
    (so the path cannot lead out of ``root``); else None. The last component may be absent."""
    path = root
    parts = Path(rel).parts
    for i, part in enumerate(parts):
        path = path / part
        if i < len(parts) - 1:
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                return root.joinpath(*parts)  # absent below here: nothing to follow
            if not stat.S_ISDIR(mode):
                return None
    return path


def still_ours(root: Path, rel: str, entry: dict, exact: bool = False) -> bool:
    """``root/rel`` is the regular file of the recorded size, reached without a symlink; with
    ``exact`` also of the recorded sha256 (what a publish checks before it replaces or removes
    the file; the early checks of a command look at sizes only, which cost nothing)."""
    path = inside(root, rel)
    try:
        st = os.lstat(path) if path is not None else None
    except FileNotFoundError:
        return False
    if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != entry.get("size"):
        return False
    return not exact or file_entry(path)["sha256"] == entry.get("sha256")


def work_dir_ours(root: Path, name: str) -> bool:
    """A listed work dir is ours while it is a real directory (not a symlink)."""
    path = inside(root, name)
    return path is not None and path.is_dir() and not path.is_symlink()


def top_names(record: dict) -> set[str]:
    """The entries of an output's directory its record covers (first path components)."""
    return {Path(rel).parts[0] for rel in [*record["files"], *record.get("work", [])]}
