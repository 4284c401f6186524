"""Progress of long work: a bar on a terminal, a plain line every few seconds elsewhere; the
status line of a command's start-up (``status``).

tqdm redraws its bar with carriage returns, which a log file or a pipe keeps as one growing
line of hundreds of redraws. Where stderr is not a terminal the same bar is written as whole
lines, at most one every ``LINE_SECONDS``, so a log holds a readable record with its ETA.
"""

from __future__ import annotations

import sys

LINE_SECONDS = 10.0


class _Lines:
    """A stream tqdm writes to that turns each redraw into one line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.strip("\r\n")
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(**kwargs):
    """``tqdm(**kwargs)`` on stderr: a live bar on a terminal, else a line every ``LINE_SECONDS``."""
    from tqdm import tqdm

    stream = kwargs.pop("file", None) or sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        kwargs.update(file=_Lines(stream), mininterval=max(kwargs.get("mininterval", 0), LINE_SECONDS), ascii=True)
    return tqdm(**kwargs)


# A status line: what a command is doing while nothing else is printed (its start-up: imports,
# loading, packing, compiling). One line on a terminal's stderr, rewritten by the next status and
# erased by the first thing the command writes to stdout or stderr; nothing where stderr is not
# a terminal (a log keeps only what the command prints), nor outside the CLI (``status_on``: a
# REPL or a notebook prints its prompt past our streams, which would leave the line standing).
CLEAR = "\r\033[K"  # back to the line's start, erase to its end
_STATUS: dict = {"on": False, "streams": None}  # streams: (stdout, stderr) as they were while a line shows


class _ClearFirst:
    """A stream that erases the status line before its first write, then passes everything on."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        status_clear()
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def status_on(on: bool = True) -> None:
    """Let ``status`` show (the CLI does, for the process), or stop it."""
    _STATUS["on"] = on
    if not on:
        status_clear()


def status(text: str) -> None:
    """Show ``text`` as the status line (where ``status_on`` was called, on a terminal's stderr)."""
    err = _STATUS["streams"][1] if _STATUS["streams"] else sys.stderr
    if not (_STATUS["on"] and hasattr(err, "isatty") and err.isatty()):
        return
    if _STATUS["streams"] is None:
        _STATUS["streams"] = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _ClearFirst(sys.stdout), _ClearFirst(sys.stderr)
    err.write(f"{CLEAR}{text} ...")
    err.flush()


def status_clear() -> None:
    """Erase the status line (if one shows) and give the streams back."""
    if _STATUS["streams"] is None:
        return
    out, err = _STATUS["streams"]
    _STATUS["streams"] = None
    # kept alive: print() holds sys.stdout without a reference of its own while it calls write,
    # which may be the call that lands here (freeing the proxy under it would crash CPython)
    _STATUS["retired"] = (sys.stdout, sys.stderr)
    if isinstance(sys.stdout, _ClearFirst):
        sys.stdout = out
    if isinstance(sys.stderr, _ClearFirst):
        sys.stderr = err
    err.write(CLEAR)
    err.flush()
