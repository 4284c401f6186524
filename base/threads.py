"""``--threads``: torch's CPU threads for the commands that run a model, and their defaults.

The defaults live here, and only here. 0 means torch's own default (one thread per core, or
OMP_NUM_THREADS). Decoding one sequence is a chain of small matmuls that a second thread hardly
shortens (in the default mode, not at all) and makes noisier on a shared machine, so ``generate``
and ``sweep`` default to one thread; a batch (a training step) has work enough for every core,
so ``train``, ``eval``, ``distill`` and ``attach`` (and ``build-heads``) keep torch's default (one
thread per core). ``scripts/bench_threads.py`` measures both; ``THREADS_RULE`` says so in each
--help.
"""

from __future__ import annotations

from dataclasses import field

import torch
from multitoken.base.cores import bounded_by_cores, usable_cores
from multitoken.base.errors import UsageError

THREADS_ONE_SEQUENCE = 1
THREADS_BATCHES = 0
# The one rule, said in every command's --threads help (docs/cli.md says it too).
THREADS_RULE = ("commands that decode one sequence at a time (generate, sweep) default to 1, those that run "
                "batches (train, eval, distill, attach, build-heads) to 0")
_TORCH_THREADS = torch.get_num_threads()  # torch's default, read before anything changes it


def threads_field(cli_default: int = THREADS_ONE_SEQUENCE):
    """The ``--threads`` dataclass field, shared by every config that loads a model. Its value
    is None (torch's setting left as it is) in library use; the command line defaults to
    ``cli_default``."""
    return field(default=None, metadata={
        "help": f"torch CPU threads for this process (0: torch's default, one per core); {THREADS_RULE}",
        "cli_default": cli_default, "default_help": f"{cli_default}" if cli_default else "0, torch's default"})


def set_threads(threads: int | None) -> None:
    """Set torch's CPU threads for this process (0: torch's default; None: leave it as it is)."""
    if threads is None:
        return
    if threads < 0:
        raise UsageError(f"--threads must be >= 0, got {threads}", "pass 0 for torch's default (one per core)")
    threads = bounded_by_cores(threads, "--threads", "threads", usable_cores())
    torch.set_num_threads(threads or _TORCH_THREADS)
