"""Test-only fault hooks, installed in every Ray worker of the test cluster as its
``worker_process_setup_hook`` (nothing in the package knows about them).

Control is by files in ``$MT_RAY_HOOKS`` (a dir the test owns), so a test can switch a hook on
and off while workers run:

* ``hold-count-I``: the map task of shard I, after yielding ``HOLD_AFTER_DOCS`` documents (some
  runs are spilled by then), writes ``pid-count-I-PID`` and waits while the file exists;
* ``hold-merge-K-J``: the reduce task of order K, range J, writes ``pid-merge-K-J-PID`` and waits.

The test kills the pid it finds (a worker dying mid-task) or the driver, then removes the file.
The hook also registers the test object store (objstore.py, protocol ``mtobj``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import objstore

HOLD_AFTER_DOCS = 250
HOLD_LIMIT_SECONDS = 60.0  # a forgotten hold file must not hang the suite


def _hold(control: Path, name: str) -> None:
    flag = control / f"hold-{name}"
    if not flag.exists():
        return
    (control / f"pid-{name}-{os.getpid()}").write_text("")
    deadline = time.monotonic() + HOLD_LIMIT_SECONDS
    while flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def install() -> None:
    from multitoken.stats import ray_executor, shard

    objstore.register()
    control = Path(os.environ["MT_RAY_HOOKS"])
    real_docs, real_range = shard.iter_documents, ray_executor.run_range

    def iter_documents(data, tokenizer, *, vocab_size, shard, start, files=None):
        for k, doc in enumerate(real_docs(data, tokenizer, vocab_size=vocab_size, shard=shard, start=start, files=files)):
            if k == HOLD_AFTER_DOCS:
                _hold(control, f"count-{shard[0]}")
            yield doc

    def run_range(task):
        _hold(control, f"merge-{task.order}-{task.index}")
        return real_range(task)

    shard.iter_documents = iter_documents
    ray_executor.run_range = run_range
