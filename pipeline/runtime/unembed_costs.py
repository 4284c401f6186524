"""How to unembed R rows of one backbone: in one call or split, and by which matmul form.

Whether R rows cost one row's time depends on the machine, the weight's shape and dtype, and
the thread count, not on a constant: a wide fp32 unembedding may take a few rows at the one-row
rate and no more, a tiny one is all call overhead (one call beats several smaller ones), and
bf16 weights through oneDNN take several rows at about one row's time (what was measured where:
``scripts/bench_unembed.py``, docs/benchmarks/). So on the CPU the costs are measured: the first time a
row count is needed, both forms (``F.linear`` and ``(W x^T)^T``) are timed on the real weight,
interleaved, medians kept, and cached per process for (weight, shape, dtype, device, threads).
An accelerator reads the weight once per call whatever the row count (memory-bound): one call,
``F.linear``, nothing measured (nor on ``meta``, which has no values to time).

The choice changes the float rounding of logits, never which rows are computed: both forms are
the same dot products summed in another order (tests bound the difference). Where the head has
an argmax of its own (``cpu_linear.ArgmaxHead``, such as the rows kernel's ``PackedLinear.argmax``:
the logits' argmax bit for bit, mostly from a narrower copy), its time is measured beside the
logits too, and greedy steps take the screen only for the row counts where it is the cheaper: a screen's arithmetic grows with the rows while
the logits' read of the weight does not, so past some row count the logits cost less.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from multitoken.kernels.cpu_linear import is_argmax_head, weight_key

LINEAR, TRANSPOSED = "linear", "transposed"
ARGMAX = "argmax"  # the head's argmax screen: timed beside the logits' forms, never a logits form
MEASURE_REPS = 5  # interleaved timings per form and row count (median kept)


def plain_linear(head: torch.nn.Module) -> bool:
    """A bias-free float ``nn.Linear``: the only kind ``(W x^T)^T`` may replace (a quantized or
    biased unembedding always goes through its module)."""
    return type(head) is torch.nn.Linear and head.bias is None


@dataclass
class UnembedCosts:
    """Cost and form per row count. ``measure(rows) -> {form: seconds}`` fills ``table`` on
    first need; ``measure`` None: every row count costs one call (accelerators)."""

    measure: Callable[[list[int]], dict[int, dict[str, float]]] | None = None
    table: dict[int, dict[str, float]] = field(default_factory=dict)

    def _ensure(self, rows: list[int]) -> None:
        missing = sorted({r for r in rows if r not in self.table})
        if missing and self.measure is not None:
            self.table.update(self.measure(missing))  # measured together: one load level

    def _logits(self, rows: int) -> dict[str, float]:
        self._ensure([rows])
        return {f: s for f, s in self.table[rows].items() if f != ARGMAX}

    def cost(self, rows: int) -> float:
        return 1.0 if self.measure is None else min(self._logits(rows).values())

    def form(self, rows: int) -> str:
        if self.measure is None:
            return LINEAR
        forms = self._logits(rows)
        return min(forms, key=forms.get)

    def screens(self, rows: int) -> bool:
        """Whether the argmax of ``rows`` rows is cheaper from the head's screen than from its
        logits (True where nothing was measured: a screen reads less)."""
        if self.measure is None:
            return True
        self._ensure([rows])
        return ARGMAX not in self.table[rows] or self.table[rows][ARGMAX] <= self.cost(rows)

    def one_call(self, total: int, *parts: int) -> bool:
        """Whether one call of ``total`` rows costs no more than one call per part (the rows
        read either way; ``total`` may hold more than the parts: rows computed in passing)."""
        if self.measure is None:
            return True
        self._ensure([total, *parts])
        return self.cost(total) <= sum(self.cost(p) for p in parts)

    def as_dict(self) -> dict:
        """The measured table, ms per call (for benchmark records)."""
        return {r: {f: round(1000 * s, 4) for f, s in forms.items()} for r, forms in sorted(self.table.items())}


def fixed_costs(fast_rows: int) -> UnembedCosts:
    """Costs from a rule instead of a measurement (deterministic: tests pin it): up to
    ``fast_rows`` rows cost one row's ``F.linear``; beyond it F.linear costs a row's time per row
    and ``(W x^T)^T`` 1 + rows / fast_rows, so calls over more rows than that are split."""
    def measure(rows: list[int]) -> dict[int, dict[str, float]]:
        return {r: {LINEAR: 1.0} if r <= fast_rows else {LINEAR: float(r), TRANSPOSED: 1 + r / fast_rows} for r in rows}
    return UnembedCosts(measure)


def apply(head: torch.nn.Module, x: torch.Tensor, form: str) -> torch.Tensor:
    """Logits of ``x`` [N, H] # -> [N, V] by ``form``."""
    if form == TRANSPOSED:
        # row-major as F.linear's, the copy inside the form's measured time: every reader (argmax,
        # log-softmax, top-k) reduces over V, several times slower across a [V, N] layout's stride
        return (head.weight @ x.T).T.contiguous()
    return head(x)


def _timer(head: torch.nn.Module, hidden: int, dtype: torch.dtype, device: torch.device):
    # one row always goes through the module, as transformers' generate computes it: greedy
    # ``ar`` stays bit-identical to it
    forms = (LINEAR, TRANSPOSED) if plain_linear(head) else (LINEAR,)

    def run(x: torch.Tensor, form: str):
        # the screen's argmax against the logits alone: their argmax is one pass over R x V floats,
        # small beside the unembedding that makes them
        return head.argmax(x) if form == ARGMAX else apply(head, x, form)

    @torch.inference_mode()
    def measure(rows: list[int]) -> dict[int, dict[str, float]]:
        xs = {r: torch.randn(r, hidden, generator=torch.Generator().manual_seed(r)).to(device=device, dtype=dtype) for r in rows}
        times = {(r, f): [] for r in rows for f in (forms if r > 1 else (LINEAR,))}
        if is_argmax_head(head):
            times.update({(r, ARGMAX): [] for r in rows if head.argmax(xs[r]) is not None})  # also its warm-up (the first builds the screen)
        for r, f in times:  # warm-up: first calls allocate
            if f != ARGMAX:
                run(xs[r], f)
        for _ in range(MEASURE_REPS):
            for r, f in times:
                start = time.perf_counter()
                run(xs[r], f)
                times[r, f].append(time.perf_counter() - start)
        return {r: {f: statistics.median(times[r, f]) for f in (*forms, ARGMAX) if (r, f) in times} for r in rows}
    return measure


_COSTS: dict[tuple, UnembedCosts] = {}
PINNED: UnembedCosts | None = None  # tests pin fixed costs here (every backbone then uses them)


def costs_for(head: torch.nn.Module, rows: torch.Tensor) -> UnembedCosts:
    """The process's costs of unembedding ``rows`` [..., H] (their dtype and device) with
    ``head`` (measured lazily on the CPU)."""
    if PINNED is not None:
        return PINNED
    if rows.device.type != "cpu":
        return UnembedCosts()
    key = (weight_key(head), rows.dtype, torch.get_num_threads(), type(head))
    if key not in _COSTS:
        _COSTS[key] = UnembedCosts(_timer(head, rows.shape[-1], rows.dtype, rows.device))
    return _COSTS[key]
