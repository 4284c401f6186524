"""The heads directory format.

    heads_config.json   format version, package version, head config, base name, model_type,
                        tensor shapes/dtypes, base fingerprint, sha256 of heads.safetensors
    heads.safetensors   the head weights only (never base weights, except head 1's own layer
                        when the trainer unfroze it, stored under ``base_head.``)
    lora/               peft's own adapter files, when the backbone carries LoRA

A save is staged in a hidden directory and published with ``publish.staged_output`` (all or
nothing, the config last, with ``multitoken_manifest.json`` recording the files), so a failed or
interrupted save leaves the old directory as it was; files its record does not list are never
touched. Loading uses safetensors only: nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import torch

from multitoken.adapters.registry import config_from_dict

from multitoken.pipeline.model.draft_vocab import DRAFT_VOCAB_FILE
from multitoken.pipeline.model.backbone import Backbone, fingerprints_match
from multitoken.pipeline.model.loading import BackboneConfig, load_backbone
from multitoken.embedded import portable_base
from multitoken.base.dtypes import DTYPES
from multitoken.base.errors import CheckpointError, MismatchError, UsageError
from multitoken.base.finite import check_finite
from multitoken.base.outputs import HEADS
from multitoken.base.publish import staged_output

FORMAT_VERSION = 1
CONFIG_FILE = "heads_config.json"
TENSORS_FILE = "heads.safetensors"
LORA_DIR = "lora"
BASE_HEAD_PREFIX = "base_head."


# Saving ------------------------------------------------------------------------------------
def _base_head_modules(model) -> dict[str, torch.nn.Module]:
    return {"final_layer": model.backbone.layers[-1], "final_norm": model.backbone.final_norm}


def _base_head_tensors(model) -> dict[str, torch.Tensor]:
    """Head 1's own weights, only when the trainer unfroze them (DynaMo LR_B); LoRA excluded."""
    if not any(p.requires_grad for p in model.base_head_parameters()):
        return {}
    if model.backbone.is_quantized:
        raise UsageError("cannot save a trained final layer of a quantized backbone",
                         "train head 1 on a float backbone, or keep it frozen")
    lora = {id(p) for p in model.lora_parameters()}
    out = {}
    for prefix, module in _base_head_modules(model).items():
        for name, p in module.named_parameters():
            if id(p) not in lora:
                out[f"{BASE_HEAD_PREFIX}{prefix}.{name}"] = p
    return out


