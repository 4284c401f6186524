"""Folders of weights we hand to transformers and peft, checked before they read them.

Their loaders answer a damaged file with a traceback (JSONDecodeError, SafetensorError,
UnpicklingError), and a folder holding only pickles (``pytorch_model.bin``,
``adapter_model.bin``) with an unpickling attempt. Weights are read only from safetensors here, so
such folders are refused with one line, and every safetensors file's header is checked against
its size (a truncated file is named) before the slow load starts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from multitoken.base.errors import CheckpointError
from multitoken.base.finite import check_finite
from multitoken.base.hub import file_sha256

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on a header
LORA_CONFIG, LORA_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def check_safetensors(path: Path, fix: str) -> dict:
    """The header of the safetensors file ``path`` (``{name: {dtype, shape, data_offsets}}``),
    refused with one line when it is unreadable, malformed or lists more bytes than the file has."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(f"{path} is truncated or not a safetensors file (its {size:,} bytes hold no complete header)", fix)
        try:
            header = json.loads(f.read(n))
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
            raise CheckpointError(f"{path} is not a safetensors file (its header is not JSON: {err})", fix) from err
    entries = {k: v for k, v in header.items() if k != "__metadata__"} if isinstance(header, dict) else None
    if entries is None or not all(_is_entry(v) for v in entries.values()):
        raise CheckpointError(f"{path} is not a safetensors file (its header does not list tensors)", fix)
    needed = 8 + n + max((v["data_offsets"][1] for v in entries.values()), default=0)
    if needed > size:
        raise CheckpointError(f"{path} is truncated: it holds {size:,} bytes, its header lists {needed:,}", fix)
    return entries


def _is_entry(v) -> bool:
    ints = lambda xs: isinstance(xs, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)
    return (isinstance(v, dict) and isinstance(v.get("dtype"), str) and ints(v.get("shape"))
            and ints(v.get("data_offsets")) and len(v["data_offsets"]) == 2 and v["data_offsets"][0] <= v["data_offsets"][1])


def _pickles(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())


CONVERSION = "conversion.json"  # what `multitoken fetch` writes beside a conversion


def files_record(folder: Path) -> dict:
    """Size, sha256 and modification time of every file in ``folder`` (``conversion.json``'s
    ``files``: what ``check_recorded_files`` holds a folder to)."""
    out = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != CONVERSION):
        st = path.stat()
        out[path.name] = {"size": st.st_size, "sha256": _sha256(path), "mtime_ns": st.st_mtime_ns}
    return out


def check_recorded_files(folder: Path, fix: str) -> None:
    """A folder whose ``conversion.json`` lists its files: each present at its size, and its
    sha256 recomputed where the modification time moved (cheap while nothing changed)."""
    record_path = folder / CONVERSION
    if not record_path.is_file():
        return
    try:
        files = json.loads(record_path.read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{record_path} is damaged ({err})", fix) from err
    if not isinstance(files, dict):
        return  # a conversion recorded before files were
    for name, want in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (it was written by multitoken fetch)", fix)
        st = path.stat()
        if st.st_size != want.get("size"):
            raise CheckpointError(f"{path} changed since it was fetched ({st.st_size:,} bytes, {want.get('size'):,} recorded)", fix)
        if st.st_mtime_ns != want.get("mtime_ns") and _sha256(path) != want.get("sha256"):
            raise CheckpointError(f"{path} changed since it was fetched (its sha256 differs from the recorded one)", fix)


def _sha256(path: Path) -> str:
    st = path.stat()
    return file_sha256(str(path), st.st_size, st.st_mtime_ns)  # hub's, cached per path, size and mtime


def check_base_dir(folder: Path) -> None:
    """A local base model folder: the files a fetch recorded unchanged, weights as safetensors
    (checked), never only pickles."""
    check_recorded_files(folder, f"the fetched model in {folder} is damaged: remove that folder, then run multitoken fetch again")
    fix = "convert the weights to safetensors (transformers' save_pretrained writes them) and pass that folder"
    weights = sorted(folder.glob("*.safetensors"))
    if not weights and _pickles(folder):
        raise CheckpointError(f"{folder} holds only pickled weights ({', '.join(_pickles(folder)[:3])}): refused, "
                              "unpickling can run code; multitoken reads safetensors", fix)
    for path in weights:
        check_safetensors(path, f"the base folder {folder} is damaged: restore or re-download it")


def check_lora_dir(folder: Path) -> None:
    """A heads dir's LoRA folder as peft wrote it: ``adapter_config.json`` (a LoRA config) and
    ``adapter_model.safetensors`` (checked); a pickled ``adapter_model.bin`` is refused."""
    fix = "the LoRA adapter of the heads dir is damaged: re-create the heads (train them again)"
    config = folder / LORA_CONFIG
    if not config.is_file():
        raise CheckpointError(f"no peft adapter in {str(folder)!r} (no {LORA_CONFIG})", fix)
    try:
        record = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{config} is not valid JSON ({err})", fix) from err
    _check_lora_config(record, config, fix)
    weights = folder / LORA_WEIGHTS
    if not weights.is_file():
        found = _pickles(folder)
        what = f"only pickled weights ({', '.join(found[:3])}): refused, unpickling can run code" if found else f"no {LORA_WEIGHTS}"
        raise CheckpointError(f"{folder} holds {what}", fix)
    check_safetensors(weights, fix)
    from safetensors.torch import load_file  # the adapter is small: its values are checked too

    check_finite(load_file(str(weights)), str(weights), fix)


def _check_lora_config(record, path: Path, fix: str) -> None:
    """The fields peft's LoraConfig reads to build the adapter, with their types."""
    if not isinstance(record, dict):
        raise CheckpointError(f"{path} holds a JSON {type(record).__name__}, not an object", fix)
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    targets = record.get("target_modules")
    checks = {
        "peft_type": (record.get("peft_type") == "LORA", "'LORA'"),
        "r": (isinstance(record.get("r"), int) and not isinstance(record.get("r"), bool) and record["r"] >= 1, "an integer >= 1"),
        "lora_alpha": (number(record.get("lora_alpha")), "a finite number"),
        "target_modules": (isinstance(targets, str) or (isinstance(targets, list) and bool(targets)
                                                         and all(isinstance(t, str) for t in targets)), "module names"),
    }
    for key, (ok, what) in checks.items():
        if not ok:
            raise CheckpointError(f"{path}: {key} must be {what}, got {record.get(key)!r:.60}", fix)
