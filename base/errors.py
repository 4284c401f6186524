"""One exception family for the whole package.

Every error names the problem and, where one exists, the fix. The CLI prints ``str(err)``
without a traceback and exits with ``err.exit_code`` (2 for bad usage, 1 otherwise).
"""

from __future__ import annotations


class MultitokenError(Exception):
    """Base class: ``problem`` says what went wrong, ``fix`` what to do about it."""

    exit_code = 1

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(problem if not fix else f"{problem}\n  fix: {fix}")


class UsageError(MultitokenError):
    """Bad arguments or option values (CLI exit code 2)."""

    exit_code = 2


class UnsupportedModelError(MultitokenError):
    """A checkpoint whose architecture has no entry in the backbone table."""


class CheckpointError(MultitokenError):
    """A missing, malformed, truncated or inconsistent file on disk."""


class MismatchError(MultitokenError):
    """Two artefacts that must belong together do not (heads vs base, stats vs tokenizer)."""


class DataError(MultitokenError):
    """Unreadable or unsuitable input data (missing column, empty input, bad token ids)."""


class DivergedError(MultitokenError):
    """Training reached a non-finite loss or weight (it stops there; nothing more is written)."""


class OutputError(MultitokenError):
    """An output could not be written or replaced (what was there before is kept)."""
