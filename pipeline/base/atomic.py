"""Atomic file and directory output: readers see the old file or the whole new one, never a
partial write; replacing a directory touches only the entries we write. Also the lock file
every writer of a shared directory takes."""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import os
import shutil
import tempfile
from pathlib import Path
from multitoken.base.errors import UsageError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", encoding: str | None = "utf-8"):
    """Open a temp file beside ``path``; on success it is fsynced and renamed onto ``path``,
    on any error (or interrupt) it is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual mode
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_open(path, "w") as fh:
        fh.write(text)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path, "wb") as fh:
        fh.write(data)


# Directories ---------------------------------------------------------------------------------
def dir_mode() -> int:
    """The mode ``mkdir`` would give a new directory under the current umask."""
    return 0o777 & ~_umask()


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def remove_stale_staging(parent: Path, name: str) -> None:
    """Remove staging dirs ``.NAME.tmp-PID-*`` left in ``parent`` by killed processes."""
    for tmp in parent.glob(f".{name}.tmp-*"):
        pid = tmp.name[len(name) + 6:].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _owned(name: str, owned) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in owned)


def _replace_entry(src: Path, dst: Path) -> None:
    """``src`` takes the place of ``dst`` (a file: one rename; a directory: the old one is
    renamed aside first, since a rename cannot replace a non-empty directory)."""
    if dst.is_dir() and not dst.is_symlink():
        aside = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(dst, aside)
        os.replace(src, dst)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(src, dst)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(dirpath)


def publish_staging(staging: Path, path: Path, marker: str | None = None, owned: tuple[str, ...] = ()) -> None:
    """Move the complete ``staging`` dir to ``path``.

    A missing or empty ``path`` is replaced by one rename (atomic). An existing ``path`` keeps
    every entry we did not write: its ``marker`` (the file that says the output is complete) is
    removed first, each staged entry replaces its namesake, entries matching ``owned`` that the
    new output lacks (stale outputs of ours) are removed, and the new marker lands last. A reader
    therefore sees the old output, an unfinished one (no marker), or the new one; never a mix
    that claims to be complete.
    """
    _fsync_tree(staging)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        os.replace(staging, path)
        fsync_dir(path.parent)
        return
    if not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    new = {p.name for p in staging.iterdir()}
    if marker is not None:
        (path / marker).unlink(missing_ok=True)
    for entry in path.iterdir():
        if entry.name not in new and entry.name != marker and _owned(entry.name, owned):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    for name in sorted(new - {marker}):
        _replace_entry(staging / name, path / name)
    if marker in new:
        os.replace(staging / marker, path / marker)
    staging.rmdir()
    fsync_dir(path)


@contextlib.contextmanager
def atomic_dir(path: str | Path, marker: str | None = None, owned: tuple[str, ...] = ()):
    """Yield an empty staging dir beside ``path``; when the block ends without error its content
    is published to ``path`` (see ``publish_staging``: only our entries are replaced or
    removed), on any error or interrupt the staging dir is removed and ``path`` is untouched.

    The staging dir follows the umask (``mkdtemp`` would make it 0700) and is named
    ``.NAME.tmp-PID-*``: one left by a killed process is removed by the next call.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(path.parent, path.name)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent))
    try:
        os.chmod(staging, dir_mode())
        yield staging
        publish_staging(staging, path, marker, owned)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# Locks -------------------------------------------------------------------------------------
@contextlib.contextmanager
def lock_file(path: str | Path, what: str):
    """Hold an exclusive lock on ``path`` for the block; the file is created now and removed on
    release (the OS drops the lock itself if the process dies). A held lock raises UsageError
    naming the holder's pid."""
    path = Path(path)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UsageError(f"another process (pid {holder}) is writing {what}",
                             "wait for it to finish (or stop it), then rerun") from None
        try:  # the previous holder may have removed the file between our open and our lock
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        path.unlink(missing_ok=True)  # while still holding the lock: no one else can be using it
        os.close(fd)
