"""Clocks for the trace's model / logic split. On an accelerator work is queued, so a bare
``perf_counter`` around a forward pass measures the launch, not the work: a profiling run
synchronises the device at every clock reading (which itself costs time, so only when asked)."""

from __future__ import annotations

import time
from typing import Callable

import torch


def clock_for(device: torch.device, synchronise: bool) -> Callable[[], float]:
    """``perf_counter``, after waiting for ``device``'s queued work when ``synchronise`` and the
    device queues work (CUDA); the CPU and ``meta`` run eagerly: nothing to wait for."""
    if synchronise and device.type == "cuda":
        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return clock
    return time.perf_counter
