"""Training checkpoints and atomic publication of output directories.

A checkpoint is a directory ``step-00000123/`` under the checkpoint root holding:
- ``trainable.safetensors``: every weight the optimizer updates (heads, LoRA), by module name;
- ``optimizer.pt``: the AdamW state dict (tensors, numbers and lists only: read back with
  ``torch.load(weights_only=True)``, nothing arbitrary is unpickled);
- ``rng.safetensors``: torch's CPU RNG state;
- ``state.json``: step, data position, epoch start, the config it was made with.
It is written into a hidden temporary directory and renamed into place, so a directory named
``step-*`` is always complete; the newest one is the one to resume from.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .errors import CheckpointError

STEP_DIR = re.compile(r"^step-(\d{8})$")


def trainable_state(model, groups: list[dict]) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` for every parameter of the optimizer groups # copies, contiguous."""
    wanted = {id(p) for g in groups for p in g["params"]}
    return {n: p.detach().to("cpu", copy=True).contiguous() for n, p in model.named_parameters() if id(p) in wanted}


def list_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name))


def save_checkpoint(root: Path, step: int, model, optimizer, state: dict, keep: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".step-tmp-", dir=root))
    final = root / f"step-{step:08d}"
    try:
        save_file(trainable_state(model, optimizer.param_groups), str(tmp / "trainable.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        save_file({"torch_cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
        (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2, default=str))
        _fsync_dir_files(tmp)
        if final.exists():  # re-saving the same step (e.g. the final save after a periodic one)
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_dir_files(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Restore weights, optimizer and RNG from ``path``; returns its ``state.json``."""
    try:
        state = json.loads((path / "state.json").read_text())
        weights = load_file(str(path / "trainable.safetensors"))
        opt_state = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
        rng = load_file(str(path / "rng.safetensors"))["torch_cpu"]
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint {path} is unreadable: {err}", "delete it to resume from an older one") from err
    params = dict(model.named_parameters())
    expected = trainable_state(model, optimizer.param_groups).keys()
    if set(weights) != set(expected):
        raise CheckpointError(
            f"checkpoint {path} holds other weights than this run trains "
            f"(missing {sorted(set(expected) - set(weights))[:3]}, extra {sorted(set(weights) - set(expected))[:3]})",
            "resume with the same heads and mode, or start a fresh run with another --checkpoint-dir",
        )
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    optimizer.load_state_dict(opt_state)
    torch.set_rng_state(rng)
    return state


def publish_dir(staging: Path, out: Path) -> None:
    """Move the complete ``staging`` dir to ``out``, replacing an existing ``out`` only at the
    very end: a reader sees the old directory or the new one, never a mix of files."""
    out = out.resolve()
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / "dir")
    try:
        os.replace(staging, out)
    except BaseException:
        if old is not None:
            os.replace(old / "dir", out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
