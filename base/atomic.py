"""Atomic files and directories: readers see the old file or the whole new one, never a
partial write. ``swap_entries`` is the one all-or-nothing move of an output's files (the
transaction ``publish`` builds on); ``output_lock`` the one lock every writing command takes."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
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
    """Remove the staging (``.NAME.tmp-PID-*``) and backup (``.NAME.old-PID-*``: files
    ``swap_entries`` moved aside) dirs left in ``parent`` by killed processes. A whole dir
    ``swap_dir`` moved aside (``.NAME.aside-PID-*``) is the only copy when ``NAME`` is gone (killed
    between its two renames): it is renamed back then, else removed."""
    target = parent / name
    for tmp in [*parent.glob(f".{name}.tmp-*"), *parent.glob(f".{name}.old-*"), *parent.glob(f".{name}.aside-*")]:
        kind, _, rest = tmp.name[len(name) + 2:].partition("-")
        pid = rest.split("-", 1)[0]
        if not pid.isdigit() or _pid_alive(int(pid)) or tmp.is_symlink():
            continue
        if kind == "aside" and not os.path.lexists(target):
            try:  # nothing at the destination: the old output returns whole
                os.rename(tmp, target)
            except OSError:  # a file or a non-empty dir appeared there meanwhile (rename refuses both): leave them
                pass
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def new_staging(parent: Path, name: str) -> Path:
    """An empty staging dir ``.NAME.tmp-PID-*`` in ``parent`` (made if missing), following the
    umask (``mkdtemp`` would make it 0700); stale ones of killed processes are removed first."""
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(parent, name)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-{os.getpid()}-", dir=parent))
    os.chmod(staging, dir_mode())
    return staging


def fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(dirpath)


def empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def swap_dir(staging: Path, path: Path) -> None:
    """``staging`` takes the place of ``path`` whole: a missing or empty ``path`` by one rename;
    else the old dir is renamed aside, the new one in, and the old one removed (renamed back if
    the new one cannot go in)."""
    if not path.exists() and not path.is_symlink() or empty_dir(path):
        os.replace(staging, path)
    else:
        if path.is_symlink() or not path.is_dir():
            raise NotADirectoryError(f"{path} exists and is not a directory")
        aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.aside-{os.getpid()}-", dir=path.parent))
        os.replace(path, aside)
        try:
            os.replace(staging, path)
        except BaseException:
            os.replace(aside, path)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_dir(path: str | Path):
    """Yield an empty staging dir beside ``path``; when the block ends without error it takes
    the place of ``path`` whole (``swap_dir``), on any error or interrupt it is removed and
    ``path`` is untouched. For directories inside an output we own (a checkpoint's step dir, a
    shard's run); an output beside the user's files is published by ``publish.staged_output``."""
    path = Path(path)
    staging = new_staging(path.parent, path.name)
    try:
        yield staging
        fsync_tree(staging)
        swap_dir(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _move(src: Path, dst: Path, done: list, made: list) -> None:
    """Rename ``src`` to ``dst`` (never over an existing entry), making ``dst``'s parents."""
    missing = [p for p in reversed(dst.parents) if not p.exists()]
    for parent in missing:
        parent.mkdir(mode=dir_mode())
        made.append(parent)
    if os.path.lexists(dst):
        raise FileExistsError(f"{dst} exists")
    os.rename(src, dst)
    done.append((src, dst))


def _undo(done: list, made: list) -> list[Path]:
    """Reverse the renames and directory creations; returns the entries it could not put back."""
    stuck = []
    for src, dst in reversed(done):
        try:
            os.rename(dst, src)
        except OSError:
            stuck.append(src)
    for path in reversed(made):
        with contextlib.suppress(OSError):
            path.rmdir()
    return stuck


class UnfinishedSwap(OSError):
    """A failed swap whose undo failed too: the backup dir holds what could not be put back."""


def swap_entries(staging: Path, dest: Path, old: list[str], new: list[str], backup_parent: Path, name: str) -> None:
    """All or nothing: the files ``old`` (paths relative to ``dest``) leave ``dest`` and the files
    ``new`` (relative to ``staging``) take their places. ``old`` is moved aside into a backup dir
    in the order given, then ``new`` is moved in in the order given (callers put the record that
    marks the output complete first in ``old`` and last in ``new``); if any move fails, every
    move so far is undone and the error raised, so ``dest`` is exactly as it was. Only then is
    the backup removed, with the directories the old files leave empty. ``backup_parent`` must
    be on ``dest``'s filesystem."""
    backup = Path(tempfile.mkdtemp(prefix=f".{name}.old-{os.getpid()}-", dir=backup_parent))
    done: list[tuple[Path, Path]] = []
    made: list[Path] = []
    try:
        for rel in old:
            _move(dest / rel, backup / rel, done, made)
        for rel in new:
            _move(staging / rel, dest / rel, done, made)
    except BaseException:
        stuck = _undo(done, made)
        if stuck:  # keep the backup: it holds what could not be put back
            raise UnfinishedSwap(f"could not restore {stuck[0]}: its old content is in {backup}") from None
        shutil.rmtree(backup, ignore_errors=True)
        raise
    for rel in old:  # the directories our old files leave empty (never ``dest`` itself)
        for parent in (dest / rel).parents:
            if parent == dest or dest not in parent.parents:
                break
            with contextlib.suppress(OSError):
                parent.rmdir()
    shutil.rmtree(backup, ignore_errors=True)
    fsync_dir(dest)


# Locks -------------------------------------------------------------------------------------
def _holder_text() -> str:
    """What a lock file says about its holder: the pid and the command line."""
    argv = [Path(sys.argv[0]).name if sys.argv else "python", *sys.argv[1:]]
    if argv[0] in ("__main__.py", "multitoken"):
        argv[0] = "multitoken"
    command = " ".join(argv)
    return f"{os.getpid()}\n{command[:200]}\n"


def _holder(fd: int) -> str:
    lines = os.read(fd, 512).decode(errors="replace").splitlines()
    pid = lines[0].strip() if lines and lines[0].strip() else "?"
    return f"pid {pid}: {lines[1].strip()}" if len(lines) > 1 and lines[1].strip() else f"pid {pid}"


@contextlib.contextmanager
def lock_file(path: str | Path, what: str):
    """Hold an exclusive lock on ``path`` for the block; the file is created now and removed on
    release (the OS drops the lock itself if the process dies). A held lock raises UsageError
    naming the holder (pid and command line)."""
    path = Path(path)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise UsageError(f"another process ({holder}) is writing {what}",
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
        os.write(fd, _holder_text().encode())
        yield path
    finally:
        path.unlink(missing_ok=True)  # while still holding the lock: no one else can be using it
        os.close(fd)


_HELD: dict[Path, int] = {}  # output locks this process holds, and how many blocks hold each


def output_lock_path(path: str | Path) -> Path:
    """The lock of an output (a directory or a file): ``.NAME.lock`` beside it, so it exists
    before the output does and never lands among its files."""
    real = Path(os.path.abspath(Path(path).expanduser()))
    real = real.parent.resolve() / real.name
    return real.parent / f".{real.name}.lock"


@contextlib.contextmanager
def output_lock(path: str | Path, what: str):
    """The one lock of an output, held for a whole command (checks, work, publishing). It is
    re-entrant within a process (a command and the library function it calls may both take
    it); a second process is refused at once, naming the first. Parents of the output made for
    the lock are removed again if nothing else was put in them."""
    lock = output_lock_path(path)
    if lock in _HELD:
        _HELD[lock] += 1
        try:
            yield lock
        finally:
            _HELD[lock] -= 1
        return
    made = [p for p in reversed(lock.parents) if not p.exists()]
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        with lock_file(lock, what):
            _HELD[lock] = 1
            try:
                yield lock
            finally:
                del _HELD[lock]
    finally:
        for parent in reversed(made):
            with contextlib.suppress(OSError):
                parent.rmdir()
