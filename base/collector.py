"""Python's cyclic garbage collector around a command run as a program (CPython 3.11's).

Importing torch and transformers and loading a model make hundreds of thousands of objects that
the collector tracks; a full collection walks all of them, the imports alone trigger several,
and the interpreter's last collection at exit walks them once more, for nothing: they live
until the process ends. So the CLI, and only when it is the program (not a library call or a
test calling ``main``):

- ``start_up()``: no collection while modules import and the model loads (a first-generation
  threshold above the objects a start-up makes, not none: garbage still has a bound in a
  command that loads no model);
- ``model_loaded()``: what is alive then is frozen (``gc.freeze``: never walked again, still freed
  by reference counting) and the usual thresholds are back for the work itself. The cycles
  start-up left unreachable are frozen with it, never freed (small: what imports drop), where
  a full collection to find them would walk every object once more;
- ``exiting()``: frozen once more, so that the exit's collection walks nothing; files the
  process wrote are closed by then (outputs are written through context managers) and the
  standard streams are flushed by the interpreter as always.

A library user's collector is never touched: ``model_loaded`` (every model load calls it) does
nothing unless the CLI's ``main``, called as the program, ran ``start_up``.
"""

from __future__ import annotations

import gc

START_UP_THRESHOLD = 1_000_000  # container allocations between first-generation collections
_saved: tuple[int, ...] | None = None


def start_up() -> None:
    """No collection (up to a bound) from here until ``model_loaded`` (or ``exiting``)."""
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
        gc.freeze()
