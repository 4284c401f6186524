"""What one decoding call reports besides its tokens (``Trace``), the clock its model / logic
split reads, and the time accounting that fills it (``Timer``).

On an accelerator work is queued, so a bare ``perf_counter`` around a forward pass measures the
launch, not the work: a profiling run synchronises the device at every clock reading (which
itself costs time, so only when asked).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
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


class Timer:
    """A batch's time accounting on its rows' traces, from one clock: model time (every pass,
    shared by the rows in it, and the head distributions a step reads from it afterwards), the
    prompts' pass, the preparation before it (not in wall time), and each row's wall time from
    the first pass to its last token. It is created as the preparation starts."""

    def __init__(self, clock: Callable[[], float], traces: list["Trace"]):
        self.clock, self.traces = clock, traces
        self.start = self.t0 = clock()
        self.unembed_rows: Counter = Counter()  # calls serve the whole batch: one count, shared
        for trace in traces:
            trace.unembed_rows = self.unembed_rows

    def prepared(self) -> None:
        """The preparation is over: wall time starts."""
        self.t0 = self.clock()
        for trace in self.traces:
            trace.prepare_s = self.t0 - self.start

    def forward(self, traces: list["Trace"], step: Callable):
        """``step()``, a forward pass for the rows of ``traces``, timed as their model time."""
        start = self.clock()
        out = step()
        spent = self.clock() - start
        for trace in traces:
            trace.model_s += spent
            trace.forward_passes += 1
        return out

    def prefilled(self) -> None:
        """The prompts' pass is over: its time is the prefill's."""
        for trace in self.traces:
            trace.prefill_s = trace.model_s

    def read(self, traces: list["Trace"], out) -> None:
        """The model time ``out`` (a pass's output) spent since the pass, computing what a step
        read of it (head distributions, drafts), on the rows of ``traces``."""
        for trace in traces:
            trace.model_s += out.model_s
        out.model_s = 0.0

    def unembedded(self, out) -> None:
        """Count ``out``'s unembedding calls (once it is read for the last time)."""
        self.unembed_rows.update(out.unembed_rows)

    def finish(self, trace: "Trace", new_tokens: int) -> None:
        trace.wall_s = self.clock() - self.t0
        trace.new_tokens = new_tokens


@dataclass
class Trace:
    mode: str = ""
    prompt_tokens: int = 0
    repetition_penalty: float = 1.0  # the one in force (its default resolved: 1.1 sampling, 1 greedy)
    new_tokens: int = 0
    forward_passes: int = 0  # model.step calls, the prompt's included
    accepted_lengths: Counter = field(default_factory=Counter)  # drafts kept per verification
    orders: Counter = field(default_factory=Counter)  # dynamic: tokens emitted per step -> steps
    backoffs: Counter = field(default_factory=Counter)  # dynamic: order backed off from -> count
    wall_s: float = 0.0
    model_s: float = 0.0  # forward passes + head distributions
    prefill_s: float = 0.0  # the prompt's forward pass (part of model_s)
    prepare_s: float = 0.0  # before the first pass: the CPU linears packed (once per model load); not in wall_s
    stats_order_cap: int = 0  # heads read capped at the stats' highest order (0: no cap)
    dynamic_kernel: Counter = field(default_factory=Counter)  # grids built per path: dense | numpy | numba
    device: str = "cpu"  # where the model ran
    synchronised: bool = False  # model / logic split exact on an accelerator (generate(profile=True))
    unembed_rows: Counter = field(default_factory=Counter)  # rows per unembedding call -> calls (base and layer heads)
    tree: str = "chain"  # drafts verified as a chain, or a static / dynamic candidate tree
    tree_nodes: int = 0  # tree: candidates per step besides the committed token (the budget)
    tree_accuracies: str = ""  # static tree: where its per-rank accuracies came from (a file, or the fallback prior)
    tree_sibling_ranks: Counter = field(default_factory=Counter)  # tree: kept node's index among its siblings -> count
    lookup: int = 0  # --lookup K: a branch of up to K tokens copied from the context (0: none)
    lookup_tokens: int = 0  # kept tokens that only the lookup branch drafted
    batch_size: int = 1  # rows decoded together (one batch): passes and model time are shared by them
    plan: str = ""  # what the call's steps propose, how they are judged and what they read (``DecodePlan.describe``)

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / max(self.forward_passes, 1)

    @property
    def decoding_s(self) -> float:
        """Everything but the model: proposal, grids, acceptance, sampling, bookkeeping."""
        return max(self.wall_s - self.model_s, 0.0)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        for key in ("accepted_lengths", "orders", "backoffs", "dynamic_kernel", "unembed_rows", "tree_sibling_ranks"):
            d[key] = {str(k): v for k, v in sorted(getattr(self, key).items())}
        d.update(tokens_per_forward=round(self.tokens_per_forward, 4), decoding_s=self.decoding_s,
                 tokens_per_s=self.tokens_per_s)
        return d

    def summary(self, verbose: bool = False) -> str:
        """What decoding did: tokens, passes, time; ``verbose`` adds the internals (histograms of
        accepted drafts, tokens per step and back-offs, the tree's accuracies and kept siblings,
        how grids were built, rows per unembedding call)."""
        lines = [
            f"mode {self.mode}: {self.new_tokens} tokens in {self.forward_passes} forward passes "
            f"({self.tokens_per_forward:.2f} tokens/forward), {self.wall_s:.3f} s ({self.tokens_per_s:.1f} tokens/s), "
            f"repetition penalty {self.repetition_penalty:g}",
            f"time: model {self.model_s:.3f} s, decoding logic {self.decoding_s:.3f} s"
            + (f"; before it, {self.prepare_s:.3f} s packing the linears (once per model load)" if self.prepare_s >= 0.01 else ""),
        ]
        if self.tree != "chain":
            lines.append(f"tree {self.tree}, {self.tree_nodes} candidates per step"
                         + (f", accuracies: {self.tree_accuracies}" if verbose and self.tree_accuracies else "")
                         + (", kept sibling index: " + _hist(self.tree_sibling_ranks) if verbose and self.tree_sibling_ranks else ""))
        if self.lookup:
            lines.append(f"prompt lookup (up to {self.lookup} tokens): {self.lookup_tokens} kept tokens drafted by it alone")
        if not verbose:
            return "\n".join(lines)
        if self.plan:
            lines.append("plan: " + self.plan)
        if self.accepted_lengths:
            lines.append("accepted drafts per verification: " + _hist(self.accepted_lengths))
        if self.orders:
            lines.append("tokens per step: " + _hist(self.orders))
        if self.backoffs:
            lines.append("back-offs from order: " + _hist(self.backoffs))
        if self.dynamic_kernel:
            lines.append("grids built by: " + _hist(self.dynamic_kernel))
        if self.unembed_rows:
            lines.append("rows per unembedding call: " + _hist(self.unembed_rows))
        return "\n".join(lines)


def _hist(counter: Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counter.items()))