def save_heads(model, out_dir: str | Path, extra: dict[str, str] | None = None, command: str = "save_heads") -> Path:
    """Write the heads dir ``out_dir`` all or nothing (staged, then published: the files an
    existing heads dir's record lists are replaced, the config last; other files stay).
    ``extra`` maps more file names to text written with it (resolved configs, metrics);
    ``command`` is what the record says wrote it."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} exists and is not a directory", "pass a directory path for the heads")
    with staged_output(out, HEADS.kind, command, marker=HEADS.marker) as stage:
        write_heads(model, stage, draft_vocab=(extra or {}).get(DRAFT_VOCAB_FILE))
        for name, text in (extra or {}).items():
            (stage / name).write_text(text, encoding="utf-8")
    return out


def write_heads(model, out: Path, draft_vocab: str | None = None) -> None:
    """The files of a heads dir, into the new directory ``out`` (a staging dir); ``draft_vocab``:
    the text of the draft vocabulary written with them, whose sha256 the config records."""
    from importlib.metadata import version

    from safetensors.torch import save

    tensors = {**model.heads.state_dict(), **_base_head_tensors(model)}
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    check_finite(tensors, "the heads to write", "the weights diverged (a NaN or inf update): train again with a lower --lr")
    blob = save(tensors, metadata={"format": "pt"})
    backbone = model.backbone
    record = {
        "format_version": FORMAT_VERSION,
        "multitoken_version": version("multitoken"),
        "head_config": dataclasses.asdict(model.config),
        "base": portable_base(backbone.name),
        "model_type": backbone.model_type,
        "dtype": backbone.load_config.dtype,
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
        "dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()},
        "base_fingerprint": backbone.fingerprint(),
        "heads_sha256": hashlib.sha256(blob).hexdigest(),
        "lora": LORA_DIR if model.has_lora else None,
    }
    if draft_vocab is not None:  # read_ranking refuses a draft_vocab.json that differs
        record["draft_vocab_sha256"] = hashlib.sha256(draft_vocab.encode("utf-8")).hexdigest()
    (out / TENSORS_FILE).write_bytes(blob)
    if model.has_lora:
        model.base_model.save_pretrained(out / LORA_DIR)
    (out / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


# Loading -----------------------------------------------------------------------------------
def read_heads_config(heads_dir: str | Path) -> dict:
    path = Path(heads_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"no {CONFIG_FILE} in {str(heads_dir)!r}",
                              "pass a directory written by `multitoken attach` or `multitoken train`")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors;
        # RecursionError: arrays nested past Python's recursion limit
        raise CheckpointError(f"{path} is not valid JSON ({str(err).splitlines()[0]:.120})",
                              "the heads dir is damaged; re-create it") from None
    _check_heads_record(record, path)
    return record


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_fingerprint(v) -> bool:
    """The shape of ``Backbone.fingerprint()``, which ``fingerprints_match`` compares."""
    return (isinstance(v, dict) and isinstance(v.get("model_type"), str)
            and all(_is_int(v.get(k)) for k in ("vocab_size", "hidden_size", "num_layers"))
            and isinstance(v.get("embedding_probe"), list)
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v["embedding_probe"]))


# key -> (check, what it must be); every key is required except those marked optional below
_RECORD_SCHEMA = {
    "format_version": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "head_config": (lambda v: isinstance(v, dict) and isinstance(v.get("head_type"), str)
                    and _is_int(v.get("n_future")) and v["n_future"] >= 1,
                    "an object with head_type (text) and n_future (an integer >= 1)"),
    "base_fingerprint": (lambda v: _is_fingerprint(v),
                         "an object with model_type, vocab_size, hidden_size, num_layers and embedding_probe (numbers)"),
    "heads_sha256": (lambda v: isinstance(v, str) and len(v) == 64, "a sha256 hex digest"),
    "shapes": (lambda v: isinstance(v, dict) and all(isinstance(s, list) and all(_is_int(d) and d >= 0 for d in s)
                                                     for s in v.values()), "an object of integer lists"),
    "base": (lambda v: isinstance(v, str) and bool(v), "a model name or path"),
    "dtype": (lambda v: v is None or v in DTYPES, f"one of {', '.join(DTYPES)}, or null"),
    "lora": (lambda v: v is None or (isinstance(v, str) and bool(v)), "a directory name or null"),
}
_OPTIONAL = ("base", "dtype", "lora")


def _check_heads_record(record, path: Path) -> None:
    """Types and ranges of every field the loaders read; the LoRA dir must lie inside the heads dir."""
    fix = "the heads dir is damaged or from another tool; re-create it"
    if not isinstance(record, dict):
        raise CheckpointError(f"{path} holds a JSON {type(record).__name__}, not an object", fix)
    missing = [k for k in _RECORD_SCHEMA if k not in record and k not in _OPTIONAL]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}", fix)
    for key, (ok, what) in _RECORD_SCHEMA.items():
        if key in record and not ok(record[key]):
            raise CheckpointError(f"{path}: {key} must be {what}, got {record[key]!r:.60}", fix)
    if record["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {record['format_version']}, this multitoken reads up to {FORMAT_VERSION}",
                              "upgrade multitoken")
    if record.get("lora"):
        root = path.parent.resolve()
        lora = (root / record["lora"]).resolve()
        if lora == root or root not in lora.parents:
            raise CheckpointError(f"{path}: lora {record['lora']!r} points outside the heads dir",
                                  f"the LoRA adapter must be a directory inside the heads dir (e.g. {LORA_DIR!r}); re-create it")


def read_head_tensors(heads_dir: str | Path, record: dict) -> dict[str, torch.Tensor]:
    """The safetensors file, verified against the config's checksum and shapes."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(heads_dir) / TENSORS_FILE
    if not path.is_file():
        raise CheckpointError(f"no {TENSORS_FILE} in {str(heads_dir)!r}", "the heads dir is incomplete; re-create it")
    blob = path.read_bytes()
    if hashlib.sha256(blob).hexdigest() != record["heads_sha256"]:
        raise CheckpointError(f"{path} does not match the checksum in {CONFIG_FILE} (truncated, corrupt or replaced)",
                              "re-create the heads dir, or restore both files from the same save")
    try:
        tensors = load(blob)
    except SafetensorError as err:
        raise CheckpointError(f"{path} is not a valid safetensors file ({err})", "re-create the heads dir") from err
    shapes = {k: list(v.shape) for k, v in tensors.items()}
    if shapes != record["shapes"]:
        raise CheckpointError(f"{path} holds other tensors than {CONFIG_FILE} lists", "re-create the heads dir")
    check_finite(tensors, str(path), "these heads are unusable (training diverged): train them again with a lower --lr")
    return tensors


