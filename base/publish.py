"""Publishing an output: built complete in a staging dir beside it, then swapped in all or
nothing (``atomic.swap_entries``), with a record of its files (``manifest``).

``staged_output(dir, kind, command)`` and ``staged_file(file, kind, command)`` are what every
writing command uses. The new record lists the staged files (plus the old listed files the
caller keeps); of the old output only files its record lists, still as written, are replaced
or removed; a staged file whose name is taken by anything else stops the publish before any
change. ``claim_work`` / ``drop_work`` record the work directories a resumable job manages in
place (``stats build``'s ``partials/``).

Imports nothing of ours but base modules.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Callable

from multitoken.base.atomic import UnfinishedSwap, empty_dir, fsync_dir, fsync_tree, new_staging, swap_entries
from multitoken.base.errors import OutputError, UsageError
from multitoken.base.manifest import (MANIFEST, SIDECAR_SUFFIX, inside, new_record, read_record, scan, still_ours,
                                      top_names, work_dir_ours, write_record)


def _real(path: str | Path) -> Path:
    """The path with its parent's symlinks resolved (the output itself stays as named)."""
    p = Path(os.path.abspath(Path(path).expanduser()))
    return p.parent.resolve() / p.name


def _old_record(dest: Path, record_rel: str, kind: str) -> dict | None:
    record = read_record(dest / record_rel, str(dest)) if dest.is_dir() else None
    if record is not None and record["kind"] != kind:
        raise UsageError(f"{dest / record_rel} records an output of another kind ({record['kind']}, not {kind})",
                         "write to another place")
    return record


def _refuse_conflicts(dest: Path, new: list[str], ours: dict, old: dict | None) -> None:
    """A staged file may only land where nothing is, or on an old file its record lists."""
    covered = top_names(old) if old else set()
    for rel in new:
        if rel in ours:
            continue
        path, top = inside(dest, rel), Path(rel).parts[0]
        if path is None or os.path.lexists(path) or (rel != top and os.path.lexists(dest / top) and top not in covered):
            raise UsageError(f"{dest / rel} exists and multitoken has no record of writing it",
                             "move it away (multitoken never replaces files it did not write), or write somewhere else")


def publish(staging: Path, dest: Path, record_rel: str, kind: str, command: str, *, whole_dir: bool,
            keep: Callable[[str], bool] | None = None, marker: str | None = None) -> None:
    """Move the complete ``staging`` into ``dest`` with a new record at ``dest/record_rel``.

    ``whole_dir``: ``dest`` is the output itself (missing or empty: one rename); else ``dest``
    is the directory a single-file output sits in. ``keep(rel)``: old listed files that stay
    listed (files the job wrote in place). ``marker``: the file readers take as "complete"; it
    leaves first and lands last (just before the record).
    """
    old = _old_record(dest, record_rel, kind)
    new_files = scan(staging)
    ours = {rel: e for rel, e in (old["files"] if old else {}).items() if still_ours(dest, rel, e, exact=True)}
    kept = {rel: e for rel, e in ours.items() if keep is not None and keep(rel) and rel not in new_files}
    work = old["work"] if old else []  # claimed by a running job: kept until it drops them
    write_record(staging / record_rel, new_record(kind, command, {**kept, **new_files}, work))
    fsync_tree(staging)
    if whole_dir and (not os.path.lexists(dest) or empty_dir(dest)):
        os.replace(staging, dest)
        fsync_dir(dest.parent)
        return
    if whole_dir and not dest.is_dir():
        raise UsageError(f"{dest} exists and is not a directory", "pass a new or empty directory")
    _refuse_conflicts(dest, list(new_files), ours, old)
    leaving = sorted(rel for rel in ours if rel not in kept)
    first = [marker] if marker in leaving else []
    old_order = ([record_rel] if old else []) + first + [rel for rel in leaving if rel not in first]
    last = [marker] if marker in new_files else []
    new_order = [rel for rel in sorted(new_files) if rel not in last] + last + [record_rel]
    backup_parent, name = (dest.parent, dest.name) if whole_dir else (dest, record_rel[:-len(SIDECAR_SUFFIX)])
    try:
        swap_entries(staging, dest, old_order, new_order, backup_parent, name)
    except UnfinishedSwap as err:
        raise OutputError(f"could not replace the output in {dest}, and {err}", "move those files back by hand") from None
    except OSError as err:
        where = f" ({err.filename})" if err.filename else ""
        raise OutputError(f"could not replace the output in {dest}: {err.strerror or err}{where}; the old output is unchanged",
                          "make its files writable (or free the disk), then rerun") from None
    shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def staged_output(path: str | Path, kind: str, command: str, *, keep: Callable[[str], bool] | None = None,
                  marker: str | None = None):
    """Yield an empty staging dir beside the output directory ``path``; when the block ends
    without error, publish it (see ``publish``); on any error or interrupt remove it, leaving
    ``path`` exactly as it was."""
    dest = _real(path)
    staging = new_staging(dest.parent, dest.name)
    try:
        yield staging
        publish(staging, dest, MANIFEST, kind, command, whole_dir=True, keep=keep, marker=marker)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@contextlib.contextmanager
def staged_file(path: str | Path, kind: str, command: str):
    """The same for a single-file output ``path``: the block writes ``staging / path.name``
    (and any ``path.name + suffix`` files beside it, e.g. its config); the record is
    ``path.name + .multitoken.json`` beside the file."""
    dest = _real(path)
    staging = new_staging(dest.parent, dest.name)
    try:
        yield staging
        publish(staging, dest.parent, dest.name + SIDECAR_SUFFIX, kind, command, whole_dir=False)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def claim_work(dest: str | Path, kind: str, command: str, names: tuple[str, ...]) -> None:
    """Record ``names`` as work directories of the job writing ``dest`` (made if missing) before
    the job makes them; an entry of that name that the record does not list is refused."""
    dest = _real(dest)
    dest.mkdir(parents=True, exist_ok=True)
    record = _old_record(dest, MANIFEST, kind) or new_record(kind, command, {}, [])
    taken = [n for n in names if n not in record["work"] and os.path.lexists(dest / n)]
    if taken:
        raise UsageError(f"{dest / taken[0]} exists and multitoken has no record of writing it",
                         "move it away (multitoken never removes files it did not write), then rerun")
    record["work"] = sorted(set(record["work"]) | set(names))
    write_record(dest / MANIFEST, record)


def drop_work(dest: str | Path, kind: str, name: str) -> None:
    """Forget the work directory ``name`` once the job has removed it."""
    dest = _real(dest)
    record = _old_record(dest, MANIFEST, kind)
    if record is not None and name in record["work"] and not os.path.lexists(dest / name):
        record["work"].remove(name)
        write_record(dest / MANIFEST, record)


def remove_work(dest: str | Path, kind: str, name: str) -> None:
    """Remove the work directory ``name`` of ``dest`` if its record lists it and it is a real
    directory (never through a symlink), then forget it."""
    dest = _real(dest)
    record = _old_record(dest, MANIFEST, kind)
    if record is not None and name in record["work"] and work_dir_ours(dest, name):
        shutil.rmtree(dest / name, ignore_errors=True)
    drop_work(dest, kind, name)
