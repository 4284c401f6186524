"""Medusa heads in and out of the checkpoint layouts serving engines read.

Our Medusa head i (i = 1..n-1, predicting token t+i+1) is ``num_blocks`` residual blocks
``h <- h + SiLU(W h + b)`` on the base's final normalised hidden state, then the base's own
unembedding (``adapters/medusa.py``). The same function in the two layouts read here:

- **vLLM** (``vllm/model_executor/models/medusa.py``, ``vllm/transformers_utils/configs/medusa.py``):
  ``config.json`` (model_type ``medusa``, ``num_heads``, ``num_hidden_layers`` = blocks per head,
  ``hidden_size``, ``vocab_size``, ``truncated_vocab_size``, ``medusa_fc_bias``,
  ``original_lm_head``) and ``model.safetensors`` with ``blocks.{h}.layers.{l}.weight`` (+
  ``.bias`` when ``medusa_fc_bias``) and ``lm_heads.{h}.weight``; with ``original_lm_head`` one
  lm head serves every head and vLLM's loader reads it from ``lm_heads.0.weight``. vLLM's
  ``ResidualBlock`` computes ``x + SiLU(layer(x))`` layer by layer: ours exactly, so we write
  ``medusa_fc_bias: true`` (our blocks have a bias) and import a bias-free checkpoint with b = 0.
- **FasterDecoding/Medusa** (``medusa/model/medusa_model*.py``, ``train_legacy.py``):
  ``medusa_lm_head.safetensors`` holding ``{h}.{l}.linear.weight/bias`` (``ResBlock``:
  ``x + SiLU(linear(x))``, bias on) and, except in the legacy heads that reuse the base's lm
  head, ``{h}.{L}.weight`` (a per-head lm head), optionally under ``medusa_head.``; the config
  (``config.json`` or ``medusa_config.json``) gives ``medusa_num_heads`` / ``medusa_num_layers``.

An lm head is imported only when it equals the base's unembedding (in the lower of the two
precisions): our heads share it. Nothing is unpickled: weights are read from safetensors only.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from multitoken.adapters.registry import make_config
from multitoken.base.errors import CheckpointError, MismatchError, UsageError
from multitoken.base.finite import check_finite
from multitoken.base.outputs import MEDUSA_EXPORT
from multitoken.base.publish import staged_output
from multitoken.embedded import portable_base
from multitoken.pipeline.model.heads_io import BASE_HEAD_PREFIX, read_heads_config
from multitoken.pipeline.model.model import MultiTokenModel

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
README = "README.md"
LICENSE = "LICENSE"
FD_WEIGHTS = "medusa_lm_head.safetensors"
FD_CONFIGS = ("config.json", "medusa_config.json")
PICKLES = ("medusa_lm_head.pt", "pytorch_model.bin", "model.pt", "model.bin")
LM_HEADS = ("shared", "copies")  # one lm head with original_lm_head, or a copy per head
_LICENSE_FILES = ("LICENSE", "LICENSE.md", "LICENSE.txt", "LICENCE")


# Export ------------------------------------------------------------------------------------
def check_exportable(heads_dir: str, head_type: str = "medusa", *, drafts: str = "Medusa heads",
                     server: str = "vLLM", holder: str = "vLLM's medusa") -> None:
    """One line for heads an engine cannot serve as they were trained (read from the heads dir's
    record, before the base loads): ``--format head_type`` takes only ``head_type`` heads with
    ``drafts`` to export, trained on a frozen base that ``server`` serves and ``holder`` holds."""
    record = read_heads_config(heads_dir)
    kind, n = record["head_config"]["head_type"], record["head_config"]["n_future"]
    if kind != head_type:
        raise UsageError(f"--format {head_type} exports {head_type} heads; {heads_dir} holds {kind} heads",
                         f"export a heads dir made with `multitoken attach --head {head_type}` (and trained)")
    if n < 2:
        raise UsageError(f"{heads_dir} has no {drafts} to export (n_future 1: only the base's own head)",
                         f"attach {head_type} heads with --n 2 or more")
    if record.get("lora"):
        raise UsageError(f"the heads in {heads_dir} were trained with a LoRA adapter on the base; {server} would "
                         "serve them on the untuned base", "train the heads on a frozen base, or merge the adapter into the base first")
    if any(k.startswith(BASE_HEAD_PREFIX) for k in record["shapes"]):
        raise UsageError(f"the heads in {heads_dir} carry a retrained final layer of the base, which {holder} "
                         "cannot hold", "export heads trained on a frozen base")


def vllm_tensors(model: MultiTokenModel, lm_heads: str = "shared") -> dict[str, torch.Tensor]:
    """Our state dict under vLLM's names (same tensors, same dtype), plus the lm head(s)."""
    if getattr(model.backbone.unembedding, "bias", None) is not None:
        raise UsageError("the base's unembedding has a bias; vLLM's medusa lm heads have none", "export heads of another base")
    out = {}
    for name, value in model.heads.state_dict().items():
        m = re.fullmatch(r"blocks\.(\d+)\.(\d+)\.linear\.(weight|bias)", name)
        if m is None:
            raise CheckpointError(f"unexpected tensor {name} in medusa heads", "the heads dir is inconsistent; re-create it")
        out[f"blocks.{m[1]}.layers.{m[2]}.{m[3]}"] = value
    unembed = model.backbone.unembedding.weight.detach()
    for h in range(model.n_future - 1 if lm_heads == "copies" else 1):
        out[f"lm_heads.{h}.weight"] = unembed
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}


