"""Python's cyclic garbage collector around a command run as a program (CPython 3.11's).

Importing torch and transformers and loading a model make some 400,000 objects that the
collector tracks; every full collection walks all of them, and the import alone triggers
several, and the interpreter's last collection at exit walks them once more (about a second
each on a small CPU, for nothing: they live until the process ends). So the CLI, and only when it
is the program (not a library call or a test calling ``main``):

- ``start_up()``: collections made rare while modules import and the model loads (a higher
  first-generation threshold, not none: garbage still has a bound);
- ``model_loaded()``: what is alive then is frozen (``gc.freeze``: never walked again, still freed
  by reference counting) and the usual thresholds are back for the work itself;
- ``exiting()``: frozen once more, so that the exit's collection walks nothing; files the
  process wrote are closed by then (outputs are written through context managers) and the
  standard streams are flushed by the interpreter as always.

Nothing here runs unless ``start_up`` did: a library user's collector is never touched.
"""

from __future__ import annotations

import gc

START_UP_THRESHOLD = 100_000  # container allocations between first-generation collections
_saved: tuple[int, ...] | None = None


def start_up() -> None:
    """Rare collections from here until ``model_loaded`` (or ``exiting``)."""
    global _saved
    if _saved is None and gc.isenabled():
        _saved = gc.get_threshold()
        gc.set_threshold(START_UP_THRESHOLD, *_saved[1:])


def model_loaded() -> None:
    """A model is loaded: freeze what is alive and restore the thresholds (after ``start_up``
    only; later calls do nothing)."""
    global _saved
    if _saved is not None:
        gc.freeze()
        gc.set_threshold(*_saved)
        _saved = None


def exiting(as_program: bool) -> None:
    """The program ends next: nothing alive is walked again (see the module doc)."""
    if as_program:
        model_loaded()
        gc.freeze()
