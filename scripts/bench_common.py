"""What the decoding benchmarks share: fixture paths, prompts, model and stats loading, the
timed repetitions (``best_of``), the device's name for the record (``bench_decode.py``,
``bench_tree.py``, ``bench_batches.py``)."""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Callable

import torch

from multitoken.pipeline.model.backbone import BackboneConfig, load_backbone
from multitoken.pipeline.model.model import MultiTokenModel
from multitoken.base.quiet import quiet_dependencies

quiet_dependencies()  # dependencies' progress bars and notices off, as in the CLI

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures"
PROMPTS = {
    "stories": ["Once upon a time", "The little dog ran to the park and", "Lily and Ben were playing with a ball. Then"],
    "pile": ["The results of the study show that", "In computer science, a hash table is", "She walked into the room and"],
}


def load(base: str, heads: str | None, device: str = "cpu", dtype: str = "float32", cpu_linear: str = "rows"):
    """The model with its linears as ``cpu_linear`` asks from the start, so that transformers'
    rows (the same model object) run the kernels ours do from the first repetition on."""
    config = BackboneConfig(base=base, device=device, dtype=dtype, cpu_linear=cpu_linear)
    if heads and Path(heads).is_dir():
        model, label = MultiTokenModel.from_pretrained(config, heads), heads
    else:
        bb = load_backbone(config)
        model = MultiTokenModel.attach(bb, {"head_type": "replicated", "n_future": 3, "init": "copy"})
        label = "untrained (copy-initialised replicated, n=3)"
    model.prepare_linears()
    return model, label


def best_of(runs: dict[str, Callable[[], dict]], reps: int, *, warm_up: bool = True,
            before: Callable[[object], None] = lambda label: None, sync: Callable[[], None] = lambda: None,
            after: Callable[[], dict] = dict) -> dict[str, dict]:
    """Each method's fastest of ``reps`` timed repetitions, as its run's dict plus ``wall_s``.

    One untimed warm-up run of every method comes first (allocations, kernel and plan caches,
    numba, a tree's auto budget), so that even ``--reps 1`` times a warm run; the repetitions
    then interleave the methods, so a load spike hits every method alike. ``before`` runs off the
    clock before each run (given its label), ``sync`` on the clock after it (an accelerator's queue), and
    ``after`` off the clock, its dict merged into the kept record (e.g. peak memory)."""
    if warm_up:
        for label, run in runs.items():
            before(label)
            run()
            sync()
    best: dict[str, dict] = {}
    for _ in range(reps):
        for label, run in runs.items():
            before(label)
            start = time.perf_counter()
            result = run()
            sync()
            wall = time.perf_counter() - start
            if label not in best or wall < best[label]["wall_s"]:
                best[label] = {**result, **after(), "wall_s": wall}
    return best


def open_table(path: str | None, tokenizer):
    if not path or not Path(path).is_dir():
        return None
    from multitoken.stats.table import CooccurrenceTable

    return CooccurrenceTable.for_tokenizer(path, tokenizer)


def device_name(device: str) -> str:
    """The accelerator's name (or the CPU's platform) for the record."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()