def vllm_config(model: MultiTokenModel, lm_heads: str, dtype: torch.dtype, license_note: str) -> dict:
    from importlib.metadata import version

    bb = model.backbone
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": bb.hidden_size,
        "vocab_size": bb.vocab_size,
        "truncated_vocab_size": bb.vocab_size,
        "num_heads": model.n_future - 1,
        "num_hidden_layers": model.config.num_blocks,
        "medusa_fc_bias": True,
        "original_lm_head": lm_heads == "shared",
        "torch_dtype": str(dtype).removeprefix("torch."),
        # no top-level key may hold "num" (vLLM's MedusaConfig.from_pretrained renames those)
        "multitoken": {"version": version("multitoken"), "base": portable_base(bb.name), "base_model_type": bb.model_type,
                       "base_license": license_note,
                       "head_config": {"head_type": "medusa", "n_future": model.n_future,
                                       "num_blocks": model.config.num_blocks}},
    }


def base_license(name: str) -> tuple[Path | None, str]:
    """The base's licence file (copied beside the export) and how the record names it."""
    root = Path(name).expanduser()
    for f in _LICENSE_FILES:
        if (root / f).is_file():
            return root / f, f"the base's {f}, copied here as {LICENSE}"
    fetched = root / "conversion.json"  # a `multitoken fetch` conversion records its package's licence
    if fetched.is_file():
        try:
            licence = json.loads(fetched.read_text(encoding="utf-8")).get("licence")
        except ValueError:
            licence = None
        if isinstance(licence, str) and licence:
            return None, f"{licence} (recorded by multitoken fetch)"
    card = root / "README.md"
    if card.is_file():
        m = re.search(r"^license:\s*(\S+)", card.read_text(encoding="utf-8", errors="replace"), re.M)
        if m:
            return None, f"{m[1]} (the base's model card)"
    return None, f"not recorded with the base: see the model card of {portable_base(name)}"


