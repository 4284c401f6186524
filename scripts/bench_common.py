"""What the decoding benchmarks share: fixture paths, prompts, model and stats loading, the
device's name for the record (``bench_decode.py``, ``bench_batches.py``)."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from multitoken.pipeline.model.backbone import BackboneConfig, load_backbone
from multitoken.pipeline.model.model import MultiTokenModel

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures"
PROMPTS = {
    "stories": ["Once upon a time", "The little dog ran to the park and", "Lily and Ben were playing with a ball. Then"],
    "pile": ["The results of the study show that", "In computer science, a hash table is", "She walked into the room and"],
}


def load(base: str, heads: str | None, device: str = "cpu", dtype: str = "float32", cpu_linear: str = "packed"):
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
