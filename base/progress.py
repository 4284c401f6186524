"""Progress of long work: a bar on a terminal, a plain line every few seconds elsewhere.

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