def write_medusa(model: MultiTokenModel, out: str | Path, *, lm_heads: str = "shared", command: str = "export") -> Path:
    """Write ``model``'s Medusa heads to ``out`` in vLLM's layout, all or nothing, recorded."""
    from safetensors.torch import save

    tensors = vllm_tensors(model, lm_heads)
    check_finite(tensors, "the heads to export", "these heads are unusable: train them again with a lower --lr")
    dtype = model.heads.blocks[0][0].linear.weight.dtype
    licence, note = base_license(model.backbone.name)
    config = vllm_config(model, lm_heads, dtype, note)
    with staged_output(out, MEDUSA_EXPORT.kind, command, marker=CONFIG) as stage:
        (stage / WEIGHTS).write_bytes(save(tensors, metadata={"format": "pt"}))
        if licence is not None:
            shutil.copyfile(licence, stage / LICENSE)
        (stage / README).write_text(_readme(config), encoding="utf-8")
        (stage / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return Path(out)


def _readme(config: dict) -> str:
    mt = config["multitoken"]
    return (f"# Medusa heads for {mt['base']}\n\n"
            f"{config['num_heads']} Medusa heads ({config['num_hidden_layers']} residual block(s) each) trained with "
            f"multitoken {mt['version']} for the base `{mt['base']}` ({mt['base_model_type']}), in vLLM's `medusa` "
            "speculative-model layout. Serve them only on that base: the lm head is a copy of its unembedding.\n\n"
            f"Licence: the base's terms apply to these weights ({mt['base_license']}).\n\n"
            "Read them back with `multitoken import --format medusa DIR --base BASE --out HEADS`.\n")


# Import ------------------------------------------------------------------------------------
@dataclass
class MedusaCheckpoint:
    """A Medusa checkpoint as read: per head its blocks ``[(W, b or None)]`` and lm heads by index."""

    layout: str  # "vllm" or "fasterdecoding"
    path: Path
    blocks: list[list[tuple[torch.Tensor, torch.Tensor | None]]]
    lm_heads: dict[int, torch.Tensor] = field(default_factory=dict)  # head index -> [V, H]
    vocab_size: int | None = None


def _fail(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"{path}: {problem}", "pass a Medusa checkpoint in vLLM's or FasterDecoding's layout")


def _json(path: Path) -> dict:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise _fail(path, f"not valid JSON ({err})") from err
    if not isinstance(record, dict):
        raise _fail(path, f"holds a JSON {type(record).__name__}, not an object")
    return record


def _int(record: dict, key: str, path: Path, default=None) -> int:
    v = record.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise _fail(path / CONFIG if path.is_dir() else path, f"{key} must be an integer >= 1, got {v!r:.40}")
    return v


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(path.read_bytes())
    except (OSError, SafetensorError) as err:
        raise _fail(path, f"not a readable safetensors file ({err})") from err
    check_finite(tensors, str(path), "this checkpoint is unusable (NaN or inf weights)")
    return tensors


def read_medusa(path: str | Path) -> MedusaCheckpoint:
    """Read a Medusa checkpoint directory (the layout is told by its weights file)."""
    root = Path(path)
    if not root.is_dir():
        raise UsageError(f"{path} is not a directory", "pass the directory of a Medusa checkpoint")
    if (root / WEIGHTS).is_file():
        return _read_vllm(root)
    if (root / FD_WEIGHTS).is_file():
        return _read_fasterdecoding(root)
    pickled = [p for p in PICKLES if (root / p).exists()]
    if pickled:
        raise CheckpointError(f"{root / pickled[0]} is a pickle; multitoken reads weights from safetensors only",
                              "convert it to safetensors (safetensors.torch.save_file) in a trusted environment, then rerun")
    raise _fail(root, f"holds neither {WEIGHTS} (vLLM) nor {FD_WEIGHTS} (FasterDecoding)")


def _read_vllm(root: Path) -> MedusaCheckpoint:
    if not (root / CONFIG).is_file():
        raise _fail(root, f"has {WEIGHTS} but no {CONFIG}")
    cfg = _json(root / CONFIG)
    if cfg.get("model_type") != "medusa":
        raise _fail(root / CONFIG, f"model_type is {cfg.get('model_type')!r}, not 'medusa'")
    heads, layers = _int(cfg, "num_heads", root), _int(cfg, "num_hidden_layers", root, 1)
    vocab = _int(cfg, "vocab_size", root)
    if cfg.get("truncated_vocab_size", vocab) != vocab:
        raise UsageError(f"{root} drafts from a truncated vocabulary ({cfg['truncated_vocab_size']} of {vocab} tokens, "
                         "a token_map); multitoken's Medusa heads draft over the whole vocabulary", "import a checkpoint without token_map")
    bias, shared = bool(cfg.get("medusa_fc_bias", False)), bool(cfg.get("original_lm_head", False))
    tensors = {k.removeprefix("medusa_heads."): v for k, v in _safetensors(root / WEIGHTS).items()}
    if "token_map" in tensors:
        raise UsageError(f"{root} holds a token_map (a truncated draft vocabulary)", "import a checkpoint without token_map")
    take = lambda key: tensors.pop(key, None)  # noqa: E731
    blocks = []
    for h in range(heads):
        blocks.append([])
        for ell in range(layers):
            w, b = take(f"blocks.{h}.layers.{ell}.weight"), take(f"blocks.{h}.layers.{ell}.bias")
            if w is None:
                raise _fail(root / WEIGHTS, f"lacks blocks.{h}.layers.{ell}.weight")
            if (b is None) == bias:
                problem = "lacks its bias (medusa_fc_bias is true)" if bias else "has a bias but medusa_fc_bias is false"
                raise _fail(root / WEIGHTS, f"blocks.{h}.layers.{ell} {problem}")
            blocks[-1].append((w, b))
    lm = {}
    for h in range(1 if shared else heads):
        w = take(f"lm_heads.{h}.weight")
        w = take("lm_head.weight") if w is None and shared else w
        if w is None:
            raise _fail(root / WEIGHTS, f"lacks lm_heads.{h}.weight")
        lm[h] = w
    if shared:
        tensors = {k: v for k, v in tensors.items() if not re.fullmatch(r"lm_heads\.\d+\.weight", k)}  # vLLM ignores them
    if tensors:
        raise _fail(root / WEIGHTS, f"holds tensors a medusa model of {CONFIG} does not have ({', '.join(sorted(tensors)[:3])})")
    return MedusaCheckpoint("vllm", root, blocks, lm, vocab)


def _read_fasterdecoding(root: Path) -> MedusaCheckpoint:
    configs = [root / c for c in FD_CONFIGS if (root / c).is_file()]
    if not configs:
        raise _fail(root, f"has {FD_WEIGHTS} but no {' or '.join(FD_CONFIGS)}")
    cfg = _json(configs[0])
    layers = _int(cfg, "medusa_num_layers", configs[0], 1)
    found: dict[int, dict] = {}
    for key, value in _safetensors(root / FD_WEIGHTS).items():
        name = key.removeprefix("medusa_head.")
        m = re.fullmatch(r"(\d+)\.(\d+)\.linear\.(weight|bias)", name) or re.fullmatch(r"(\d+)\.(\d+)\.(weight)", name)
        if m is None or ("linear" not in name and int(m[2]) != layers) or ("linear" in name and int(m[2]) >= layers):
            raise _fail(root / FD_WEIGHTS, f"unexpected tensor {key} for medusa_num_layers {layers}")
        found.setdefault(int(m[1]), {})[name.split(".", 1)[1]] = value
    heads = len(found)
    if sorted(found) != list(range(heads)) or heads == 0:
        raise _fail(root / FD_WEIGHTS, f"holds heads {sorted(found)[:6]}, not 0..n-1")
    if "medusa_num_heads" in cfg and cfg["medusa_num_heads"] != heads:
        raise _fail(configs[0], f"medusa_num_heads is {cfg['medusa_num_heads']!r} but {FD_WEIGHTS} holds {heads} heads")
    blocks, lm = [], {}
    for h in range(heads):
        t = found[h]
        missing = [f"{h}.{ell}.linear.{p}" for ell in range(layers) for p in ("weight", "bias") if f"{ell}.linear.{p}" not in t]
        if missing:
            raise _fail(root / FD_WEIGHTS, f"lacks {missing[0]}")
        blocks.append([(t[f"{ell}.linear.weight"], t[f"{ell}.linear.bias"]) for ell in range(layers)])
        if f"{layers}.weight" in t:
            lm[h] = t[f"{layers}.weight"]
    if lm and len(lm) != heads:
        raise _fail(root / FD_WEIGHTS, f"has an lm head for {len(lm)} of {heads} heads")
    return MedusaCheckpoint("fasterdecoding", root, blocks, lm)


def _exact_cast(t: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    out = t.to(dtype)
    if not torch.equal(out.to(t.dtype), t):
        raise UsageError(f"{what} is {str(t.dtype).removeprefix('torch.')}; the base loads in "
                         f"{str(dtype).removeprefix('torch.')}, which would round it",
                         f"pass --dtype {str(t.dtype).removeprefix('torch.')}")
    return out


def heads_from_checkpoint(ckpt: MedusaCheckpoint, backbone) -> MultiTokenModel:
    """Our Medusa heads on ``backbone`` holding ``ckpt``'s weights exactly (refuses what differs)."""
    hidden, vocab = backbone.hidden_size, backbone.vocab_size
    layers = {len(b) for b in ckpt.blocks}
    if len(layers) != 1:
        raise _fail(ckpt.path, "its heads have different numbers of residual layers")
    if ckpt.vocab_size is not None and ckpt.vocab_size != vocab:
        raise MismatchError(f"{ckpt.path} is for a vocabulary of {ckpt.vocab_size}, the base has {vocab}",
                            "import it onto the base it was trained for (--base)")
    unembed = backbone.unembedding.weight.detach()
    for h, w in ckpt.lm_heads.items():
        if list(w.shape) != [vocab, hidden]:
            raise MismatchError(f"{ckpt.path}: the lm head of head {h + 1} is {list(w.shape)}, the base's unembedding "
                                f"[{vocab}, {hidden}]", "import it onto the base it was trained for (--base)")
        w = w.to(unembed.device)  # equal in the lower of the two precisions (a bfloat16 copy of a float32 base)
        if not (torch.equal(w, unembed.to(w.dtype)) or torch.equal(w.to(unembed.dtype), unembed)):
            raise UsageError(f"{ckpt.path}: the lm head of Medusa head {h + 1} differs from the base's unembedding; "
                             "multitoken's Medusa heads share the base's, so it cannot be represented",
                             "import heads trained with the base's lm head frozen (or onto the base they were trained for)")
    config = make_config("medusa", n_future=len(ckpt.blocks) + 1, num_blocks=layers.pop())
    model = MultiTokenModel.attach(backbone, config)
    state = {}
    for name, p in model.heads.state_dict().items():
        h, ell, kind = re.fullmatch(r"blocks\.(\d+)\.(\d+)\.linear\.(weight|bias)", name).groups()
        w, b = ckpt.blocks[int(h)][int(ell)]
        value = w if kind == "weight" else (b if b is not None else torch.zeros(hidden, dtype=w.dtype))
        if value.shape != p.shape:
            raise MismatchError(f"{ckpt.path}: head {int(h) + 1}'s layer {ell} {kind} is {list(value.shape)}, the base "
                                f"needs {list(p.shape)}", "import it onto the base it was trained for (--base)")
        state[name] = _exact_cast(value, p.dtype, f"head {int(h) + 1}'s layer {ell} {kind}")
    model.heads.load_state_dict(state, strict=True)
    return model