def _backbone_for(base, record: dict, heads_dir: Path, quantization, dtype, device, trainable_lora) -> Backbone:
    lora = heads_dir / record["lora"] if record.get("lora") else None
    if isinstance(base, Backbone):
        if lora is not None and not hasattr(base.model, "peft_config"):
            raise UsageError("these heads were trained with a LoRA adapter but the given backbone has none",
                             f"load the backbone with lora_adapter={str(lora)!r}, or pass the base name instead")
        return base
    config = base if isinstance(base, BackboneConfig) else BackboneConfig(base=str(base or record["base"]))
    overrides = {"quantization": quantization, "dtype": dtype, "device": device}
    if dtype is None and not isinstance(base, BackboneConfig):
        overrides["dtype"] = record.get("dtype")
    config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
    return load_backbone(config, lora_adapter=str(lora) if lora else None, trainable_lora=trainable_lora)


def load_heads(cls, base, heads_dir, *, quantization=None, dtype=None, device=None, trainable_lora=False, **kwargs):
    heads_dir = Path(heads_dir)
    record = read_heads_config(heads_dir)
    head_config = config_from_dict(record["head_config"])  # unknown type -> error naming the known ones
    tensors = read_head_tensors(heads_dir, record)  # checked before the (slow) backbone load
    backbone = _backbone_for(base, record, heads_dir, quantization, dtype, device, trainable_lora)
    if not fingerprints_match(record["base_fingerprint"], backbone.fingerprint()):
        raise MismatchError(
            f"the heads in {str(heads_dir)!r} were trained on {record.get('base')!r} "
            f"({record['base_fingerprint'].get('model_type')}), not on {backbone.name!r}",
            "load them onto the base model they were trained on",
        )
    heads = cls.new_heads(head_config, backbone)
    own = {k: v for k, v in tensors.items() if not k.startswith(BASE_HEAD_PREFIX)}
    expected = {k: list(v.shape) for k, v in heads.state_dict().items()}
    if {k: list(v.shape) for k, v in own.items()} != expected:
        raise CheckpointError(f"the saved tensors do not fit a {head_config.head_type} head built from its config",
                              "the heads dir is inconsistent; re-create it")
    heads.load_state_dict(own, strict=True)
    model = cls(backbone, heads, **kwargs)
    _restore_base_head(model, tensors)
    model.heads_dir = str(heads_dir)  # decoding reads what eval measured beside the heads (tree shapes)
    return model.eval()  # as transformers' from_pretrained: training (train.py) asks for train mode itself


def _restore_base_head(model, tensors: dict[str, torch.Tensor]) -> None:
    saved = {k[len(BASE_HEAD_PREFIX):]: v for k, v in tensors.items() if k.startswith(BASE_HEAD_PREFIX)}
    if not saved:
        return
    if model.backbone.is_quantized:
        raise UsageError("these heads carry a trained final layer, which cannot be loaded into a quantized backbone",
                         "load them without --quantization")
    params = {f"{prefix}.{name}": p for prefix, module in _base_head_modules(model).items()
              for name, p in module.named_parameters()}
    unknown = sorted(set(saved) - set(params))
    if unknown:
        raise CheckpointError(f"saved final-layer tensors {unknown[:3]} do not exist in this backbone",
                              "load the heads onto the base (and LoRA setting) they were trained with")
    with torch.no_grad():
        for name, value in saved.items():
            params[name].copy_(value)
