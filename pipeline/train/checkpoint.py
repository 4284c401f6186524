"""Training checkpoints.

A checkpoint is a directory ``step-00000123/`` under the checkpoint root holding:
- ``trainable.safetensors``: every weight the optimizer updates (heads, LoRA), by module name;
- ``optimizer.pt``: the AdamW state dict (tensors, numbers and lists only: read back with
  ``torch.load(weights_only=True)``, nothing arbitrary is unpickled);
- ``rng.safetensors``: torch's CPU RNG state;
- ``state.json``: step, data position, epoch start, the config it was made with.
It is written into a hidden staging directory and published into the checkpoint root with the
root's record of files (``publish.staged_output``: all or nothing, ``state.json`` last), which
also drops the checkpoints beyond ``--keep-checkpoints`` (only files the record lists are ever
removed); the newest one is the one to resume from.
Loading validates every file and says which one is damaged.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from multitoken.base.outputs import CHECKPOINTS
from multitoken.base.publish import staged_output
from multitoken.base.errors import CheckpointError
from multitoken.base.finite import check_finite

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
    name = f"step-{step:08d}"
    kept = set(sorted({p.name for p in list_checkpoints(root)} | {name})[-keep:])
    weights = trainable_state(model, optimizer.param_groups)
    check_finite(weights, f"checkpoint {name}", "the weights diverged: resume from the previous checkpoint with a lower --lr")
    # re-saving the same step (the final save after a periodic one) replaces it
    with staged_output(root, CHECKPOINTS.kind, "train", keep=lambda rel: Path(rel).parts[0] in kept,
                       marker=f"{name}/state.json") as stage:
        tmp = stage / name
        tmp.mkdir()
        save_file(weights, str(tmp / "trainable.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        save_file({"torch_cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
        (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2, default=str))
    return root / name


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Restore weights, optimizer and RNG from ``path``; returns its ``state.json``."""
    fix = f"delete {path} to resume from an older checkpoint (or start over with another --checkpoint-dir)"
    state = _read_state(path / "state.json", fix)
    weights = _read_safetensors(path / "trainable.safetensors", fix)
    check_finite(weights, str(path / "trainable.safetensors"), fix)
    rng = _read_safetensors(path / "rng.safetensors", fix).get("torch_cpu")
    if rng is None or rng.dtype != torch.uint8 or rng.ndim != 1:
        raise CheckpointError(f"{path / 'rng.safetensors'}: no torch_cpu RNG state (a uint8 vector)", fix)
    try:
        opt_state = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:  # weights_only refused an object: never unpickled
        raise CheckpointError(f"{path / 'optimizer.pt'} holds objects other than tensors and numbers: refused to load it "
                              f"({str(err).splitlines()[0][:120]})", fix) from err
    except (OSError, ValueError, RuntimeError, EOFError) as err:
        raise CheckpointError(f"{path / 'optimizer.pt'} is unreadable or truncated ({str(err).splitlines()[0][:120]})", fix) from err
    if not isinstance(opt_state, dict) or not {"state", "param_groups"} <= set(opt_state):
        raise CheckpointError(f"{path / 'optimizer.pt'} is not an optimizer state", fix)
    params = dict(model.named_parameters())
    expected = trainable_state(model, optimizer.param_groups)
    if set(weights) != set(expected):
        raise CheckpointError(
            f"checkpoint {path} holds other weights than this run trains "
            f"(missing {sorted(set(expected) - set(weights))[:3]}, extra {sorted(set(weights) - set(expected))[:3]})",
            "resume with the same heads and mode, or start a fresh run with another --checkpoint-dir",
        )
    bad = [n for n, v in weights.items() if v.shape != expected[n].shape]
    if bad:
        raise CheckpointError(f"{path / 'trainable.safetensors'}: {bad[0]} has shape {list(weights[bad[0]].shape)}, "
                              f"the model's is {list(expected[bad[0]].shape)}", fix)
    try:
        optimizer.load_state_dict(opt_state)
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        raise CheckpointError(f"{path / 'optimizer.pt'} does not fit this run's optimizer ({err})", fix) from err
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    torch.set_rng_state(rng)
    return state


def _read_state(file: Path, fix: str) -> dict:
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file} is missing or not valid JSON ({err})", fix) from err
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} holds a JSON {type(state).__name__}, not an object", fix)
    if not _is_count(state.get("step")):
        raise CheckpointError(f"{file}: step must be an integer >= 0, got {state.get('step')!r:.60}", fix)
    for key, kind in (("position", dict), ("epoch_start", dict), ("history", list), ("stream", dict)):
        if key in state and not isinstance(state[key], kind):
            raise CheckpointError(f"{file}: {key} must be a JSON {kind.__name__.replace('dict', 'object')}, got {state[key]!r:.60}", fix)
    for key in ("position", "epoch_start"):  # read by PackPosition.from_dict
        bad = [f for f in POSITION_FIELDS if key in state and not _is_count(state[key].get(f))]
        if bad:
            raise CheckpointError(f"{file}: {key}.{bad[0]} must be an integer >= 0, got {state[key].get(bad[0])!r:.60}", fix)
    if not all(isinstance(h, dict) for h in state.get("history", [])):
        raise CheckpointError(f"{file}: history must be a list of objects", fix)
    return state


POSITION_FIELDS = ("epoch", "doc", "offset", "consumed")


def _is_count(v) -> bool:
    """A JSON integer >= 0 (not a bool, not 1e9 written as a float, not text)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _read_safetensors(file: Path, fix: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError

    try:
        return load_file(str(file))
    except (OSError, SafetensorError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{file} is missing, truncated or not a safetensors file ({err})", fix) from err
